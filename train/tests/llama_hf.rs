//! Hugging Face model directories: made here with the safetensors crate
//! (single file and sharded with the index; f32, bf16, f16), loaded shard
//! by shard under FSDP at 1, 2 and 3 ranks, and written back (split, f32
//! and bf16) and read again; and the config.json spellings and rejections.

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig};
use chorus_train::models::llama;
use chorus_train::models::llama::config::{ConfigError, LlamaConfig};
use chorus_train::models::llama::hf::{self as llama_hf, HfError, SaveDtype};
use common::on_sim_ranks;
use safetensors::Dtype;

fn config() -> LlamaConfig {
    LlamaConfig { head_dim: 4, ..LlamaConfig::new(11, 8, 12, 2, 2, 1) }
}

/// Distinct values for every parameter (element i of tensor t: a small
/// number exact in bf16 and f16).
fn values(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    cfg.param_shapes()
        .into_iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let n: usize = shape.iter().product();
            let v = (0..n).map(|i| ((t * 37 + i) % 64) as f32 / 16.0 - 2.0).collect();
            (name, shape, v)
        })
        .collect()
}

fn encode(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
        d => panic!("{d:?}"),
    }
}

/// Writes `cfg` and `tensors` as `save_pretrained` does: `files` safetensors
/// files (round-robin), with the index when more than one.
fn make_dir(dir: &Path, cfg_json: &str, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype, files: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), cfg_json).unwrap();
    let mut weight_map = serde_json::Map::new();
    for f in 0..files {
        let name = if files == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{files:05}.safetensors", f + 1)
        };
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| i % files == f)
            .map(|(_, (n, s, v))| (n.clone(), s.clone(), encode(v, dtype)))
            .collect();
        let views: Vec<_> = bytes
            .iter()
            .map(|(n, s, b)| {
                weight_map.insert(n.clone(), serde_json::Value::from(name.clone()));
                (n.clone(), safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap())
            })
            .collect();
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        std::fs::write(dir.join(&name), safetensors::tensor::serialize(views, Some(meta)).unwrap()).unwrap();
    }
    if files > 1 {
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join(llama_hf::INDEX), index.to_string()).unwrap();
    }
}

fn hf_json(cfg: &LlamaConfig) -> String {
    cfg.to_hf_json("float32").to_string()
}

/// Loads `dir` under FSDP at `ranks` ranks and returns every rank's all-gathered parameters.
/// With `last_dim`, every parameter is sharded on its last dimension (the
/// sources are asked for columns).
fn load_sharded(dir: &Path, ranks: usize, last_dim: bool) -> Vec<Vec<(String, Vec<f32>)>> {
    let dir = dir.to_path_buf();
    on_sim_ranks(ranks, move |comm| {
        let hf = llama_hf::open(&dir).unwrap();
        let placement: chorus_fsdp::ShardPlacement = Arc::new(|_: &str, _: &[usize]| -1);
        let config = FsdpConfig { shard_placement: last_dim.then_some(placement), ..FsdpConfig::default() };
        let fsdp = Fsdp::new(DataParallel::fsdp(comm), config).unwrap();
        let m = llama::shard(fsdp, Arc::new(hf.config), hf.params, false).unwrap();
        m.model.with_fsdp(|f| f.full_parameters()).unwrap().unwrap()
    })
}

fn expected(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = tensors.iter().map(|(n, _, v)| (n.clone(), v.clone())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn sorted(mut v: Vec<(String, Vec<f32>)>) -> Vec<(String, Vec<f32>)> {
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("chorus-llama-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn sharded_dirs_in_f32_bf16_f16_load_shard_by_shard() {
    let cfg = config();
    let tensors = values(&cfg);
    for (dtype, files) in [(Dtype::F32, 1), (Dtype::F32, 3), (Dtype::BF16, 2), (Dtype::F16, 4)] {
        let dir = tempdir(&format!("{dtype:?}-{files}"));
        make_dir(&dir, &hf_json(&cfg), &tensors, dtype, files);
        for (ranks, last_dim) in [(1, false), (2, false), (3, false), (3, true)] {
            for got in load_sharded(&dir, ranks, last_dim) {
                assert_eq!(
                    sorted(got),
                    expected(&tensors),
                    "{dtype:?} in {files} file(s) at {ranks} ranks, {last_dim}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn written_dirs_split_by_size_and_read_back() {
    let cfg = config();
    let tensors = values(&cfg);
    let params: Vec<(String, Vec<f32>)> = tensors.iter().map(|(n, _, v)| (n.clone(), v.clone())).collect();
    for (dtype, max, files) in [(SaveDtype::F32, 1 << 30, 1), (SaveDtype::F32, 1000, 0), (SaveDtype::BF16, 700, 0)] {
        let dir = tempdir(&format!("write-{dtype:?}-{max}"));
        std::fs::create_dir_all(&dir).unwrap();
        let written = llama_hf::write(&dir, &cfg, &params, dtype, max).unwrap();
        let shards = written.iter().filter(|p| p.extension().is_some_and(|e| e == "safetensors")).count();
        if files == 1 {
            assert_eq!(shards, 1);
            assert!(dir.join("model.safetensors").exists() && !dir.join(llama_hf::INDEX).exists());
        } else {
            assert!(shards > 1 && dir.join(llama_hf::INDEX).exists(), "{shards} files");
            for p in &written {
                let len = std::fs::metadata(p).unwrap().len();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    // The header is small; the data of one file stays within the limit (one tensor is under it here).
                    assert!(len < max as u64 + 2048, "{name}: {len} bytes");
                }
            }
        }
        let hf = llama_hf::open(&dir).unwrap();
        assert_eq!(hf.config, cfg);
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        assert!(text.contains(&format!("\"torch_dtype\": \"{}\"", dtype.torch_name())));
        // f32 round-trips exactly; the values are exact in bf16 too.
        let got: Vec<(String, Vec<f32>)> = llama::materialize(&hf.params)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        assert_eq!(sorted(got), expected(&tensors));
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // bf16 rounds to nearest even, as torch does.
    let dir = tempdir("bf16-rounding");
    std::fs::create_dir_all(&dir).unwrap();
    let mut odd = params.clone();
    odd[0].1[0] = 1.0 + 3.0 / 256.0; // halfway between two bf16 values: rounds to even (1 + 4/256)
    odd[0].1[1] = 1.0 + 1.0 / 256.0; // halfway: rounds to even (1.0)
    llama_hf::write(&dir, &cfg, &odd, SaveDtype::BF16, 1 << 30).unwrap();
    let hf = llama_hf::open(&dir).unwrap();
    let e = hf.params[0].source.read_rows(0, 0..1).unwrap();
    assert_eq!((e[0], e[1]), (1.0 + 4.0 / 256.0, 1.0));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_dirs_are_errors_naming_the_problem() {
    let cfg = config();
    let tensors = values(&cfg);
    let check = |name: &str, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype, want: &str| {
        let dir = tempdir(name);
        make_dir(&dir, &hf_json(&cfg), tensors, dtype, 2);
        let err = llama_hf::open(&dir).err().unwrap_or_else(|| panic!("{name}: loaded"));
        assert!(matches!(err, HfError::Weights { .. }) && err.to_string().contains(want), "{name}: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    };
    check("missing", &tensors[1..], Dtype::F32, "no tensor model.embed_tokens.weight");
    let mut wrong = tensors.clone();
    wrong[1].1 = vec![4, 2];
    check("shape", &wrong, Dtype::F32, "has shape [4, 2]");
    let mut extra = tensors.clone();
    extra.push(("model.layers.9.mlp.up_proj.weight".into(), vec![2], vec![0.0, 1.0]));
    check("extra", &extra, Dtype::F32, "model.layers.9.mlp.up_proj.weight is not a parameter");
    check("dtype", &tensors, Dtype::I32, "chorus loads f32, bf16 or f16");
    let dir = tempdir("nothing");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), hf_json(&cfg)).unwrap();
    assert!(llama_hf::open(&dir).err().unwrap().to_string().contains("neither model.safetensors"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A FIFO as `config.json` or as `model.safetensors` is refused at once,
/// naming it (reading one would block until some writer came).
#[cfg(unix)]
#[test]
fn fifos_are_refused_not_read() {
    let cfg = config();
    for file in ["config.json", "model.safetensors"] {
        let dir = tempdir(&format!("fifo-{file}"));
        make_dir(&dir, &hf_json(&cfg), &values(&cfg), Dtype::F32, 1);
        common::mkfifo(&dir.join(file));
        let err = llama_hf::open(&dir).err().unwrap_or_else(|| panic!("{file}: a FIFO loaded"));
        assert!(err.to_string().contains("not a regular file") && err.to_string().contains(file), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// `model.safetensors` beside an index (here naming files that are not
/// there): the single file is loaded, as transformers does.
#[test]
fn a_single_file_beside_an_index_is_the_one_loaded() {
    let cfg = config();
    let tensors = values(&cfg);
    let dir = tempdir("both");
    make_dir(&dir, &hf_json(&cfg), &tensors, Dtype::F32, 1);
    let index = serde_json::json!({"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}});
    std::fs::write(dir.join(llama_hf::INDEX), index.to_string()).unwrap();
    for got in load_sharded(&dir, 2, false) {
        assert_eq!(sorted(got), expected(&tensors));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One tensor's offsets corrupted onto the next one's: the error names the
/// corrupt one, not its neighbour (safetensors blames whichever sorts first).
#[test]
fn a_corrupt_offset_is_reported_against_its_own_tensor() {
    let cfg = config();
    let dir = tempdir("offset");
    make_dir(&dir, &hf_json(&cfg), &values(&cfg), Dtype::F32, 1);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut spans: Vec<(u64, u64, String)> = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(k, v)| (v["data_offsets"][0].as_u64().unwrap(), v["data_offsets"][1].as_u64().unwrap(), k.clone()))
        .collect();
    spans.sort();
    // A tensor followed by one of another size (so only one tensor can have moved).
    let i = (0..spans.len() - 1).find(|&i| spans[i].1 - spans[i].0 != spans[i + 1].1 - spans[i + 1].0).unwrap();
    let (first, second) = (&spans[i], &spans[i + 1]);
    let size = first.1 - first.0;
    header[&first.2]["data_offsets"] = serde_json::json!([second.0, second.0 + size]);
    let text = serde_json::to_vec(&header).unwrap();
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&text);
    file.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, file).unwrap();
    let err = llama_hf::open(&dir).err().unwrap().to_string();
    assert!(err.contains(&format!("tensor {}:", first.2)) && !err.contains(&second.2), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

const V4: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
  "max_position_embeddings": 64, "mlp_bias": false, "num_attention_heads": 4,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 500000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.46.0",
  "use_cache": true, "vocab_size": 96
}"#;

/// [`V4`] as transformers 5 writes it: the rope settings nested, `dtype`
/// for `torch_dtype`.
fn v5() -> String {
    let v5 = V4
        .replace(
            r#""rope_scaling": null, "rope_theta": 500000.0"#,
            r#""rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}"#,
        )
        .replace(
            r#""torch_dtype": "bfloat16", "transformers_version": "4.46.0""#,
            r#""dtype": "bfloat16", "transformers_version": "5.0.0""#,
        );
    assert!(v5.contains("rope_parameters") && v5.contains(r#""dtype""#), "{v5}");
    v5
}

#[test]
fn config_json_in_both_spellings() {
    let a = LlamaConfig::from_json(V4).unwrap();
    let b = LlamaConfig::from_json(&v5()).unwrap();
    assert_eq!(a, b);
    assert_eq!((a.rope_theta, a.num_key_value_heads, a.head_dim, a.vocab_size), (500000.0, 2, 8, 96));
    assert_eq!((a.rms_norm_eps, a.tie_word_embeddings, a.bos_token_id), (1e-5, false, Some(1)));
    // What chorus writes reads back the same.
    assert_eq!(LlamaConfig::from_json(&a.to_hf_json("float32").to_string()).unwrap(), a);
    // Defaults: kv heads = heads, head_dim = hidden / heads, theta 10000.
    let minimal = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2}"#;
    let m = LlamaConfig::from_json(minimal).unwrap();
    assert_eq!((m.num_key_value_heads, m.head_dim, m.rope_theta), (2, 4, 10000.0));
}

#[test]
fn unsupported_config_fields_are_errors_naming_them() {
    let with = |key: &str, value: &str| {
        let mut v: serde_json::Value = serde_json::from_str(V4).unwrap();
        v[key] = serde_json::from_str(value).unwrap();
        LlamaConfig::from_json(&v.to_string())
    };
    for (key, value) in [
        ("rope_scaling", r#"{"rope_type": "llama3", "factor": 8.0}"#),
        ("attention_bias", "true"),
        ("mlp_bias", "true"),
        ("sliding_window", "4096"),
        ("hidden_act", "\"gelu\""),
        ("model_type", "\"mistral\""),
        ("torch_dtype", "\"int8\""),
        ("attention_dropout", "0.1"),
    ] {
        match with(key, value) {
            Err(ConfigError::Unsupported { field, .. }) => assert_eq!(field, key),
            other => panic!("{key} = {value}: {other:?}"),
        }
    }
    let mut v: serde_json::Value = serde_json::from_str(&v5()).unwrap();
    v["rope_parameters"]["rope_type"] = "yarn".into();
    match LlamaConfig::from_json(&v.to_string()) {
        Err(ConfigError::Unsupported { field, .. }) => assert_eq!(field, "rope_parameters.rope_type"),
        other => panic!("{other:?}"),
    }
    // The default written as rope_scaling is accepted.
    assert!(with("rope_scaling", r#"{"rope_type": "default"}"#).is_ok());
    assert!(matches!(with("num_key_value_heads", "3"), Err(ConfigError::Invalid { field: "num_key_value_heads", .. })));
    assert!(matches!(with("hidden_size", "\"big\""), Err(ConfigError::Invalid { field: "hidden_size", .. })));
    let mut v: serde_json::Value = serde_json::from_str(V4).unwrap();
    v.as_object_mut().unwrap().remove("vocab_size");
    assert_eq!(LlamaConfig::from_json(&v.to_string()), Err(ConfigError::Missing("vocab_size")));
    let mut v: serde_json::Value = serde_json::from_str(&v5()).unwrap();
    v["rope_theta"] = 10.0.into();
    assert!(matches!(LlamaConfig::from_json(&v.to_string()), Err(ConfigError::Invalid { field: "rope_theta", .. })));
}
