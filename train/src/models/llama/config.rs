//! A Llama's `config.json` as the Hugging Face hub's files have it, in both
//! spellings (transformers 4: top-level `rope_theta` and `torch_dtype`;
//! transformers 5: `rope_parameters {rope_theta, rope_type}` and `dtype`),
//! and the config.json chorus writes back. A field whose setting the model
//! does not implement is an error naming it, never ignored; every size is
//! bounded (the `MAX_*` constants) before anything is computed from it.

use serde_json::{json, Map, Value};

/// Most decoder layers a config may have (the largest released Llama has 126).
pub const MAX_LAYERS: usize = 1 << 16;
/// Widest a config's `hidden_size`, `intermediate_size` and heads × `head_dim` may be.
pub const MAX_WIDTH: usize = 1 << 20;
/// Most attention heads (query or key/value) a config may have.
pub const MAX_HEADS: usize = 1 << 16;
/// Largest vocabulary a config may have.
pub const MAX_VOCAB: usize = 1 << 24;
/// Longest `max_position_embeddings` a config may have.
pub const MAX_POSITIONS: usize = 1 << 24;

/// What is wrong with a Llama's configuration (a `config.json`, whose path
/// the caller adds, or the sizes given as flags).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or not an object.
    #[error("not a JSON object: {0}")]
    Json(String),
    /// A required field is absent.
    #[error("has no `{0}`")]
    Missing(&'static str),
    /// A field has the wrong type or an impossible value.
    #[error("{why}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong, naming the field as the configuration's source does.
        why: String,
    },
    /// A field asks for something this Llama does not implement.
    #[error("`{field}` = {value} is not supported by chorus's Llama ({why})")]
    Unsupported {
        /// The field.
        field: String,
        /// Its value, as JSON.
        value: String,
        /// What chorus implements instead.
        why: &'static str,
    },
}

/// How errors name a configuration's sizes: as `config.json`'s fields, or
/// as `chorus train`'s flags that give them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// `hidden_size`, `num_attention_heads`, ...
    ConfigJson,
    /// `--hidden`, `--heads`, ...
    Flags,
}

impl Names {
    fn of(self, field: &str) -> String {
        let flag = match field {
            "vocab_size" => "--vocab",
            "hidden_size" => "--hidden",
            "intermediate_size" => "--intermediate",
            "num_hidden_layers" => "--layers",
            "num_attention_heads" => "--heads",
            "num_key_value_heads" => "--kv-heads",
            _ => "",
        };
        match self {
            Names::Flags if !flag.is_empty() => flag.to_string(),
            _ => format!("`{field}`"),
        }
    }
}

/// A Llama's sizes and settings (transformers' `LlamaConfig`, the fields
/// that change what `LlamaForCausalLM` computes).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest sequence the model is for.
    pub max_position_embeddings: usize,
    /// RMSNorm's epsilon.
    pub rms_norm_eps: f64,
    /// RoPE's base.
    pub rope_theta: f64,
    /// Standard deviation of the initial weights.
    pub initializer_range: f64,
    /// The LM head is the embedding's matrix.
    pub tie_word_embeddings: bool,
    /// The padding token (its embedding row starts at zero).
    pub pad_token_id: Option<usize>,
    /// Beginning-of-sequence token, carried through to the written config.
    pub bos_token_id: Option<usize>,
    /// End-of-sequence token, carried through to the written config.
    pub eos_token_id: Option<Value>,
}

impl LlamaConfig {
    /// A config from chorus's own sizes (no `config.json`), with
    /// transformers' defaults for the rest.
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> LlamaConfig {
        LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: hidden_size / num_attention_heads.max(1),
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            initializer_range: 0.02,
            tie_word_embeddings: false,
            pad_token_id: None,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Parses `config.json`'s text.
    pub fn from_json(text: &str) -> Result<LlamaConfig, ConfigError> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let o = v.as_object().ok_or_else(|| ConfigError::Json("the top level is not an object".into()))?;
        check_supported(o)?;
        let hidden_size = usize_field(o, "hidden_size")?.ok_or(ConfigError::Missing("hidden_size"))?;
        let heads = usize_field(o, "num_attention_heads")?.ok_or(ConfigError::Missing("num_attention_heads"))?;
        let rope_theta = match o.get("rope_parameters").filter(|v| !v.is_null()) {
            Some(p) => f64_in(p, "rope_theta", "rope_parameters.rope_theta")?,
            None => None,
        };
        let rope_theta = match (rope_theta, f64_field(o, "rope_theta")?) {
            (Some(a), Some(b)) if a != b => {
                return Err(ConfigError::Invalid {
                    field: "rope_theta",
                    why: format!("`rope_theta` is {b} at the top level but {a} in rope_parameters"),
                })
            }
            (a, b) => a.or(b).unwrap_or(10000.0),
        };
        let cfg = LlamaConfig {
            vocab_size: usize_field(o, "vocab_size")?.ok_or(ConfigError::Missing("vocab_size"))?,
            hidden_size,
            intermediate_size: usize_field(o, "intermediate_size")?.ok_or(ConfigError::Missing("intermediate_size"))?,
            num_hidden_layers: usize_field(o, "num_hidden_layers")?.ok_or(ConfigError::Missing("num_hidden_layers"))?,
            num_attention_heads: heads,
            num_key_value_heads: usize_field(o, "num_key_value_heads")?.unwrap_or(heads),
            head_dim: usize_field(o, "head_dim")?.unwrap_or(hidden_size / heads.max(1)),
            max_position_embeddings: usize_field(o, "max_position_embeddings")?.unwrap_or(2048),
            rms_norm_eps: f64_field(o, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            initializer_range: f64_field(o, "initializer_range")?.unwrap_or(0.02),
            tie_word_embeddings: match o.get("tie_word_embeddings") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ConfigError::Invalid {
                        field: "tie_word_embeddings",
                        why: "`tie_word_embeddings` is not a bool".into(),
                    })
                }
            },
            pad_token_id: usize_field(o, "pad_token_id")?,
            bos_token_id: usize_field(o, "bos_token_id")?,
            eos_token_id: o.get("eos_token_id").filter(|v| !v.is_null()).cloned(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the sizes against their bounds and each other, naming them
    /// as `config.json` does.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_as(Names::ConfigJson)
    }

    /// [`validate`](Self::validate), naming the sizes as `names` says.
    pub fn validate_as(&self, names: Names) -> Result<(), ConfigError> {
        let n = |f: &str| names.of(f);
        let bounded = [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_key_value_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_WIDTH),
            ("max_position_embeddings", self.max_position_embeddings, MAX_POSITIONS),
        ];
        for (field, v, max) in bounded {
            if v > max {
                return Err(ConfigError::Invalid {
                    field,
                    why: format!("{} {v} is more than chorus's Llama takes (at most {max})", n(field)),
                });
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(ConfigError::Invalid { field, why: format!("{} must be positive", n(field)) });
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(ConfigError::Invalid {
                field: "num_key_value_heads",
                why: format!(
                    "{} {} does not divide {} {}",
                    n("num_key_value_heads"),
                    self.num_key_value_heads,
                    n("num_attention_heads"),
                    self.num_attention_heads
                ),
            });
        }
        let q = self.num_attention_heads.saturating_mul(self.head_dim);
        if q > MAX_WIDTH {
            return Err(ConfigError::Invalid {
                field: "head_dim",
                why: format!(
                    "{} {} × {} {} = {q} is wider than chorus's Llama takes (at most {MAX_WIDTH})",
                    n("num_attention_heads"),
                    self.num_attention_heads,
                    n("head_dim"),
                    self.head_dim
                ),
            });
        }
        if self.head_dim % 2 != 0 {
            // Where it is the derived width, say from what.
            let derived = if self.head_dim == self.hidden_size / self.num_attention_heads {
                format!(
                    " (= {} {} / {} {})",
                    n("hidden_size"),
                    self.hidden_size,
                    n("num_attention_heads"),
                    self.num_attention_heads
                )
            } else {
                String::new()
            };
            return Err(ConfigError::Invalid {
                field: "head_dim",
                why: format!("{} {}{derived} must be even for RoPE", n("head_dim"), self.head_dim),
            });
        }
        for (field, v) in [("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::Invalid {
                    field,
                    why: format!("{} {v} must be a finite number > 0", n(field)),
                });
            }
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return Err(ConfigError::Invalid {
                field: "initializer_range",
                why: format!("{} must be finite and ≥ 0", n("initializer_range")),
            });
        }
        Ok(())
    }

    /// Parameter names (as transformers names them) and shapes, in the
    /// order the model registers them: the embedding, each layer, the final
    /// norm, and the LM head unless it is tied.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (v, h, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let (q, kv) = (self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        out
    }

    /// Number of parameters ([`param_shapes`](Self::param_shapes)' sizes
    /// summed), computed without listing them and saturating, so any
    /// config's count is a number (`usize::MAX`: more than any machine).
    pub fn num_params(&self) -> usize {
        let (v, h, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let m = |a: usize, b: usize| a.saturating_mul(b);
        let (q, kv) = (m(self.num_attention_heads, self.head_dim), m(self.num_key_value_heads, self.head_dim));
        let layer =
            [m(2, h), m(q, h), m(m(2, kv), h), m(h, q), m(m(3, i), h)].iter().fold(0usize, |a, b| a.saturating_add(*b));
        let embeddings = if self.tie_word_embeddings { 1 } else { 2 };
        m(m(embeddings, v), h).saturating_add(m(self.num_hidden_layers, layer)).saturating_add(h)
    }

    /// The `config.json` chorus writes with a model in `dtype` (`"float32"`
    /// or `"bfloat16"`): readable by transformers 4 and 5 alike (both
    /// spellings of the RoPE base and the dtype).
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "pretraining_tp": 1,
            "use_cache": true,
            "torch_dtype": dtype,
            "dtype": dtype,
        });
        if let Some(o) = v.as_object_mut() {
            for (k, x) in [
                ("pad_token_id", self.pad_token_id.map(Value::from)),
                ("bos_token_id", self.bos_token_id.map(Value::from)),
                ("eos_token_id", self.eos_token_id.clone()),
            ] {
                if let Some(x) = x {
                    o.insert(k.into(), x);
                }
            }
        }
        v
    }
}

/// Rejects every setting `LlamaForCausalLM` has that this model does not compute.
fn check_supported(o: &Map<String, Value>) -> Result<(), ConfigError> {
    let unsupported = |field: &str, value: &Value, why: &'static str| ConfigError::Unsupported {
        field: field.to_string(),
        value: value.to_string(),
        why,
    };
    if let Some(v) = o.get("model_type") {
        if v != "llama" {
            return Err(unsupported("model_type", v, "only \"llama\""));
        }
    }
    if let Some(v) = o.get("rope_scaling").filter(|v| !v.is_null()) {
        // transformers 4.4x may write the default as {"rope_type": "default"}.
        let default_only = v.as_object().is_some_and(|m| {
            m.iter().all(|(k, x)| match k.as_str() {
                "rope_type" | "type" => x == "default",
                "rope_theta" => true,
                _ => false,
            })
        });
        if !default_only {
            return Err(unsupported("rope_scaling", v, "plain RoPE only: rope_scaling must be null"));
        }
    }
    if let Some(p) = o.get("rope_parameters").filter(|v| !v.is_null()) {
        let m = p.as_object().ok_or_else(|| unsupported("rope_parameters", p, "an object"))?;
        for (k, x) in m {
            match k.as_str() {
                "rope_type" | "type" if x == "default" => {}
                "rope_type" | "type" => {
                    return Err(unsupported(&format!("rope_parameters.{k}"), x, "only the \"default\" RoPE"))
                }
                "rope_theta" => {}
                _ => return Err(unsupported(&format!("rope_parameters.{k}"), x, "only rope_theta and rope_type")),
            }
        }
    }
    for field in ["attention_bias", "mlp_bias", "use_sliding_window"] {
        if let Some(v) = o.get(field).filter(|v| !v.is_null() && **v != Value::Bool(false)) {
            return Err(unsupported(field, v, "no biases and no sliding window"));
        }
    }
    for field in ["sliding_window", "quantization_config", "layer_types", "no_rope_layers"] {
        if let Some(v) = o.get(field).filter(|v| !v.is_null()) {
            return Err(unsupported(field, v, "full causal attention in every layer, unquantized weights"));
        }
    }
    if let Some(v) = o.get("hidden_act").filter(|v| **v != "silu") {
        return Err(unsupported("hidden_act", v, "only silu (SwiGLU)"));
    }
    if let Some(v) = o.get("attention_dropout").filter(|v| v.as_f64() != Some(0.0)) {
        return Err(unsupported("attention_dropout", v, "no dropout"));
    }
    for field in ["torch_dtype", "dtype"] {
        if let Some(v) = o.get(field).filter(|v| !v.is_null()) {
            if !["float32", "bfloat16", "float16"].iter().any(|d| v == d) {
                return Err(unsupported(field, v, "float32, bfloat16 or float16 weights"));
            }
        }
    }
    Ok(())
}

fn usize_field(o: &Map<String, Value>, field: &'static str) -> Result<Option<usize>, ConfigError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(Some).ok_or_else(|| ConfigError::Invalid {
            field,
            why: format!("`{field}` is {v}, not a non-negative integer"),
        }),
    }
}

fn f64_field(o: &Map<String, Value>, field: &'static str) -> Result<Option<f64>, ConfigError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ConfigError::Invalid { field, why: format!("`{field}` is {v}, not a number") }),
    }
}

fn f64_in(v: &Value, key: &str, field: &'static str) -> Result<Option<f64>, ConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| ConfigError::Invalid { field, why: format!("`{field}` is {x}, not a number") }),
    }
}
