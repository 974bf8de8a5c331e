//! The cpu device's float8 scaled casts (`abs_max`, `quantize_f8`,
//! `dequantize_f8`: torchao's tensorwise recipe) against an independent
//! NumPy implementation of the recipe and against torch's `float8_e4m3fn`
//! (`float8_reference.py`, run with `$CHORUS_PYTHON`; ignored unless run
//! with `--ignored`, as `ci/test.sh` does after `source ci/python-env.sh`).
//! The hand-checked encodings that need no Python are unit tests in
//! `src/dtype.rs`.

use crate::torch_python;

use std::path::Path;
use std::process::Command;

use chorus_devices::cpu::{CpuConfig, CpuDevice};
use chorus_devices::{bf16, Buffer, DType, Device, Float8E4M3, Priority, Stream, StreamExt};

/// Tensors that reach every case of the recipe: ties of the rounding
/// (an amax of exactly 448 gives scale 1, so the midpoints between e4m3
/// values are cast as they are), subnormals, saturation (a value rounding
/// past 448 after scaling in f32), an all-zero tensor (the scale's eps) and
/// random values over magnitudes from 1e-6 to 5e3.
fn tensors() -> Vec<Vec<f32>> {
    let codes: Vec<f32> = (0u8..0x7f).map(|c| Float8E4M3(c).to_f32()).collect();
    let mut ties: Vec<f32> = codes.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    ties.extend(codes.iter().flat_map(|v| [*v, -*v]));
    ties.extend([448.0, -447.0, 0.3, 1.0e-4]);
    let mut out = vec![ties, vec![0.0; 17]];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for magnitude in [1e-6f32, 0.02, 1.0, 300.0, 5000.0] {
        // Cubed: many small values beside the largest, so subnormals appear.
        out.push((0..4099).map(|_| uniform().powi(3) * magnitude).collect());
    }
    out
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).unwrap_or_else(|e| panic!("writing {name}: {e}"));
}

#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn scaled_casts_match_numpy_and_torch() -> chorus_devices::Result<()> {
    let python = torch_python::torch_python("numpy, torch");
    let dir = std::env::temp_dir().join(format!("chorus-float8-{}", std::process::id()));
    std::fs::create_dir(&dir).expect("a fresh temporary directory");
    let dev = CpuDevice::new(CpuConfig::default());
    let s = dev.create_stream(Priority::Normal)?;
    let all = tensors();
    for (t, x) in all.iter().enumerate() {
        let n = x.len();
        let input = s.buffer_from(x)?;
        let amax = dev.alloc(DType::F32, 1)?;
        s.abs_max(input.view(), amax.view(), false)?;
        let q = dev.alloc(DType::F8E4M3, n)?;
        s.quantize_f8(input.view(), amax.view(), q.view())?;
        let (d32, d16) = (dev.alloc(DType::F32, n)?, dev.alloc(DType::BF16, n)?);
        s.dequantize_f8(q.view(), amax.view(), d32.view())?;
        s.dequantize_f8(q.view(), amax.view(), d16.view())?;
        write(&dir, &format!("x{t}.bin"), bytemuck::cast_slice(x));
        write(&dir, &format!("amax{t}.bin"), bytemuck::cast_slice(&s.read_vec::<f32>(amax.view())?));
        write(&dir, &format!("q{t}.bin"), bytemuck::cast_slice(&s.read_vec::<Float8E4M3>(q.view())?));
        write(&dir, &format!("d32_{t}.bin"), bytemuck::cast_slice(&s.read_vec::<f32>(d32.view())?));
        write(&dir, &format!("d16_{t}.bin"), bytemuck::cast_slice(&s.read_vec::<bf16>(d16.view())?));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/float8_reference.py");
    let out = Command::new(&python).arg(&script).arg(&dir).arg(all.len().to_string()).output().expect("running python");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("ok {} tensors", all.len()));
    Ok(())
}
