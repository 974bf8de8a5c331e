//! A Hugging Face tokenizer (`tokenizer.json`, read and run by the
//! `tokenizers` crate) with the special tokens a training run needs: the
//! end-of-text token that joins documents, the beginning-of-text and padding
//! tokens a model directory records, and the files that make a Hugging Face
//! model directory carry it (`tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`). [`train_byte_level_bpe`] trains a new one.
//!
//! The special tokens come from, in order: an explicit choice
//! ([`HfTokenizer::with_eos`]), the `tokenizer_config.json` beside the
//! `tokenizer.json` (`eos_token`, `bos_token`, `pad_token`, as transformers
//! writes them: a string or `{"content": ...}`), and else the first of the
//! usual names ([`EOS_NAMES`], [`BOS_NAMES`]) that is a token of the
//! vocabulary.

use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The largest `tokenizer.json` or `tokenizer_config.json` read (real ones
/// are a few MiB; this refuses a wrong file before it is read into memory).
pub const MAX_TOKENIZER_FILE: u64 = 1 << 30;

/// The end-of-text tokens looked for when no `tokenizer_config.json` names
/// one (GPT-2 and byte-level BPEs, Llama 1/2 and Mistral, Llama 3, Qwen, Gemma).
pub const EOS_NAMES: [&str; 5] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>"];

/// The beginning-of-text tokens looked for likewise.
pub const BOS_NAMES: [&str; 3] = ["<s>", "<|begin_of_text|>", "<bos>"];

/// The one special token of a tokenizer [`train_byte_level_bpe`] trains (id
/// 0): end of text, and also its beginning and padding token, as GPT-2's.
pub const TRAINED_SPECIAL: &str = "<|endoftext|>";

/// The largest vocabulary [`train_byte_level_bpe`] trains.
pub const MAX_TRAINED_VOCAB: usize = 1 << 20;

/// What goes wrong with a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not what it must be (not a tokenizer, too large, a bad field).
    #[error("{}: {why}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A token named as special (`--eos`, `eos_token`) is not in the vocabulary.
    #[error("the {role} token {token:?} ({from}) is not a token of this tokenizer")]
    UnknownToken {
        /// Which special token ("end-of-text", ...).
        role: &'static str,
        /// The token.
        token: String,
        /// Where it was named (`eos_token of DIR/tokenizer_config.json`, `--eos`), since the user may not
        /// have typed it.
        from: String,
    },
    /// The tokenizer has no end-of-text token, which joins documents.
    #[error(
        "the tokenizer has no end-of-text token (no eos_token in a tokenizer_config.json beside it, none of {EOS_NAMES:?} \
         in its vocabulary); name one with --eos TOKEN"
    )]
    NoEos,
    /// Encoding, decoding or training failed in the `tokenizers` crate.
    #[error("tokenizer: {0}")]
    Run(String),
}

/// What this module returns.
pub type Result<T> = std::result::Result<T, TokenizerError>;

fn run_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Run(e.to_string())
}

/// A special token: its text and id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Special {
    /// The token's text.
    pub token: String,
    /// Its id.
    pub id: u32,
}

/// A Hugging Face tokenizer and its special tokens.
pub struct HfTokenizer {
    inner: Tokenizer,
    /// The `tokenizer.json` as read (or trained), copied into model directories unchanged.
    json: Vec<u8>,
    /// The `tokenizer_config.json` beside it, if there was one.
    config: Map<String, Value>,
    eos: Option<Special>,
    bos: Option<Special>,
    pad: Option<Special>,
    vocab_size: usize,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .field("pad", &self.pad)
            .finish()
    }
}

/// Reads a regular file of at most [`MAX_TOKENIZER_FILE`] bytes; a larger
/// one is refused by its size, before any of it is read.
fn read_bounded(path: &Path) -> Result<Vec<u8>> {
    let io = |source| TokenizerError::Io { path: path.to_path_buf(), source };
    crate::files::regular_file(path).map_err(io)?;
    let too_large = |len: u64| TokenizerError::Invalid {
        path: path.to_path_buf(),
        why: format!("{len} bytes, more than {MAX_TOKENIZER_FILE}: not a tokenizer file"),
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len > MAX_TOKENIZER_FILE {
        return Err(too_large(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // The file may grow while it is read: never past the limit.
    file.take(MAX_TOKENIZER_FILE + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_TOKENIZER_FILE {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Reads the `tokenizer.json` at `path` (at most [`MAX_TOKENIZER_FILE`]
/// bytes, checked before reading) into a [`Tokenizer`], with its bytes.
/// What is wrong is said as it is: not JSON (where, as the parser says),
/// JSON that is not a tokenizer (no `model`), or a tokenizer this build of
/// the `tokenizers` crate cannot read.
pub fn read_tokenizer_json(path: &Path) -> Result<(Tokenizer, Vec<u8>)> {
    let json = read_bounded(path)?;
    match Tokenizer::from_bytes(&json) {
        Ok(t) => Ok((t, json)),
        Err(e) => {
            let why = match serde_json::from_slice::<Value>(&json) {
                Err(syntax) => format!("not JSON: {syntax}"),
                Ok(Value::Object(o)) if !o.contains_key("model") => {
                    let keys: Vec<&str> = o.keys().take(8).map(String::as_str).collect();
                    format!(
                        "JSON, but not a tokenizer.json: it has no \"model\" (its keys: {}); a Hugging Face \
                         tokenizer.json has version, model, normalizer, pre_tokenizer, decoder, ...",
                        keys.join(", ")
                    )
                }
                Ok(Value::Object(_)) => format!("a tokenizer.json this build cannot read: {e}"),
                Ok(other) => {
                    let kind = match other {
                        Value::Array(_) => "an array",
                        Value::String(_) => "a string",
                        Value::Number(_) => "a number",
                        Value::Bool(_) => "a boolean",
                        _ => "null",
                    };
                    format!("JSON, but not a tokenizer.json: {kind}, where a tokenizer.json is an object")
                }
            };
            Err(TokenizerError::Invalid { path: path.to_path_buf(), why })
        }
    }
}

impl HfTokenizer {
    /// Reads `path` (a `tokenizer.json`) and, if present, the
    /// `tokenizer_config.json` beside it.
    pub fn from_file(path: &Path) -> Result<HfTokenizer> {
        let (inner, json) = read_tokenizer_json(path)?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config = match std::fs::symlink_metadata(&config_path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Map::new(),
            _ => {
                let bytes = read_bounded(&config_path)?;
                let invalid = |why: String| TokenizerError::Invalid { path: config_path.clone(), why };
                match serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))? {
                    Value::Object(o) => o,
                    _ => return Err(invalid("not a JSON object".into())),
                }
            }
        };
        Self::new(inner, json, config, &config_path)
    }

    fn new(inner: Tokenizer, json: Vec<u8>, config: Map<String, Value>, config_path: &Path) -> Result<HfTokenizer> {
        // The largest id + 1, not the count: a vocabulary may have holes, and
        // every id must have a row in the model's embedding.
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |m| *m as usize + 1);
        let mut t = HfTokenizer { inner, json, config, eos: None, bos: None, pad: None, vocab_size };
        let named = |key: &str| -> Result<Option<String>> {
            match t.config.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(TokenizerError::Invalid {
                        path: config_path.to_path_buf(),
                        why: format!("{key} has no string \"content\""),
                    }),
                },
                Some(other) => Err(TokenizerError::Invalid {
                    path: config_path.to_path_buf(),
                    why: format!("{key} must be a string, found {other}"),
                }),
            }
        };
        let (eos, bos, pad) = (named("eos_token")?, named("bos_token")?, named("pad_token")?);
        let from = |key: &str| format!("{key} of {}", config_path.display());
        t.eos = t.special("end-of-text", eos.map(|e| (e, from("eos_token"))), &EOS_NAMES)?;
        t.bos = t.special("beginning-of-text", bos.map(|b| (b, from("bos_token"))), &BOS_NAMES)?;
        t.pad = t.special("padding", pad.map(|p| (p, from("pad_token"))), &[])?;
        Ok(t)
    }

    /// The special token `named` (which must exist; with where it was
    /// named), or else the first of `usual` that does.
    fn special(&self, role: &'static str, named: Option<(String, String)>, usual: &[&str]) -> Result<Option<Special>> {
        match named {
            Some((token, from)) => match self.inner.token_to_id(&token) {
                Some(id) => Ok(Some(Special { token, id })),
                None => Err(TokenizerError::UnknownToken { role, token, from }),
            },
            None => {
                Ok(usual.iter().find_map(|t| self.inner.token_to_id(t).map(|id| Special { token: t.to_string(), id })))
            }
        }
    }

    /// Uses `token` as the end-of-text token (`--eos`): it must be a token of the vocabulary.
    pub fn with_eos(mut self, token: &str) -> Result<HfTokenizer> {
        self.eos = self.special("end-of-text", Some((token.to_string(), "--eos".into())), &[])?;
        Ok(self)
    }

    /// The ids of `text` as transformers' `tokenizer(text)` gives them (with
    /// the special tokens the tokenizer's post-processor adds, e.g. a BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode_fast(text, true).map_err(run_err)?.get_ids().to_vec())
    }

    /// The ids of `text` alone (no post-processor tokens): a document's ids
    /// as they are packed for training.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode_fast(text, false).map_err(run_err)?.get_ids().to_vec())
    }

    /// [`encode_plain`](Self::encode_plain) of each text, in parallel over
    /// the cores, in the order given.
    pub fn encode_plain_batch(&self, texts: Vec<&str>) -> Result<Vec<Vec<u32>>> {
        let encodings = self.inner.encode_batch_fast(texts, false).map_err(run_err)?;
        Ok(encodings.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// The text of `ids` (special tokens included, as transformers'
    /// `decode` gives it by default); an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(bad) = ids.iter().find(|i| **i as usize >= self.vocab_size) {
            return Err(TokenizerError::Run(format!("id {bad} is not below the vocabulary size {}", self.vocab_size)));
        }
        self.inner.decode(ids, false).map_err(run_err)
    }

    /// The end-of-text token's id, if the tokenizer has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|s| s.id)
    }

    /// The end-of-text token, or [`TokenizerError::NoEos`].
    pub fn eos(&self) -> Result<&Special> {
        self.eos.as_ref().ok_or(TokenizerError::NoEos)
    }

    /// The beginning-of-text token's id, if the tokenizer has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|s| s.id)
    }

    /// The padding token's id, if the tokenizer names one.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad.as_ref().map(|s| s.id)
    }

    /// The size of the embedding the tokenizer needs: its largest id + 1
    /// (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The `tokenizer.json` bytes.
    pub fn json(&self) -> &[u8] {
        &self.json
    }

    /// The `tokenizer_config.json` of a model directory: the one beside the
    /// source (if any; minus `auto_map`, which would need remote code) with
    /// the class set to `PreTrainedTokenizerFast` (it runs `tokenizer.json`
    /// as it is), the special tokens chosen here and `model_max_length`.
    pub fn config_json(&self, model_max_length: usize) -> Value {
        let mut c = self.config.clone();
        c.remove("auto_map");
        c.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
        c.insert("model_max_length".into(), model_max_length.into());
        c.entry("clean_up_tokenization_spaces").or_insert(false.into());
        for (key, special) in [("eos_token", &self.eos), ("bos_token", &self.bos), ("pad_token", &self.pad)] {
            match special {
                Some(s) => c.insert(key.into(), s.token.clone().into()),
                None => c.remove(key),
            };
        }
        Value::Object(c)
    }

    /// The `generation_config.json` of a model directory: the special tokens' ids.
    pub fn generation_config_json(&self) -> Value {
        let mut c = Map::new();
        for (key, id) in
            [("bos_token_id", self.bos_id()), ("eos_token_id", self.eos_id()), ("pad_token_id", self.pad_id())]
        {
            if let Some(id) = id {
                c.insert(key.into(), id.into());
            }
        }
        Value::Object(c)
    }

    /// The files a Hugging Face model directory carries the tokenizer in, by name.
    pub fn hf_files(&self, model_max_length: usize) -> Result<Vec<(&'static str, Vec<u8>)>> {
        let pretty = |v: &Value| serde_json::to_vec_pretty(v).map_err(run_err);
        Ok(vec![
            ("tokenizer.json", self.json.clone()),
            ("tokenizer_config.json", pretty(&self.config_json(model_max_length))?),
            ("generation_config.json", pretty(&self.generation_config_json())?),
        ])
    }
}

/// Trains a byte-level BPE of `vocab_size` tokens (at least the 256 bytes
/// and [`TRAINED_SPECIAL`]) on `texts`, GPT-2's design: the ByteLevel
/// pre-tokenizer (GPT-2's regex, no prefix space), decoder and
/// post-processor (which adds no tokens), and one special token, id 0, that
/// ends, begins and pads texts. Counts words as they stream by: memory goes
/// with the distinct words, not the size of the input.
pub fn train_byte_level_bpe<I, S>(texts: I, vocab_size: usize) -> Result<HfTokenizer>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    let alphabet = ByteLevel::alphabet();
    let least = alphabet.len() + 1;
    if !(least..=MAX_TRAINED_VOCAB).contains(&vocab_size) {
        return Err(TokenizerError::Run(format!(
            "a byte-level BPE's vocabulary must be from {least} (the 256 bytes and {TRAINED_SPECIAL}) to {MAX_TRAINED_VOCAB}; \
             {vocab_size} asked"
        )));
    }
    let mut tokenizer = Tokenizer::new(BPE::default());
    let byte_level = ByteLevel::new(false, true, true);
    tokenizer.with_pre_tokenizer(Some(byte_level));
    tokenizer.with_decoder(Some(byte_level));
    tokenizer.with_post_processor(Some(ByteLevel::new(false, false, true)));
    let trainer = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(TRAINED_SPECIAL, true)])
        .initial_alphabet(alphabet.into_iter().collect::<HashSet<char>>())
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    tokenizer.train(&mut trainer, texts).map_err(run_err)?;
    let json = tokenizer.to_string(false).map_err(run_err)?.into_bytes();
    let mut config = Map::new();
    for key in ["eos_token", "bos_token", "pad_token", "unk_token"] {
        config.insert(key.into(), TRAINED_SPECIAL.into());
    }
    config.insert("add_prefix_space".into(), false.into());
    HfTokenizer::new(tokenizer, json, config, Path::new("tokenizer_config.json"))
}

/// A run on a tokenizer's ids samples its closing text through it: the
/// prompt as transformers' `tokenizer(prompt)` encodes it.
impl crate::codec::TextCodec for HfTokenizer {
    fn encode(&self, text: &str) -> crate::codec::Result<Vec<u32>> {
        HfTokenizer::encode(self, text).map_err(|e| crate::codec::CodecError(e.to_string()))
    }
    fn decode(&self, ids: &[u32]) -> crate::codec::Result<String> {
        HfTokenizer::decode(self, ids).map_err(|e| crate::codec::CodecError(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> Vec<String> {
        let words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "naïve", "café", "日本"];
        (0..400).map(|i| (0..12).map(|j| words[(i * 7 + j * 3) % words.len()]).collect::<Vec<_>>().join(" ")).collect()
    }

    #[test]
    fn a_trained_bpe_round_trips_and_knows_its_special_tokens() {
        let t = train_byte_level_bpe(corpus().iter(), 300).unwrap();
        // As many tokens as merges the small corpus offers, up to 300.
        assert!((270..=300).contains(&t.vocab_size()), "{}", t.vocab_size());
        assert_eq!((t.eos_id(), t.bos_id(), t.pad_id()), (Some(0), Some(0), Some(0)));
        let text = "the cat sat on a café mat, naïve 日本 dog!\n\tz";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids, t.encode_plain(text).unwrap(), "the post-processor adds nothing");
        assert!(ids.len() < text.len(), "merges were learnt: {} ids for {} bytes", ids.len(), text.len());
        assert_eq!(t.decode(&ids).unwrap(), text);
        let batch = t.encode_plain_batch(vec!["the cat", text, ""]).unwrap();
        assert_eq!(batch, vec![t.encode_plain("the cat").unwrap(), ids, vec![]]);
        assert!(t.decode(&[t.vocab_size() as u32]).is_err());
        // The files a model directory carries, and the tokenizer read back from them.
        let dir = std::env::temp_dir().join(format!("chorus-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in t.hf_files(64).unwrap() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        let back = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(back.encode(text).unwrap(), t.encode(text).unwrap());
        assert_eq!(back.eos().unwrap(), &Special { token: TRAINED_SPECIAL.into(), id: 0 });
        let config = back.config_json(64);
        assert_eq!(
            (config["tokenizer_class"].as_str(), config["model_max_length"].as_u64()),
            (Some("PreTrainedTokenizerFast"), Some(64))
        );
        assert_eq!(
            back.generation_config_json(),
            serde_json::json!({"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0})
        );
        // --eos must name a token; a config naming an unknown one is refused.
        assert!(matches!(back.with_eos("<nope>"), Err(TokenizerError::UnknownToken { .. })));
        let back = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": {"content": "</s>"}}"#).unwrap();
        let err = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap_err().to_string();
        // Issue 43: a token the user did not type says where it was named.
        let from = format!("\"</s>\" (eos_token of {}) is not a token", dir.join("tokenizer_config.json").display());
        assert!(err.contains(&from), "{err}");
        let err = back.with_eos("<nope>").unwrap_err().to_string();
        assert!(err.contains("\"<nope>\" (--eos) is not a token"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_files_and_sizes_are_typed_errors() {
        let dir = std::env::temp_dir().join(format!("chorus-tokenizer-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Issue 35: valid JSON that is no tokenizer is not called a syntax error; broken JSON is.
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, "{\"not\": 1, \"version\": \"1.0\"}").unwrap();
        let err = HfTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("JSON, but not a tokenizer.json: it has no \"model\" (its keys: not, version)"), "{err}");
        std::fs::write(&path, "[1, 2]").unwrap();
        let err = HfTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("JSON, but not a tokenizer.json: an array"), "{err}");
        std::fs::write(&path, "{\"model\": ").unwrap();
        let err = HfTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("not JSON: EOF while parsing") && err.contains("line 1 column"), "{err}");
        std::fs::write(&path, "{\"model\": {\"type\": \"NoSuchModel\"}}").unwrap();
        let err = HfTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("a tokenizer.json this build cannot read"), "{err}");
        // A file over the limit is refused by its size before it is read (sparse: no disk used).
        let big = dir.join("big.json");
        std::fs::File::create(&big).unwrap().set_len(MAX_TOKENIZER_FILE + 1).unwrap();
        let started = std::time::Instant::now();
        let err = HfTokenizer::from_file(&big).unwrap_err().to_string();
        assert!(err.contains(&format!("{} bytes, more than", MAX_TOKENIZER_FILE + 1)), "{err}");
        println!("refused in {:?}", started.elapsed());
        assert!(matches!(HfTokenizer::from_file(&dir), Err(TokenizerError::Io { .. })));
        assert!(matches!(HfTokenizer::from_file(&dir.join("missing.json")), Err(TokenizerError::Io { .. })));
        for v in [0, 256, MAX_TRAINED_VOCAB + 1] {
            let err = train_byte_level_bpe(corpus().iter(), v).unwrap_err().to_string();
            assert!(err.contains("257"), "{v}: {err}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
