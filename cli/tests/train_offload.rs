//! `chorus train --offload` end to end, for each model (`mlp`, `gpt`,
//! `llama`, `moe`) on 2 simulated ranks: the losses equal the run without
//! offload bit for bit; summary.json's `peak_host_memory_bytes` is positive
//! and its device `peak_memory_bytes` drops by at least the offloaded state
//! docs/fsdp.md's formula gives (`k·ΣS − max S`, with `S_g` a group's padded
//! f32 shard bytes and `k` the master plus the optimizer's state buffers),
//! computed here from the model's parameter shapes.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{chorus, run_bounded, scratch, text};
use serde_json::Value;

const WORLD: usize = 2;

/// Runs `chorus train --model model args` on 2 sim ranks into `dir`, with
/// or without `--offload`, and returns its summary.
fn train(dir: &Path, model: &str, args: &[&str], offload: bool) -> Value {
    let out = dir.join(if offload { "offload" } else { "plain" });
    let mut cmd = chorus();
    cmd.args(["train", "--model", model, "--world-size", "2", "--steps", "3", "--out-dir"]).arg(&out).args(args);
    if offload {
        cmd.arg("--offload");
    }
    let r = run_bounded(&mut cmd, Duration::from_secs(300));
    assert!(r.status.success(), "{model} offload {offload}: {}", text(&r.stderr));
    serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap()
}

/// The param group a parameter belongs to, by the models' naming: a layer
/// (`layers.{i}`, `blocks.{i}`, `model.layers.{i}`), an expert of one
/// (`blocks.{i}.experts.{e}`), or the root.
fn group_of(name: &str) -> String {
    for layer in ["model.layers.", "blocks.", "layers."] {
        if let Some(rest) = name.strip_prefix(layer) {
            let parts: Vec<&str> = rest.split('.').collect();
            return match parts.as_slice() {
                [i, "experts", e, ..] => format!("{layer}{i}.experts.{e}"),
                [i, ..] => format!("{layer}{i}"),
                [] => unreachable!("split yields at least one part"),
            };
        }
    }
    "root".into()
}

/// Each group's padded f32 shard bytes on one of `WORLD` ranks: every
/// parameter sharded on its first dimension, rows padded to a multiple of
/// the world.
fn shard_bytes(params: &[(String, Vec<usize>)]) -> Vec<usize> {
    let mut groups: std::collections::BTreeMap<String, usize> = Default::default();
    for (name, shape) in params {
        let rest: usize = shape[1..].iter().product();
        *groups.entry(group_of(name)).or_default() += 4 * shape[0].div_ceil(WORLD) * rest;
    }
    groups.into_values().collect()
}

/// The transformer's parameters (`experts` = 0: gpt's MLP; else moe's) with
/// the sizes its summary records.
fn transformer(sizes: &Value, experts: usize) -> Vec<(String, Vec<usize>)> {
    let n = |k: &str| sizes[k].as_u64().unwrap() as usize;
    let (v, d, f) = (n("vocab"), n("d_model"), n("d_ff"));
    let mut p = vec![
        ("embed.weight".to_string(), vec![v, d]),
        ("norm.weight".into(), vec![d]),
        ("head.weight".into(), vec![v, d]),
    ];
    for i in 0..n("layers") {
        let b = format!("blocks.{i}");
        p.push((format!("{b}.attn_norm.weight"), vec![d]));
        p.push((format!("{b}.mlp_norm.weight"), vec![d]));
        for w in ["q", "k", "v", "o"] {
            p.push((format!("{b}.attn.{w}.weight"), vec![d, d]));
        }
        if experts == 0 {
            p.push((format!("{b}.mlp.up.weight"), vec![f, d]));
            p.push((format!("{b}.mlp.down.weight"), vec![d, f]));
        } else {
            p.push((format!("{b}.router.weight"), vec![experts, d]));
            for e in 0..experts {
                p.push((format!("{b}.experts.{e}.up.weight"), vec![f, d]));
                p.push((format!("{b}.experts.{e}.down.weight"), vec![d, f]));
            }
        }
    }
    p
}

/// The Llama's parameters (untied) with the sizes its summary records.
fn llama(c: &Value) -> Vec<(String, Vec<usize>)> {
    assert_eq!(c["tie_word_embeddings"], false);
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let (v, h, i, hd) = (n("vocab_size"), n("hidden_size"), n("intermediate_size"), n("head_dim"));
    let (q, kv) = (n("num_attention_heads") * hd, n("num_key_value_heads") * hd);
    let mut p = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![v, h]),
    ];
    for l in 0..n("num_hidden_layers") {
        let b = format!("model.layers.{l}");
        for (w, shape) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            p.push((format!("{b}.{w}.weight"), shape));
        }
    }
    p
}

/// The MLP's parameters for its `dims`.
fn mlp(dims: &Value) -> Vec<(String, Vec<usize>)> {
    let d: Vec<usize> = dims.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    (0..d.len() - 1)
        .flat_map(|i| {
            [(format!("layers.{i}.weight"), vec![d[i + 1], d[i]]), (format!("layers.{i}.bias"), vec![d[i + 1]])]
        })
        .collect()
}

/// Checks the run with offload against the run without: the same losses bit
/// for bit, host memory used only with offload, and per rank a device peak
/// lower by at least `k·ΣS − max S` and at most `(k + 1)·ΣS`.
fn check(model: &str, plain: &Value, off: &Value, params: &[(String, Vec<usize>)], k: usize) {
    assert_eq!(plain["losses"].as_array().unwrap().len(), 3, "{model}");
    // serde_json writes each f64 in the shortest form that reads back to the same bits.
    assert_eq!(plain["losses"], off["losses"], "{model}: losses differ with --offload");
    let s = shard_bytes(params);
    let (sum, max) = (s.iter().sum::<usize>(), s.iter().copied().max().unwrap());
    let peaks = |v: &Value, key: &str| -> Vec<usize> {
        v[key].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect()
    };
    let (without, with) = (peaks(plain, "peak_memory_bytes"), peaks(off, "peak_memory_bytes"));
    assert_eq!((without.len(), with.len()), (WORLD, WORLD), "{model}");
    assert!(peaks(plain, "peak_host_memory_bytes").iter().all(|h| *h == 0), "{model}: host memory without offload");
    assert!(peaks(off, "peak_host_memory_bytes").iter().all(|h| *h > 0), "{model}: no host memory with offload");
    for r in 0..WORLD {
        let drop = without[r] as i64 - with[r] as i64;
        let (low, high) = ((k * sum - max) as i64, ((k + 1) * sum) as i64);
        eprintln!(
            "{model} rank {r}: ΣS {sum}, max S {max}, peak {} -> {}, drop {drop} in {low} ..= {high}",
            without[r], with[r]
        );
        assert!(
            (low..=high).contains(&drop),
            "{model} rank {r}: the device peak drops by {drop}, not {low} ..= {high}"
        );
    }
}

#[test]
fn offload_equals_no_offload_and_moves_the_state_off_the_device() {
    let dir = scratch("offload");
    // SGD with momentum: the master and the momentum (k = 2).
    let args = ["--dims", "8,16,4", "--batch", "4", "--momentum", "0.9"];
    let (plain, off) = (train(&dir.join("mlp"), "mlp", &args, false), train(&dir.join("mlp"), "mlp", &args, true));
    check("mlp", &plain, &off, &mlp(&plain["config"]["dims"]), 2);
    // AdamW (the default): the master and two moments (k = 3).
    let small = ["--layers", "1", "--heads", "2", "--seq-len", "8", "--batch", "2"];
    let gpt = [&small[..], &["--d-model", "16", "--d-ff", "32"]].concat();
    let (plain, off) = (train(&dir.join("gpt"), "gpt", &gpt, false), train(&dir.join("gpt"), "gpt", &gpt, true));
    check("gpt", &plain, &off, &transformer(&plain["config"]["transformer"], 0), 3);
    let moe = [&gpt[..], &["--experts", "3"]].concat();
    let (plain, off) = (train(&dir.join("moe"), "moe", &moe, false), train(&dir.join("moe"), "moe", &moe, true));
    assert_eq!(plain["config"]["transformer"]["experts"], 3);
    check("moe", &plain, &off, &transformer(&plain["config"]["transformer"], 3), 3);
    let llama_args = [&small[..], &["--hidden", "16", "--kv-heads", "1"]].concat();
    let (plain, off) =
        (train(&dir.join("llama"), "llama", &llama_args, false), train(&dir.join("llama"), "llama", &llama_args, true));
    check("llama", &plain, &off, &llama(&plain["config"]["llama"]), 3);
    let _ = std::fs::remove_dir_all(&dir);
}
