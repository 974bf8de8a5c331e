//! One parameter (FSDP2's `_fsdp_param`): how it is given to FSDP (whole
//! values, or a source of its shard's rows) and where it lies in its group's
//! flat storage (`storage.rs` holds the buffers).

use std::ops::Range;
use std::sync::Arc;

use crate::layout::ParamLayout;
use crate::{FsdpError, Result};

/// A parameter to put under FSDP: its name, shape and full initial values
/// (every rank passes the same values and keeps its shard).
#[derive(Clone, Debug)]
pub struct ParamInit {
    /// Fully qualified name (`layers.0.weight`).
    pub name: String,
    /// Unsharded shape.
    pub shape: Vec<usize>,
    /// Row-major values of the whole parameter.
    pub values: Vec<f32>,
}

/// Where a parameter's initial values come from when it is put under FSDP
/// without anyone holding the whole of it (deferred initialisation, FSDP2's
/// meta-device init followed by `to_empty` and a per-shard init): each rank
/// asks for the rows of its own shard only.
pub trait ShardSource: Send + Sync {
    /// The parameter's values restricted to `rows` of dimension `dim`, in
    /// row-major order as `[outer, rows.len(), inner]` (`outer` the product
    /// of the dimensions before `dim`, `inner` of those after). A 0-d
    /// parameter is asked for `dim` 0, rows `0..1`.
    fn read_rows(&self, dim: usize, rows: Range<usize>) -> std::result::Result<Vec<f32>, String>;
}

/// Whole values with their shape (what [`ParamInit`] carries): a source
/// that slices them on the host.
struct WholeValues {
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl ShardSource for WholeValues {
    fn read_rows(&self, dim: usize, rows: Range<usize>) -> std::result::Result<Vec<f32>, String> {
        rows_of(&self.shape, &self.values, dim, rows)
    }
}

/// `rows` of dimension `dim` of the row-major tensor `values` of `shape`, as
/// `[outer, rows.len(), inner]` (the helper every host-side source can use).
/// A 0-d tensor is one row.
pub fn rows_of(
    shape: &[usize],
    values: &[f32],
    dim: usize,
    rows: Range<usize>,
) -> std::result::Result<Vec<f32>, String> {
    let numel: usize = shape.iter().product();
    if values.len() != numel {
        return Err(format!("{} values for shape {shape:?}", values.len()));
    }
    if shape.is_empty() {
        return Ok(values.to_vec());
    }
    let n = *shape.get(dim).ok_or(format!("dim {dim} is out of range for {shape:?}"))?;
    if rows.start > rows.end || rows.end > n {
        return Err(format!("rows {rows:?} are out of range for dim {dim} of {shape:?}"));
    }
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * rows.len() * inner);
    for o in 0..outer {
        let base = o * n * inner;
        out.extend_from_slice(&values[base + rows.start * inner..base + rows.end * inner]);
    }
    Ok(out)
}

/// A parameter to put under FSDP by its shape and a [`ShardSource`] of its
/// values: each rank reads only the rows its shard holds (or the whole
/// parameter when it is replicated), so no rank materialises the model.
#[derive(Clone)]
pub struct DeferredParam {
    /// Fully qualified name (`model.layers.0.mlp.up_proj.weight`).
    pub name: String,
    /// Unsharded shape.
    pub shape: Vec<usize>,
    /// Where its values come from.
    pub source: Arc<dyn ShardSource>,
}

impl std::fmt::Debug for DeferredParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredParam").field("name", &self.name).field("shape", &self.shape).finish_non_exhaustive()
    }
}

impl From<ParamInit> for DeferredParam {
    fn from(p: ParamInit) -> Self {
        let source = Arc::new(WholeValues { shape: p.shape.clone(), values: p.values });
        DeferredParam { name: p.name, shape: p.shape, source }
    }
}

impl DeferredParam {
    /// Reads `rows` of `dim` from the source and checks the count.
    fn read(&self, dim: usize, rows: Range<usize>, outer: usize, inner: usize) -> Result<Vec<f32>> {
        let want = outer * rows.len() * inner;
        let values = self.source.read_rows(dim, rows.clone()).map_err(|e| {
            FsdpError::InvalidArgument(format!("{}: reading rows {rows:?} of dim {dim}: {e}", self.name))
        })?;
        if values.len() != want {
            return Err(FsdpError::InvalidArgument(format!(
                "{}: the source gave {} values for rows {rows:?} of dim {dim} of {:?}, expected {want}",
                self.name,
                values.len(),
                self.shape
            )));
        }
        Ok(values)
    }
}

/// One parameter of a group: its name and shape, and where its values lie
/// in the group's flat storage ([`GroupStorage`](crate::storage::GroupStorage)).
pub(crate) struct Param {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) numel: usize,
    /// Index into the group layout, or `None` when replicated.
    pub(crate) layout: Option<usize>,
    /// Its f32 shard in the group's flat master, sharded gradient and
    /// optimizer state: the padded shard at its layout offset, or the whole
    /// parameter (replicated) after every sharded one.
    pub(crate) shard: Range<usize>,
    /// Its first element in the group's flat unsharded parameters and
    /// gradients (the parameters whole, in order).
    pub(crate) full: usize,
}

impl Param {
    /// The parameter `init` at `shard` and `full` in its group's storage.
    pub(crate) fn new(init: &DeferredParam, layout: Option<usize>, shard: Range<usize>, full: usize) -> Param {
        let numel = init.shape.iter().product();
        Param { name: init.name.clone(), shape: init.shape.clone(), numel, layout, shard, full }
    }

    /// This rank's f32 values of `init`: the padded shard `[outer,
    /// shard_rows, inner]` of `layout` (zeros in the padding), read from
    /// the source as rank `rank`'s rows alone, or the whole parameter when
    /// `layout` is `None` (replicated).
    pub(crate) fn initial_shard(init: &DeferredParam, layout: Option<&ParamLayout>, rank: usize) -> Result<Vec<f32>> {
        let numel: usize = init.shape.iter().product();
        let Some(l) = layout else {
            let rows = init.shape.first().copied().unwrap_or(1);
            return init.read(0, 0..rows, 1, numel / rows.max(1));
        };
        let first = (rank * l.shard_rows).min(l.rows);
        let real = init.read(l.dim, first..first + l.real_rows(rank), l.outer, l.inner)?;
        let row_len = l.real_rows(rank) * l.inner;
        if row_len == l.shard_rows * l.inner {
            return Ok(real);
        }
        let mut shard = vec![0.0; l.shard_numel];
        for o in 0..l.outer {
            let dst = o * l.shard_rows * l.inner;
            shard[dst..dst + row_len].copy_from_slice(&real[o * row_len..(o + 1) * row_len]);
        }
        Ok(shard)
    }
}
