//! What the decoders train on: rows of token ids from a `.npy` file
//! ([`TokenRows`]) or byte-level windows of a text ([`TextData`]), as one
//! [`Data`] whose batches are the same at every world size and mesh.

use crate::npy::Tokens;
use crate::text::TextData;

/// Token-id rows from a `.npy` file `[N, seq_len + 1]`: row `k` gives inputs
/// `row[..seq_len]` and targets `row[1..]`; at step `s` the global batch is
/// rows `(s·G + k) mod N` for `k < G` (G = ranks × sequences per rank), the
/// same batches at every world size and mesh.
///
/// A [`split`](TokenRows::split) holds out the last rows: the rows used
/// are then those of `range` only (N its length).
#[derive(Clone, Debug)]
pub struct TokenRows {
    tokens: Tokens,
    range: std::ops::Range<usize>,
    global_batch: usize,
    hash: u64,
}

impl TokenRows {
    /// Checks `tokens` against the model and the batch: at least two
    /// columns, at least `global_batch` rows, every id below `vocab_size`.
    pub fn new(tokens: Tokens, vocab_size: usize, global_batch: usize) -> std::result::Result<TokenRows, String> {
        if tokens.cols < 2 {
            return Err(format!("rows of {} token(s): each row needs seq_len + 1 ≥ 2 tokens", tokens.cols));
        }
        if global_batch == 0 || tokens.rows < global_batch {
            return Err(format!("{} rows are fewer than one global batch of {global_batch}", tokens.rows));
        }
        if let Some(i) = u32::try_from(vocab_size).ok().and_then(|v| tokens.first_at_least(v)) {
            return Err(format!(
                "token id {} at row {}, column {} is not below vocab_size {vocab_size}",
                tokens.id(i),
                i / tokens.cols,
                i % tokens.cols
            ));
        }
        let hash = tokens.content_hash();
        Ok(TokenRows { range: 0..tokens.rows, tokens, global_batch, hash })
    }

    /// Rows in use.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether no row is in use (never, for a checked one).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Holds out the last `ceil(fraction · N)` rows: the rows before them
    /// (to train on, still at least one global batch) and those rows (to
    /// validate on, with batches of `val_global_batch`), each identified in
    /// a checkpoint by the content and where the cut is.
    pub fn split(self, fraction: f64, val_global_batch: usize) -> Result<(TokenRows, TokenRows), String> {
        if !(fraction > 0.0 && fraction < 1.0) {
            return Err(format!("--val-fraction {fraction} must be between 0 and 1 (exclusive)"));
        }
        let n = self.len();
        let held = ((n as f64 * fraction).ceil() as usize).clamp(1, n);
        let cut = self.range.start + n - held;
        if n - held < self.global_batch || held < val_global_batch {
            return Err(format!(
                "--val-fraction {fraction} of {n} rows leaves {} to train on and {held} to validate on; each needs at least one global batch ({} and {val_global_batch})",
                n - held,
                self.global_batch
            ));
        }
        let mix = crate::rng::mix;
        let keyed = |r: &std::ops::Range<usize>| self.hash ^ mix(r.start as u64) ^ mix(!(r.end as u64));
        let train = TokenRows { range: self.range.start..cut, hash: keyed(&(self.range.start..cut)), ..self.clone() };
        let val = TokenRows {
            range: cut..self.range.end,
            hash: keyed(&(cut..self.range.end)),
            global_batch: val_global_batch,
            tokens: self.tokens,
        };
        Ok((train, val))
    }
}

/// What a decoder trains on.
#[derive(Clone, Debug)]
pub enum Data {
    /// Rows of token ids (`--data`).
    Tokens(TokenRows),
    /// Byte-level windows of a text (`--text`, or generated text).
    Text(TextData),
}

impl Data {
    /// Tokens per sequence.
    pub fn seq_len(&self) -> usize {
        match self {
            Data::Tokens(t) => t.tokens.cols - 1,
            Data::Text(t) => t.seq_len(),
        }
    }

    /// What identifies the data in a checkpoint (a resumed run must train on the same).
    pub fn seed(&self) -> u64 {
        match self {
            Data::Tokens(t) => t.hash,
            Data::Text(t) => t.seed(),
        }
    }

    /// Inputs and targets (each `n × seq_len` ids, row-major) of rows
    /// `first .. first + n` of the global batch at `step`.
    pub fn rows(&self, step: u64, first: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
        match self {
            Data::Text(t) => t.rows(step, first, n),
            Data::Tokens(t) => {
                let (cols, total) = (t.tokens.cols, t.len() as u64);
                let (mut x, mut y) = (Vec::with_capacity(n * (cols - 1)), Vec::with_capacity(n * (cols - 1)));
                for k in first..first + n {
                    let row =
                        t.range.start + ((step as u128 * t.global_batch as u128 + k as u128) % total as u128) as usize;
                    let before = x.len();
                    t.tokens.extend_row(row, 0, &mut x);
                    x.truncate(before + cols - 1);
                    t.tokens.extend_row(row, 1, &mut y);
                }
                (x, y)
            }
        }
    }
}

impl From<TextData> for Data {
    fn from(t: TextData) -> Data {
        Data::Text(t)
    }
}

impl From<TokenRows> for Data {
    fn from(t: TokenRows) -> Data {
        Data::Tokens(t)
    }
}
