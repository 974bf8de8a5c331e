//! Text to token ids and back, for the sample a run prints at its end: one
//! small trait, so a model trained on a tokenizer's ids samples through
//! that tokenizer, and one trained on [`text`](crate::text)'s characters
//! through [`Alphabet`].

/// Why text could not become ids, or ids text.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub String);

/// What a codec returns.
pub type Result<T> = std::result::Result<T, CodecError>;

/// A tokenizer: text to token ids and back.
pub trait TextCodec: Send + Sync + std::fmt::Debug {
    /// The ids of `text`.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// The text of `ids`.
    fn decode(&self, ids: &[u32]) -> Result<String>;
}

/// The character-level vocabulary of the generated text and `--text`
/// ([`text::ALPHABET`](crate::text::ALPHABET)): other characters encode as
/// spaces, ids outside it decode as `?`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Alphabet;

impl TextCodec for Alphabet {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(crate::text::encode(text))
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(crate::text::decode(ids))
    }
}
