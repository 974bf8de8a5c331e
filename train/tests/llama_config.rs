//! Issue 24: a Llama's sizes are bounded before anything is computed from
//! them, counted without listing them, and errors name them as their
//! source does (`config.json`'s fields or `chorus train`'s flags).

use chorus_train::models::llama::config::{ConfigError, LlamaConfig, Names, MAX_LAYERS};

fn config_json(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v = serde_json::json!({
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    });
    edit(&mut v);
    v.to_string()
}

/// `num_hidden_layers: 100000000` is refused at once (before, listing the
/// tensors' names for the memory check ran the machine out of memory).
#[test]
fn huge_sizes_are_refused_before_anything_is_listed() {
    let started = std::time::Instant::now();
    for (field, value) in [
        ("num_hidden_layers", 100_000_000u64),
        ("vocab_size", 1 << 40),
        ("hidden_size", 1 << 40),
        ("intermediate_size", 1 << 40),
        ("num_attention_heads", 1 << 40),
        ("head_dim", 1 << 40),
        ("max_position_embeddings", 1 << 40),
    ] {
        match LlamaConfig::from_json(&config_json(|v| v[field] = value.into())) {
            Err(ConfigError::Invalid { field: f, why }) => {
                assert_eq!(f, field, "{why}");
                assert!(why.contains("at most"), "{why}");
            }
            other => panic!("{field} {value}: {other:?}"),
        }
    }
    // Heads × head_dim too wide, each within its own bound.
    let wide = config_json(|v| {
        v["num_attention_heads"] = 4096.into();
        v["num_key_value_heads"] = 4096.into();
        v["head_dim"] = 4096.into();
    });
    assert!(matches!(LlamaConfig::from_json(&wide), Err(ConfigError::Invalid { field: "head_dim", .. })));
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "refused at once");
    let at_most = LlamaConfig { num_hidden_layers: MAX_LAYERS, ..LlamaConfig::new(32, 16, 24, 2, 4, 2) };
    assert!(at_most.validate().is_ok(), "the bound itself is allowed");
}

/// The count is the sum of the listed shapes, and saturates instead of
/// overflowing for a config no bound was checked on.
#[test]
fn the_parameter_count_is_the_listed_shapes_summed() {
    for tied in [false, true] {
        let cfg = LlamaConfig { tie_word_embeddings: tied, head_dim: 6, ..LlamaConfig::new(37, 16, 24, 3, 4, 2) };
        let listed: usize = cfg.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(cfg.num_params(), listed, "tied {tied}");
    }
    let huge = LlamaConfig { num_hidden_layers: usize::MAX, ..LlamaConfig::new(usize::MAX, 1 << 40, 1 << 40, 1, 1, 1) };
    assert_eq!(huge.num_params(), usize::MAX);
}

/// `hidden_size 30` with 4 heads: the message says head_dim 7 is derived
/// as 30 / 4; the same sizes from flags are named as flags, not as
/// `config.json`'s fields.
#[test]
fn messages_name_the_sizes_as_their_source_does() {
    let err = LlamaConfig::from_json(&config_json(|v| v["hidden_size"] = 30.into())).unwrap_err().to_string();
    assert!(err.contains("`head_dim` 7 (= `hidden_size` 30 / `num_attention_heads` 4)"), "{err}");
    assert!(!err.contains("config.json"), "the caller names the file: {err}");
    let flags = LlamaConfig::new(32, 30, 24, 2, 4, 2).validate_as(Names::Flags).unwrap_err().to_string();
    assert!(flags.contains("(= --hidden 30 / --heads 4)") && flags.contains("even"), "{flags}");
    let kv = LlamaConfig::new(32, 16, 24, 2, 4, 3).validate_as(Names::Flags).unwrap_err().to_string();
    assert_eq!(kv, "--kv-heads 3 does not divide --heads 4");
    let layers = LlamaConfig::new(32, 16, 24, 3_000_000, 4, 2).validate_as(Names::Flags).unwrap_err().to_string();
    assert!(layers.starts_with("--layers 3000000 is more than"), "{layers}");
}
