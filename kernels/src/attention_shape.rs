//! The sizes of one attention call ([`AttentionShape`]), checked, and the
//! indexing the CPU reference uses; shared by the op (`attention.rs`) and
//! its CUDA launches (`cuda.rs`).

use candle_core::{bail, Result, Shape};

use crate::host::dims;

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences in the batch.
    pub batch: usize,
    /// Query positions per sequence.
    pub q_len: usize,
    /// Key/value positions per sequence (at least `q_len`).
    pub kv_len: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (they divide `heads`).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// The shape of `(q, k, v)`, checked.
    pub fn of(q: &Shape, k: &Shape, v: &Shape) -> Result<AttentionShape> {
        const OP: &str = "attention";
        let [b, t, h, d] = dims::<4>(OP, "q", q)?;
        let [kb, s, kvh, kd] = dims::<4>(OP, "k", k)?;
        if k != v {
            bail!("{OP}: k {k:?} and v {v:?} differ")
        }
        if kb != b || kd != d {
            bail!("{OP}: q {q:?} and k {k:?} differ in batch or head_dim")
        }
        if [b, t, h, d, kvh].contains(&0) || h % kvh != 0 {
            bail!("{OP}: q {q:?}, k {k:?}: sizes must be positive and kv_heads must divide heads")
        }
        if s < t {
            bail!("{OP}: {s} key positions for {t} queries; a query sees the keys up to its own position")
        }
        Ok(AttentionShape { batch: b, q_len: t, kv_len: s, heads: h, kv_heads: kvh, head_dim: d })
    }

    pub(crate) fn q_elems(&self) -> usize {
        self.batch * self.q_len * self.heads * self.head_dim
    }

    pub(crate) fn kv_elems(&self) -> usize {
        self.batch * self.kv_len * self.kv_heads * self.head_dim
    }

    /// Index of element `e` of query row `i`, head `h`, sequence `b` in `q`.
    pub(crate) fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.q_len + i) * self.heads + h) * self.head_dim
    }

    pub(crate) fn kv_at(&self, b: usize, j: usize, g: usize) -> usize {
        ((b * self.kv_len + j) * self.kv_heads + g) * self.head_dim
    }

    /// The last key query `i` sees, plus one.
    pub(crate) fn visible(&self, i: usize) -> usize {
        self.kv_len - self.q_len + i + 1
    }
}
