//! The text the transformer learns: English-like sentences generated from a
//! small grammar (nothing is downloaded), encoded as characters, and the
//! batches drawn from it at each step.

use crate::rng::SplitMix;

/// The characters of the vocabulary, in token order.
pub const ALPHABET: &str = " .\nabcdefghijklmnopqrstuvwxyz";

/// Tokens in the vocabulary.
pub fn vocab_size() -> usize {
    ALPHABET.len()
}

const SUBJECTS: &[&str] = &["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the teacher"];
const VERBS: &[&str] = &["sees", "likes", "finds", "watches", "follows", "helps", "hears"];
const OBJECTS: &[&str] = &["the ball", "a red apple", "the river", "the small house", "a green tree", "the moon"];
const ENDINGS: &[&str] = &["", " every day", " in the morning", " at night", " near the road"];

/// `bytes` characters of generated text (sentences of a small grammar, a
/// paragraph break every few sentences), the same for the same `seed`.
pub fn generate(bytes: usize, seed: u64) -> String {
    let mut rng = SplitMix::new(seed ^ 0x7E47);
    let mut pick = |list: &[&'static str]| list[(rng.next_u64() % list.len() as u64) as usize];
    let mut out = String::with_capacity(bytes + 64);
    let mut sentences = 0u64;
    while out.len() < bytes {
        out.push_str(pick(SUBJECTS));
        out.push(' ');
        out.push_str(pick(VERBS));
        out.push(' ');
        out.push_str(pick(OBJECTS));
        out.push_str(pick(ENDINGS));
        out.push('.');
        sentences += 1;
        out.push(if sentences % 4 == 0 { '\n' } else { ' ' });
    }
    out.truncate(bytes);
    out
}

/// The tokens of `text`; characters outside [`ALPHABET`] become spaces.
pub fn encode(text: &str) -> Vec<u32> {
    text.chars().map(|c| ALPHABET.find(c.to_ascii_lowercase()).unwrap_or(0) as u32).collect()
}

/// The text of `tokens` (tokens outside the vocabulary become `?`).
pub fn decode(tokens: &[u32]) -> String {
    tokens.iter().map(|t| ALPHABET.as_bytes().get(*t as usize).map_or('?', |b| *b as char)).collect()
}

/// A token stream and the windows drawn from it: at step `s`, global row
/// `j` is the `seq_len + 1` tokens starting at a position that depends only
/// on `(seed, s, j)`, so any rank can draw its rows of any step, and a run
/// resumed at step `s` sees the same data as one that never stopped.
#[derive(Clone, Debug)]
pub struct TextData {
    tokens: Vec<u32>,
    seq_len: usize,
    seed: u64,
}

impl TextData {
    /// Windows of `seq_len` inputs (plus the next token as the target) over `tokens`.
    pub fn new(tokens: Vec<u32>, seq_len: usize, seed: u64) -> Option<TextData> {
        (seq_len > 0 && tokens.len() > seq_len + 1).then_some(TextData { tokens, seq_len, seed })
    }

    /// The context length.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The seed of the window positions.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Inputs and targets (each `n × seq_len` tokens, row-major) of global
    /// rows `first .. first + n` at `step`.
    pub fn rows(&self, step: u64, first: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
        let span = (self.tokens.len() - self.seq_len - 1) as u64;
        let (mut x, mut y) = (Vec::with_capacity(n * self.seq_len), Vec::with_capacity(n * self.seq_len));
        for j in first..first + n {
            let mut rng =
                SplitMix::new(self.seed ^ step.wrapping_mul(0x9E37_79B9) ^ (j as u64).wrapping_mul(0x85EB_CA6B));
            let start = (rng.next_u64() % span) as usize;
            x.extend_from_slice(&self.tokens[start..start + self.seq_len]);
            y.extend_from_slice(&self.tokens[start + 1..start + self.seq_len + 1]);
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_deterministic_and_in_the_alphabet() {
        let a = generate(2000, 1);
        assert_eq!(a, generate(2000, 1));
        assert_ne!(a, generate(2000, 2));
        assert_eq!(a.len(), 2000);
        assert_eq!(decode(&encode(&a)), a);
        assert!(encode(&a).iter().all(|t| (*t as usize) < vocab_size()));
    }

    #[test]
    fn rows_are_windows_with_shifted_targets() {
        let tokens = encode(&generate(500, 0));
        let data = TextData::new(tokens.clone(), 16, 3).unwrap();
        let (x, y) = data.rows(5, 2, 3);
        assert_eq!((x.len(), y.len()), (48, 48));
        for r in 0..3 {
            let row = &x[r * 16..(r + 1) * 16];
            let start = tokens.windows(16).position(|w| w == row).unwrap();
            assert_eq!(&y[r * 16..(r + 1) * 16], &tokens[start + 1..start + 17]);
        }
        // A rank's rows are the same rows of the global batch.
        let (all, _) = data.rows(5, 0, 5);
        assert_eq!(&all[2 * 16..5 * 16], &x[..]);
        assert!(TextData::new(vec![1, 2], 4, 0).is_none());
    }
}
