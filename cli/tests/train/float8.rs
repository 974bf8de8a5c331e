//! `--all-gather-dtype float8` (docs/fsdp.md, "Float8 all-gather"): a short
//! run of each model stays within a stated loss gap of the same run gathering
//! in bf16, and the flag's misuses are usage errors.

use super::{no_panic, run, scratch, stderr, summary, SMALL_GPT_MODEL};

/// The largest per-step loss difference allowed between float8 and bf16
/// all-gather over 20 steps of the small transformer. Measured: 0.0057 at
/// the default transformer (2 ranks), 0.0033 for the small one; float8
/// weights sit within 2^-4 relative of bf16's, which moves a loss near 3 by
/// well under 1 %.
const LOSS_GAP: f64 = 0.03;

fn losses(dir: &std::path::Path) -> Vec<f64> {
    summary(dir)["losses"].as_array().expect("losses").iter().map(|v| v.as_f64().expect("a loss")).collect()
}

/// Trains `model_args` for `steps` on 2 ranks with bf16 params, gathering in
/// `all_gather`, and returns the per-step losses.
fn train(root: &std::path::Path, model_args: &[&str], steps: &str, all_gather: &str) -> Vec<f64> {
    let out = root.join(all_gather);
    let args = [
        model_args,
        &["--world-size", "2", "--steps", steps, "--param-dtype", "bf16", "--all-gather-dtype", all_gather],
        &["--out-dir", out.to_str().unwrap()],
    ]
    .concat();
    let o = run(&args);
    no_panic(&o);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    losses(&out)
}

fn largest_gap(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn float8_all_gather_trains_the_transformer_within_the_loss_gap_of_bf16() {
    let root = scratch("float8-gpt");
    let small = [SMALL_GPT_MODEL, &["--batch", "4"]].concat();
    let bf16 = train(&root, &small, "20", "bf16");
    let f8 = train(&root, &small, "20", "float8");
    let gap = largest_gap(&bf16, &f8);
    eprintln!("20 steps, per-step |loss(float8) - loss(bf16)| <= {gap:.5}; final {:.4} vs {:.4}", f8[19], bf16[19]);
    assert!(gap <= LOSS_GAP, "loss gap {gap} over {LOSS_GAP}");
    assert!(gap > 0.0, "float8 all-gather changed nothing: was it used?");
    assert!(f8[19] < f8[0], "float8 training did not learn: {f8:?}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn float8_all_gather_trains_the_mlp_and_the_llama() {
    let root = scratch("float8-models");
    let mlp = ["train", "--model", "mlp"];
    let (a, b) = (train(&root.join("mlp"), &mlp, "10", "bf16"), train(&root.join("mlp"), &mlp, "10", "float8"));
    let gap = largest_gap(&a, &b);
    assert!(gap <= LOSS_GAP && gap > 0.0, "mlp: loss gap {gap}");
    let llama = ["train", "--model", "llama", "--layers", "1", "--batch", "2"];
    let (a, b) = (train(&root.join("llama"), &llama, "3", "bf16"), train(&root.join("llama"), &llama, "3", "float8"));
    let gap = largest_gap(&a, &b);
    assert!(gap <= LOSS_GAP && gap > 0.0, "llama: loss gap {gap}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn float8_is_an_all_gather_dtype_not_a_compute_dtype() {
    for (args, why) in [
        (&["train", "--model", "mlp", "--param-dtype", "float8"][..], "--all-gather-dtype float8"),
        (
            &["train", "--model", "mlp", "--param-dtype", "bf16", "--all-gather-dtype", "f16"][..],
            "--all-gather-dtype f16",
        ),
        (&["train", "--model", "mlp", "--all-gather-dtype", "i8"][..], "not an all-gather dtype"),
    ] {
        let o = run(args);
        no_panic(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    }
}
