//! Kernel-rates files and the GPU model priced from them
//! (`chorus plan --kernels candle|chorus --kernel-rates FILE`): the files
//! chorus ships parse and pass the checks; every bad number, a missing
//! entry and another format are refused by name; and each kernel's, copy's
//! and host operation's time is the closed form of `docs/plan-costs.md`.

use chorus_devices::MemorySpace;
use chorus_plan::cost::{CostModel, HostCost, Issuer, KernelCost, KernelKind, KernelOp};
use chorus_plan::gpu::gpu_spec;
use chorus_plan::kernel_rates::{KernelRates, KernelRatesError, FORMAT};
use chorus_plan::rated_gpu::RatedGpuModel;

fn shipped() -> KernelRates {
    KernelRates::default_for("h200").expect("the shipped H200 file parses")
}

fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v = serde_json::to_value(shipped()).unwrap();
    edit(&mut v);
    v.to_string()
}

fn refused(text: &str) -> KernelRatesError {
    match KernelRates::from_json(text) {
        Ok(r) => panic!("accepted {r:?}"),
        Err(e) => e,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-12)
}

#[test]
fn the_shipped_files_parse_and_round_trip() {
    for gpu in ["h100-sxm", "h200"] {
        let r = KernelRates::default_for(gpu).unwrap_or_else(|| panic!("{gpu}'s file"));
        assert_eq!(r.format, FORMAT);
        assert!(r.gpu.contains(if gpu == "h200" { "H200" } else { "H100" }), "{}", r.gpu);
        assert!(!r.source.is_empty() && !r.host.source.is_empty());
        assert!(r.runtime_bytes > 0);
        assert_eq!(KernelRates::from_json(&serde_json::to_string(&r).unwrap()).unwrap(), r);
    }
    assert!(KernelRates::default_for("a100-80gb").is_none());
}

#[test]
fn every_bad_number_is_refused_by_name() {
    assert!(matches!(refused("not json"), KernelRatesError::Json(_)));
    assert!(matches!(refused("{}"), KernelRatesError::Json(_)));
    assert!(matches!(refused(&edited(|v| v["format"] = "chorus-kernel-rates-0".into())), KernelRatesError::Format(_)));
    assert!(matches!(refused(&edited(|v| v["extra"] = 1.into())), KernelRatesError::Json(_)));
    // Every entry must be there.
    assert!(matches!(
        refused(&edited(|v| drop(v["kernels"].as_object_mut().unwrap().remove("swiglu_backward")))),
        KernelRatesError::Json(_)
    ));
    for entry in ["rms_norm", "rope_backward", "attention", "cross_entropy", "elementwise", "copy", "gemm"] {
        let e = refused(&edited(|v| v["kernels"][entry]["gb_per_s"] = 0.into()));
        assert!(e.to_string().contains(&format!("kernels.{entry}.gb_per_s")), "{e}");
        let e = refused(&edited(|v| v["kernels"][entry]["launch_us"] = (-1.0).into()));
        assert!(e.to_string().contains(&format!("kernels.{entry}.launch_us")), "{e}");
    }
    let e = refused(&edited(|v| v["kernels"]["attention_backward"]["tflop_per_s"] = serde_json::Value::Null));
    assert!(e.to_string().contains("attention_backward.tflop_per_s"), "{e}");
    let e = refused(&edited(|v| v["kernels"]["swiglu"]["tflop_per_s"] = (-5.0).into()));
    assert!(e.to_string().contains("swiglu.tflop_per_s"), "{e}");
    let e = refused(&edited(|v| v["kernels"]["gemm"]["tflop_per_s"] = serde_json::json!([])));
    assert!(e.to_string().contains("tflop_per_s"), "{e}");
    let e = refused(&edited(|v| v["kernels"]["gemm"]["tflop_per_s"] = serde_json::json!([[2.0, 100.0], [1.0, 200.0]])));
    assert!(e.to_string().contains("larger than the point before"), "{e}");
    let e = refused(&edited(|v| v["kernels"]["gemm"]["tflop_per_s"] = serde_json::json!([[1.0, 0.0]])));
    assert!(e.to_string().contains("TFLOP/s"), "{e}");
    for field in ["model_op_us", "fsdp_hook_us", "fsdp_op_us", "copy_piece_us", "optimizer_launch_us", "collective_us"]
    {
        let e = refused(&edited(|v| v["host"][field] = (-1e-3).into()));
        assert!(e.to_string().contains(&format!("host.{field}")), "{e}");
        // Zero is a price: a copy batched into one launch has no cost per piece.
        assert!(KernelRates::from_json(&edited(|v| v["host"][field] = 0.into())).is_ok(), "{field}");
    }
    // Out of f64's range: serde_json refuses it rather than reading infinity.
    let text = edited(|v| v["kernels"]["copy"]["gb_per_s"] = 1234.5.into()).replace("1234.5", "1e999");
    assert!(matches!(refused(&text), KernelRatesError::Json(_)));
    assert!(matches!(refused(&edited(|v| v["runtime_bytes"] = (-1).into())), KernelRatesError::Json(_)));
}

/// Round rates: a GEMM at 100 TFLOP/s below 1 GFLOP rising to 400 at 100
/// GFLOP (log-linear between), every kernel 1,000 GB/s and 2 µs a launch,
/// attention 200 TFLOP/s forward and 100 backward, the host's constants 1 to 6 µs.
fn round() -> KernelRates {
    let mut r = shipped();
    r.kernels.gemm.tflop_per_s = vec![[1.0, 100.0], [100.0, 400.0]];
    r.kernels.gemm.gb_per_s = 1000.0;
    r.kernels.gemm.launch_us = 2.0;
    let mut all = [
        &mut r.kernels.rms_norm,
        &mut r.kernels.rms_norm_backward,
        &mut r.kernels.rope,
        &mut r.kernels.rope_backward,
        &mut r.kernels.attention,
        &mut r.kernels.attention_backward,
        &mut r.kernels.swiglu,
        &mut r.kernels.swiglu_backward,
        &mut r.kernels.cross_entropy,
        &mut r.kernels.cross_entropy_backward,
        &mut r.kernels.elementwise,
        &mut r.kernels.copy,
    ];
    for k in all.iter_mut() {
        k.gb_per_s = 1000.0;
        k.launch_us = 2.0;
        k.tflop_per_s = None;
    }
    r.kernels.attention.tflop_per_s = Some(200.0);
    r.kernels.attention_backward.tflop_per_s = Some(100.0);
    r.host.model_op_us = 1.0;
    r.host.fsdp_hook_us = 2.0;
    r.host.fsdp_op_us = 3.0;
    r.host.copy_piece_us = 4.0;
    r.host.optimizer_launch_us = 5.0;
    r.host.collective_us = 6.0;
    r.check().unwrap();
    r
}

fn model() -> RatedGpuModel {
    RatedGpuModel::new(round(), gpu_spec("h200").unwrap(), 8)
}

#[test]
fn a_kernel_takes_its_larger_bound_plus_a_launch() {
    let m = model();
    let launch = 2e-6;
    let k = |op, kind, flops, bytes| KernelCost::new("k", kind, flops, bytes).with_op(op);
    // A GEMM of 10 GFLOP: halfway in log between the points, 250 TFLOP/s.
    let gemm = k(KernelOp::Gemm, KernelKind::Gemm, 10e9, 1e6);
    assert!(close(m.kernel_seconds(&gemm), 10e9 / 250e12 + launch), "{}", m.kernel_seconds(&gemm));
    // Below the first point and above the last: their rates.
    assert!(close(m.kernel_seconds(&k(KernelOp::Gemm, KernelKind::Gemm, 1e8, 0.0)), 1e8 / 100e12 + launch));
    assert!(close(m.kernel_seconds(&k(KernelOp::Gemm, KernelKind::Gemm, 1e12, 0.0)), 1e12 / 400e12 + launch));
    // Memory-bound: 1 GB at 1,000 GB/s.
    let big = k(KernelOp::Gemm, KernelKind::Gemm, 10e9, 1e9);
    assert!(close(m.kernel_seconds(&big), 1e-3 + launch));
    for op in [
        KernelOp::RmsNorm,
        KernelOp::RopeBackward,
        KernelOp::SwigluBackward,
        KernelOp::CrossEntropy,
        KernelOp::Elementwise,
    ] {
        assert!(close(m.kernel_seconds(&k(op, KernelKind::MemoryBound, 0.0, 2e9)), 2e-3 + launch), "{op:?}");
    }
    // Causal attention does half the counted FLOPs, forward at 200 TFLOP/s, backward at 100.
    let attn = k(KernelOp::Attention, KernelKind::Attention, 4e12, 1e6);
    assert!(close(m.kernel_seconds(&attn), 2e12 / 200e12 + launch));
    let attn_back = k(KernelOp::AttentionBackward, KernelKind::Attention, 4e12, 1e6);
    assert!(close(m.kernel_seconds(&attn_back), 2e12 / 100e12 + launch));
}

#[test]
fn copies_collectives_peak_and_the_hosts_costs() {
    let m = model();
    // A device copy reads and writes its bytes at the copy rate; PCIe as the H200's spec says.
    assert!(close(
        m.copy_seconds(1 << 30, MemorySpace::Device, MemorySpace::Device),
        2.0 * (1u64 << 30) as f64 / 1e12 + 2e-6
    ));
    let pcie = chorus_plan::gpu::cost_model("h200", 8).unwrap();
    assert_eq!(
        m.copy_seconds(1 << 30, MemorySpace::Host, MemorySpace::Device),
        pcie.copy_seconds(1 << 30, MemorySpace::Host, MemorySpace::Device)
    );
    assert_eq!(m.peak_flops(), Some(989e12));
    let shape = chorus_plan::cost::CollectiveShape {
        op: chorus_collectives::OpKind::AllGather,
        bytes: 1 << 26,
        ranks: (0..16).collect(),
    };
    assert_eq!(m.collective_seconds(&shape), pcie.collective_seconds(&shape));
    // The host issues each operation at the file's price; the GPU runs it.
    for (issuer, us) in [
        (Issuer::Model, 1.0),
        (Issuer::Hook, 2.0),
        (Issuer::Fsdp, 3.0),
        (Issuer::CopyPiece, 4.0),
        (Issuer::Optimizer, 5.0),
        (Issuer::Collective, 6.0),
    ] {
        assert_eq!(m.host_cost(issuer), HostCost { issue_s: us * 1e-6, runs_on_host: false }, "{issuer:?}");
    }
    // Where ranks sit on nodes of 8: a group inside one node and one across two differ.
    assert!(m.prices_alike(&[0, 1, 2, 3], &[4, 5, 6, 7]));
    assert!(!m.prices_alike(&[0, 1, 2, 3], &[6, 7, 8, 9]));
}
