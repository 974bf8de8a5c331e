//! Text out: a Hugging Face Llama directory as a KV-cached decoder, with
//! transformers' greedy search and sampling.
//!
//! [`Decoder::open`] loads a directory [`llama_hf::open`] accepts onto
//! candle's CPU in the weights' dtype (float32, or bfloat16/float16 when
//! every weight is stored so, as transformers' `dtype="auto"` loads it),
//! into the same [`Llama`] training computes; [`Decoder::generate`] runs the
//! prompt through it once (prefill) and then one token per step against
//! per-layer key/value caches ([`Llama::forward_cached`]), stopping at an
//! end-of-sequence id ([`eos_ids`]) or after the asked number of tokens.
//! [`Decoding`] picks each token as transformers' `generate` does: the
//! arg-max (greedy, `do_sample=False`), or a draw after its logits warpers
//! in its order — temperature, top-k, top-p — from a seeded generator. The
//! warpers and the draw compute in f64 on the logits less their largest, so
//! any positive temperature, however small (1e-300), gives the limit it
//! tends to (the arg-max) instead of overflowing. Logits that are NaN or
//! +∞ (broken weights) stop generation with [`GenerateError::NotFinite`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::Value;

use crate::models::llama::config::LlamaConfig;
use crate::models::llama::hf::{self as llama_hf, HfError};
use crate::models::llama::{KvCache, Llama};

/// What stops a decoder from loading or generating.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The model directory cannot be loaded.
    #[error(transparent)]
    Model(#[from] HfError),
    /// A generation setting or the prompt is out of range.
    #[error("{0}")]
    InvalidArgument(String),
    /// candle failed computing.
    #[error("candle: {0}")]
    Compute(#[from] candle_core::Error),
    /// The model's logits for a new token hold NaN or +∞: its weights are
    /// broken (NaN, or so large that the computation overflows).
    #[error(
        "the model's logits for new token {token} are not finite (logit {id} is {value}, {count} of {vocab} not \
         finite): its weights hold NaN or overflow; nothing is generated from it"
    )]
    NotFinite {
        /// Which new token (from 1).
        token: usize,
        /// The first id whose logit is NaN or +∞.
        id: usize,
        /// That logit.
        value: f32,
        /// How many logits are NaN or +∞.
        count: usize,
        /// Logits in all.
        vocab: usize,
    },
}

/// How each new token is chosen from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decoding {
    /// The arg-max, the lowest id among equal maxima (`torch.argmax`).
    Greedy,
    /// A draw from the warped distribution.
    Sample(Sampling),
}

/// transformers' sampling settings: the logits divided by `temperature`,
/// then only the `top_k` largest kept (ties with the k-th kept too), then
/// the smallest set of largest whose probability reaches `top_p`; a
/// draw from the softmax of what is left.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Positive and finite.
    pub temperature: f64,
    /// `None` or 0: no top-k filter.
    pub top_k: Option<usize>,
    /// In (0, 1]; `None` or 1: no top-p filter.
    pub top_p: Option<f64>,
    /// The generator's seed: the same seed, model and prompt give the same tokens.
    pub seed: u64,
}

impl Sampling {
    /// Checks the settings' ranges.
    pub fn validate(&self) -> Result<(), GenerateError> {
        let bad = |why: String| Err(GenerateError::InvalidArgument(why));
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return bad(format!("temperature {} is not a positive number", self.temperature));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad(format!("top-p {p} is not in (0, 1]"));
            }
        }
        Ok(())
    }
}

/// xoshiro256** seeded through SplitMix64: a small, fixed generator, so a
/// seed gives the same draws on every machine and version.
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut s = crate::rng::SplitMix::new(seed);
        Rng([s.next_u64(), s.next_u64(), s.next_u64(), s.next_u64()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The lowest index of the largest value (NaN never wins).
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best
}

/// transformers' logits warpers in its order, in place, in f64:
/// `TemperatureLogitsWarper` on the logits less their largest (the same
/// distribution: a softmax does not see a shift; and finite for any
/// positive temperature: the largest becomes 0, the others ≤ 0 or −∞),
/// `TopKLogitsWarper` (what is below the k-th largest becomes −∞) and
/// `TopPLogitsWarper` (sorted ascending, the tokens whose cumulative
/// probability is ≤ 1 − p become −∞, the largest always kept). The logits
/// are finite or −∞ (the caller refuses NaN and +∞).
pub fn warp(logits: &mut [f64], s: &Sampling) {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max.is_finite() {
        logits.iter_mut().for_each(|x| *x = (*x - max) / s.temperature);
    }
    if let Some(k) = s.top_k.filter(|&k| k > 0 && k < logits.len()) {
        let mut sorted = logits.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        logits.iter_mut().filter(|x| **x < kth).for_each(|x| *x = f64::NEG_INFINITY);
    }
    if let Some(p) = s.top_p.filter(|&p| p < 1.0) {
        // A stable ascending sort, as torch.sort on the CPU keeps equal values in index order.
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
        let probs = softmax(&order.iter().map(|&i| logits[i]).collect::<Vec<_>>());
        let mut cum = 0.0f64;
        let last = order.len().saturating_sub(1);
        for (rank, (&i, q)) in order.iter().zip(probs).enumerate() {
            cum += q;
            if cum <= 1.0 - p && rank < last {
                logits[i] = f64::NEG_INFINITY;
            }
        }
    }
}

/// Softmax in f64 (−∞ gives 0).
fn softmax(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|&v| if v == f64::NEG_INFINITY { 0.0 } else { (v - max).exp() }).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// One token from `logits` (finite or −∞) by `decoding`, drawing from `rng` when sampling.
fn choose(logits: &[f32], decoding: &Decoding, rng: &mut Rng) -> usize {
    let Decoding::Sample(s) = decoding else { return argmax(logits) };
    let mut warped: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
    warp(&mut warped, s);
    let probs = softmax(&warped);
    let u = rng.uniform() * probs.iter().sum::<f64>();
    let mut cum = 0.0f64;
    let mut last = argmax(logits);
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cum += p;
            last = i;
            if u < cum {
                return i;
            }
        }
    }
    last
}

/// Refuses logits that hold NaN or +∞ (of new token `token`, from 1).
fn check_finite(logits: &[f32], token: usize) -> Result<(), GenerateError> {
    let bad = |x: &f32| x.is_nan() || *x == f32::INFINITY;
    match logits.iter().position(bad) {
        None => Ok(()),
        Some(id) => Err(GenerateError::NotFinite {
            token,
            id,
            value: logits[id],
            count: logits.iter().filter(|x| bad(x)).count(),
            vocab: logits.len(),
        }),
    }
}

/// The end-of-sequence ids transformers' `generate` stops at for the model
/// in `dir`: `generation_config.json`'s `eos_token_id` when that file is
/// there, else `config.json`'s; a config without the key gets
/// `LlamaConfig`'s default, 2 (a `null` one: none).
pub fn eos_ids(dir: &Path) -> Result<Vec<u32>, HfError> {
    let read = |path: PathBuf| -> Result<Value, HfError> {
        let io = |source| HfError::Io { path: path.clone(), source };
        crate::files::regular_file(&path).map_err(io)?;
        let text = std::fs::read_to_string(&path).map_err(io)?;
        serde_json::from_str(&text).map_err(|e| HfError::Weights { path: path.clone(), why: e.to_string() })
    };
    let ids = |v: &Value, path: &Path| -> Result<Vec<u32>, HfError> {
        let bad = || HfError::Weights { path: path.to_path_buf(), why: format!("eos_token_id {v} is not a token id") };
        let one = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(bad);
        match v {
            Value::Null => Ok(Vec::new()),
            Value::Array(a) => a.iter().map(one).collect(),
            x => Ok(vec![one(x)?]),
        }
    };
    let generation = dir.join("generation_config.json");
    if generation.exists() {
        let v = read(generation.clone())?;
        if let Some(e) = v.get("eos_token_id") {
            return ids(e, &generation);
        }
    }
    let config = dir.join("config.json");
    match read(config.clone())?.get("eos_token_id") {
        Some(e) => ids(e, &config),
        None => Ok(vec![2]),
    }
}

/// What [`Decoder::generate`] produced.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The new tokens (an end-of-sequence token that stopped it included, as transformers returns it).
    pub ids: Vec<u32>,
    /// Whether an end-of-sequence token stopped it.
    pub stopped_at_eos: bool,
    /// Seconds of the prompt's forward (with the first token's choice).
    pub prefill_s: f64,
    /// Seconds of the steps after it.
    pub decode_s: f64,
}

/// A Llama directory loaded for generation.
pub struct Decoder {
    model: Llama,
    config: Arc<LlamaConfig>,
    dtype: DType,
    eos: Vec<u32>,
}

impl Decoder {
    /// Loads the model in `dir` (see [`llama_hf::open`]) onto the CPU, in
    /// the dtype all its weights share (float32 where they differ), with
    /// the end-of-sequence ids of [`eos_ids`].
    pub fn open(dir: &Path) -> Result<Decoder, GenerateError> {
        let hf = llama_hf::open(dir)?;
        let eos = eos_ids(dir)?;
        let mut stored = hf.dtypes.values();
        let first = stored.next().cloned().unwrap_or_default();
        let dtype = match first.as_str() {
            "BF16" if stored.all(|d| *d == first) => DType::BF16,
            "F16" if stored.all(|d| *d == first) => DType::F16,
            _ => DType::F32,
        };
        let mut tensors = HashMap::new();
        for p in &hf.params {
            // One parameter at a time in float32: a bfloat16 model never holds a float32 copy of itself.
            let rows = p.shape.first().copied().unwrap_or(1);
            let values = p.source.read_rows(0, 0..rows).map_err(|why| {
                GenerateError::Model(HfError::Weights { path: dir.to_path_buf(), why: format!("{}: {why}", p.name) })
            })?;
            let t = Tensor::from_vec(values, p.shape.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            tensors.insert(p.name.clone(), t);
        }
        let config = Arc::new(hf.config);
        let vb = VarBuilder::from_tensors(tensors, dtype, &Device::Cpu);
        let model = Llama::new(config.clone(), vb)?;
        Ok(Decoder { model, config, dtype, eos })
    }

    /// The model's config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The dtype it computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The ids that end generation.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// The positions `max_new_tokens` after `prompt` would need, checked
    /// against `max_position_embeddings` and the vocabulary.
    fn check(&self, prompt: &[u32], max_new_tokens: usize) -> Result<(), GenerateError> {
        let bad = |why: String| Err(GenerateError::InvalidArgument(why));
        if prompt.is_empty() {
            return bad("the prompt has no tokens".into());
        }
        if let Some(id) = prompt.iter().find(|&&id| id as usize >= self.config.vocab_size) {
            return bad(format!("prompt token {id} is not below the model's vocab_size {}", self.config.vocab_size));
        }
        let limit = self.config.max_position_embeddings;
        // The last new token is returned, not fed back: it needs no position of its own.
        let needed = prompt.len().saturating_add(max_new_tokens.saturating_sub(1));
        if needed > limit {
            return bad(format!(
                "{} prompt tokens and {max_new_tokens} new ones need {needed} positions; the model has \
                 max_position_embeddings {limit}",
                prompt.len()
            ));
        }
        Ok(())
    }

    /// The logits after `ids` (`[vocab]`, float32), appending their keys and values to `cache`.
    fn step(&self, ids: &[u32], cache: &mut [KvCache]) -> Result<Vec<f32>, GenerateError> {
        let input = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
        let logits = self.model.forward_cached(&input, cache)?;
        Ok(logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1()?)
    }

    /// Up to `max_new_tokens` tokens after `prompt`, chosen by `decoding`:
    /// the prompt's forward once, then one token per step against the
    /// caches, stopping after an end-of-sequence id. `on_token` sees each
    /// new token as it is chosen.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        decoding: &Decoding,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, GenerateError> {
        self.check(prompt, max_new_tokens)?;
        if let Decoding::Sample(s) = decoding {
            s.validate()?;
        }
        let seed = match decoding {
            Decoding::Sample(s) => s.seed,
            Decoding::Greedy => 0,
        };
        let mut rng = Rng::new(seed);
        let mut cache = self.model.new_cache();
        let mut out = Generation { ids: Vec::new(), stopped_at_eos: false, prefill_s: 0.0, decode_s: 0.0 };
        if max_new_tokens == 0 {
            return Ok(out);
        }
        let start = Instant::now();
        let mut logits = self.step(prompt, &mut cache)?;
        out.prefill_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        loop {
            check_finite(&logits, out.ids.len() + 1)?;
            let id = choose(&logits, decoding, &mut rng) as u32;
            out.ids.push(id);
            on_token(id);
            if self.eos.contains(&id) {
                out.stopped_at_eos = true;
                break;
            }
            if out.ids.len() == max_new_tokens {
                break;
            }
            logits = self.step(&[id], &mut cache)?;
        }
        out.decode_s = start.elapsed().as_secs_f64();
        Ok(out)
    }

    /// The logits of every position of `ids` from the whole sequence's
    /// forward (no cache), `[len, vocab]` in float32: what training computes.
    pub fn full_logits(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>, GenerateError> {
        let input = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
        Ok(self.model.forward(&input)?.squeeze(0)?.to_dtype(DType::F32)?.to_vec2()?)
    }

    /// The logits of every position of `ids`, each from one cached step
    /// after the ones before it, `[len, vocab]` in float32.
    pub fn cached_logits(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>, GenerateError> {
        self.check(ids, 1)?;
        let mut cache = self.model.new_cache();
        ids.iter().map(|&id| self.step(&[id], &mut cache)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::llama::hf::SaveDtype;
    use crate::models::llama::{init_params, materialize};

    /// A GQA Llama (4 query heads over 2 key/value heads) with weights large
    /// enough that its logits differ clearly from position to position,
    /// written as a Hugging Face directory.
    fn model_dir(name: &str, tied: bool) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("chorus-generate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = LlamaConfig::new(50, 32, 64, 2, 4, 2);
        cfg.max_position_embeddings = 40;
        cfg.initializer_range = 0.3;
        cfg.tie_word_embeddings = tied;
        // No end-of-sequence id, so generation runs to its length (absent, transformers' default 2 would stop it).
        cfg.eos_token_id = Some(Value::Null);
        let params: Vec<(String, Vec<f32>)> = materialize(&init_params(&cfg, 7))
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        llama_hf::write(&dir, &cfg, &params, SaveDtype::F32, 1 << 30).unwrap();
        dir
    }

    fn ids(n: usize) -> Vec<u32> {
        (0..n).map(|i| ((i * 17 + 5) % 50) as u32).collect()
    }

    fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
    }

    #[test]
    fn cached_decode_equals_the_full_forward_at_every_position() {
        for tied in [false, true] {
            let dir = model_dir(if tied { "tied" } else { "untied" }, tied);
            let d = Decoder::open(&dir).unwrap();
            let seq = ids(30);
            let full = d.full_logits(&seq).unwrap();
            // The logits vary, so agreement is not agreement of constants.
            assert!(max_diff(&full[..1], &full[1..2]) > 0.1, "{:?}", &full[..2]);
            let cached = d.cached_logits(&seq).unwrap();
            assert!(max_diff(&full, &cached) < 1e-4, "tied {tied}: {}", max_diff(&full, &cached));
            // A prompt of 9 prefilled at once, then one token per step.
            let mut cache = d.model.new_cache();
            let mut stepped = vec![d.step(&seq[..9], &mut cache).unwrap()];
            for &id in &seq[9..] {
                stepped.push(d.step(&[id], &mut cache).unwrap());
            }
            assert!(max_diff(&full[8..], &stepped) < 1e-4, "tied {tied}: {}", max_diff(&full[8..], &stepped));
            // Greedy generation picks the full forward's arg-max after each prefix.
            let g = d.generate(&seq[..5], 12, &Decoding::Greedy, |_| {}).unwrap();
            let mut ctx = seq[..5].to_vec();
            for &id in &g.ids {
                let logits = d.full_logits(&ctx).unwrap();
                assert_eq!(id as usize, argmax(logits.last().unwrap()), "after {ctx:?}");
                ctx.push(id);
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn positions_past_max_position_embeddings_are_refused() {
        let dir = model_dir("limit", false);
        let d = Decoder::open(&dir).unwrap();
        // 30 + 11 − 1 = 40 positions fit; one more does not.
        assert_eq!(d.generate(&ids(30), 11, &Decoding::Greedy, |_| {}).unwrap().ids.len(), 11);
        let e = d.generate(&ids(30), 12, &Decoding::Greedy, |_| {}).unwrap_err().to_string();
        assert!(e.contains("need 41 positions") && e.contains("max_position_embeddings 40"), "{e}");
        let e = d.generate(&[3, 50], 1, &Decoding::Greedy, |_| {}).unwrap_err().to_string();
        assert!(e.contains("prompt token 50 is not below the model's vocab_size 50"), "{e}");
        assert!(d.generate(&[], 1, &Decoding::Greedy, |_| {}).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn warpers_follow_transformers() {
        let s = |temperature, top_k, top_p| Sampling { temperature, top_k, top_p, seed: 0 };
        // Divided by the temperature after the largest is taken off (a softmax does not see the shift).
        let mut x = vec![1.0f64, 2.0, 3.0, 4.0];
        warp(&mut x, &s(2.0, None, None));
        assert_eq!(x, [-1.5, -1.0, -0.5, 0.0]);
        warp(&mut x, &s(1.0, Some(2), None));
        assert_eq!(x, [f64::NEG_INFINITY, f64::NEG_INFINITY, -0.5, 0.0]);
        // Ties with the k-th largest are kept.
        let mut x = vec![1.0f64, 3.0, 3.0, 0.0];
        warp(&mut x, &s(1.0, Some(1), None));
        assert_eq!(x, [f64::NEG_INFINITY, 0.0, 0.0, f64::NEG_INFINITY]);
        // Probabilities 0.1, 0.2, 0.3, 0.4, p = 0.6: ascending cumulative 0.1, 0.3 are ≤ 0.4 and go.
        let mut x: Vec<f64> = [0.3f64, 0.1, 0.4, 0.2].iter().map(|p| p.ln()).collect();
        warp(&mut x, &s(1.0, None, Some(0.6)));
        let kept: Vec<bool> = x.iter().map(|v| v.is_finite()).collect();
        assert_eq!(kept, [true, false, true, false]);
        // The largest is always kept, however small p.
        let mut x = vec![0.0f64, 5.0];
        warp(&mut x, &s(1.0, None, Some(1e-9)));
        assert_eq!(x, [f64::NEG_INFINITY, 0.0]);
        assert!(s(0.0, None, None).validate().is_err());
        assert!(s(1.0, None, Some(1.5)).validate().is_err());
        assert!(s(f64::NAN, None, None).validate().is_err());
    }

    /// Issue 35: `--temperature 1e-40` (or 1e-300) gave the end token
    /// every time (the scaled logits overflowed f32): a tiny temperature
    /// draws the arg-max, its limit; a small but representable one still
    /// draws the runner-up at its probability, e^(-gap / T).
    #[test]
    fn tiny_temperatures_tend_to_the_arg_max() {
        let logits = [1.0f32, 3.5, 3.25, -2.0, f32::NEG_INFINITY];
        for t in [1e-40, 1e-300, f64::MIN_POSITIVE, 5e-324] {
            let d = Decoding::Sample(Sampling { temperature: t, top_k: None, top_p: Some(0.9), seed: 1 });
            let mut rng = Rng::new(1);
            let drawn: Vec<usize> = (0..200).map(|_| choose(&logits, &d, &mut rng)).collect();
            assert!(drawn.iter().all(|&i| i == 1), "temperature {t}: {drawn:?}");
        }
        // T = 0.25: the runner-up (0.25 below) has odds e^-1 against the arg-max.
        let d = Decoding::Sample(Sampling { temperature: 0.25, top_k: Some(0), top_p: None, seed: 1 });
        let mut rng = Rng::new(1);
        let n = 40_000;
        let second = (0..n).filter(|_| choose(&logits, &d, &mut rng) == 2).count() as f64 / n as f64;
        let e = (-1.0f64).exp();
        let want = e / (1.0 + e + (-10.0f64).exp());
        assert!((second - want).abs() < 0.01, "{second} vs {want}");
    }

    /// Issue 35: a model whose head is NaN generated text and exited 0; its
    /// logits are refused, naming the token and the first bad id.
    #[test]
    fn non_finite_logits_stop_generation() {
        assert!(check_finite(&[0.0, -1e30, f32::NEG_INFINITY], 1).is_ok());
        let e = check_finite(&[0.0, f32::NAN, f32::INFINITY, 1.0], 3).unwrap_err().to_string();
        assert!(e.contains("new token 3") && e.contains("logit 1 is NaN") && e.contains("2 of 4 not finite"), "{e}");
        let dir = model_dir("nan-head", false);
        let weights = dir.join("model.safetensors");
        let bytes = std::fs::read(&weights).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        // Every tensor as stored (f32), the head's values made NaN.
        let mut tensors: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
        for (name, view) in st.tensors() {
            let mut data = view.data().to_vec();
            if name == "lm_head.weight" {
                data.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&f32::NAN.to_le_bytes()));
            }
            tensors.push((name.to_string(), data, view.shape().to_vec()));
        }
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, data, shape)| {
                (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, &weights).unwrap();
        let d = Decoder::open(&dir).unwrap();
        let e = d.generate(&ids(3), 4, &Decoding::Greedy, |_| {}).unwrap_err();
        assert!(matches!(e, GenerateError::NotFinite { token: 1, id: 0, count: 50, vocab: 50, .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn draws_follow_the_distribution_and_the_seed() {
        let logits: Vec<f32> = [0.5f32, 0.25, 0.25, 0.0].iter().map(|p| p.ln()).collect();
        let d = Decoding::Sample(Sampling { temperature: 1.0, top_k: None, top_p: None, seed: 11 });
        let mut rng = Rng::new(11);
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[choose(&logits, &d, &mut rng)] += 1;
        }
        assert_eq!(counts[3], 0);
        assert!((counts[0] as f64 / 20_000.0 - 0.5).abs() < 0.02, "{counts:?}");
        assert!((counts[1] as f64 / 20_000.0 - 0.25).abs() < 0.02, "{counts:?}");
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..32).map(|_| choose(&logits, &d, &mut r)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }

    #[test]
    fn eos_comes_from_generation_config_then_config() {
        let dir = std::env::temp_dir().join(format!("chorus-generate-eos-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
        assert_eq!(eos_ids(&dir).unwrap(), [2]);
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": null}"#).unwrap();
        assert_eq!(eos_ids(&dir).unwrap(), Vec::<u32>::new());
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 7}"#).unwrap();
        assert_eq!(eos_ids(&dir).unwrap(), [7]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [4, 9]}"#).unwrap();
        assert_eq!(eos_ids(&dir).unwrap(), [4, 9]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": -1}"#).unwrap();
        assert!(eos_ids(&dir).unwrap_err().to_string().contains("is not a token id"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
