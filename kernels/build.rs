//! With the `cuda` feature: `cuda/chorus_kernels.cu` compiled to PTX by nvcc
//! (`$NVCC`, else `nvcc` on the PATH; ci/candle-cuda.sh sets `NVCC` for the
//! whole build, as candle's own kernels need it), embedded by `src/cuda.rs`.
//! The PTX targets compute capability 8.0 (`CHORUS_KERNELS_ARCH` overrides):
//! the kernels use mma.sync and ldmatrix, which every GPU since the A100
//! runs, and the driver compiles the PTX for the GPU it finds.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CHORUS_KERNELS_ARCH");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let arch = std::env::var("CHORUS_KERNELS_ARCH").unwrap_or_else(|_| "compute_80".to_string());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("chorus_kernels.ptx");
    let result = Command::new(&nvcc)
        .args(["-ptx", "-std=c++17", "-O3", &format!("-arch={arch}"), "-o"])
        .arg(&out)
        .arg("cuda/chorus_kernels.cu")
        .output();
    match result {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("{nvcc} could not compile cuda/chorus_kernels.cu:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => panic!(
            "the `cuda` feature of chorus-kernels needs nvcc ({nvcc}: {e}); `source ci/candle-cuda.sh` installs one"
        ),
    }
}
