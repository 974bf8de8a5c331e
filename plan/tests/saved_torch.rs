//! The activations the planner says PyTorch keeps for a Llama layer's
//! backward without recomputation (`Framework::TorchEager.decoder_work(…,
//! RecomputeMode::None)`) against what PyTorch's autograd keeps for a
//! transformers `LlamaDecoderLayer` in bf16 and f32 with SDPA attention
//! (`torch/saved_activations.py`: every saved tensor seen by a
//! `saved_tensors_hooks` pack hook, once per storage, less the parameters
//! and the rotary tables). Multi-head shapes only: with grouped-query
//! attention transformers passes `enable_gqa` to SDPA where torchtitan
//! (what the planner models) repeats the keys and values first.
//! Ignored unless run with `--ignored`, as `ci/test.sh` does after
//! `source ci/python-env.sh`.

use crate::torch_python;

use std::process::Command;

use chorus_plan::decoder_cost::Framework;
use chorus_plan::workload::{DecoderKind, DecoderShape, RecomputeMode};

fn pytorch_saved_bytes(python: &str, args: [usize; 6], dtype: &str) -> u64 {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/torch/saved_activations.py");
    let out = Command::new(python)
        .arg(script)
        .args(args.iter().map(|a| a.to_string()))
        .arg(dtype)
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    assert!(out.status.success(), "{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{line}: {e}"));
    json["saved_bytes"].as_u64().unwrap_or_else(|| panic!("no saved_bytes in {line}"))
}

#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn a_layers_saved_activations_equal_pytorchs() {
    let python = torch_python::torch_python("torch, transformers");
    // hidden, heads, intermediate, sequence, batch, dtype
    let cases = [(512, 8, 1376, 256, 2, "bf16"), (256, 4, 704, 128, 3, "bf16"), (768, 12, 2048, 64, 4, "bf16")];
    for (d, heads, f, s, b, dtype) in cases.into_iter().chain([(256, 4, 704, 128, 3, "f32")]) {
        let bytes = if dtype == "f32" { 4 } else { 2 };
        let shape = DecoderShape {
            kind: DecoderKind::Llama,
            layers: 1,
            d_model: d,
            heads,
            kv_heads: heads,
            ffn_hidden: f,
            vocab: 128,
            tied_embeddings: false,
        };
        let layer = &Framework::TorchEager.decoder_work(&shape, b, s, bytes, RecomputeMode::None)[1];
        let torch = pytorch_saved_bytes(&python, [d, heads, heads, f, s, b], dtype);
        let case = format!("d {d} heads {heads} ffn {f} seq {s} batch {b} {dtype}");
        println!("{case}: planner {} B, PyTorch {torch} B", layer.saved_bytes);
        assert_eq!(layer.saved_bytes, torch, "{case}");
    }
}
