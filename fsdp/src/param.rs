//! One parameter's storage (FSDP2's `_fsdp_param`): the f32 sharded master
//! and its sharded gradient, the unsharded parameter and gradient while they
//! exist, and the gradient accumulated over micro-batches without sync.

use std::ops::Range;
use std::sync::Arc;

use chorus_collectives::CommBackend;
use chorus_devices::{Backend, Buffer, DType, Device, Scalar, Stream, StreamExt};

use crate::layout::ParamLayout;
use crate::{Buf, FsdpError, OffloadPolicy, Result};

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

pub(crate) struct Param<C: CommBackend> {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) numel: usize,
    /// Index into the group layout, or `None` when replicated.
    pub(crate) layout: Option<usize>,
    /// f32 master: the padded shard, or the whole parameter when replicated.
    /// In host memory under `offload`, as are `grad` and the optimizer state.
    pub(crate) master: Buf<C>,
    /// f32 gradient of the master, once reduced.
    pub(crate) grad: Option<Buf<C>>,
    /// The group's CPU offload policy.
    pub(crate) offload: Option<OffloadPolicy>,
    /// The unsharded parameter in the param dtype, between unshard and reshard.
    pub(crate) unsharded: Option<Buf<C>>,
    /// The unsharded gradient in the param dtype, from pre-backward until it is reduced or accumulated.
    pub(crate) unsharded_grad: Option<Buf<C>>,
    /// Accumulated unsharded gradient in the reduce dtype (no-sync micro-batches).
    pub(crate) acc_grad: Option<Buf<C>>,
}

impl<C: CommBackend> Param<C> {
    /// Uploads `init` on `stream`: rank `rank`'s padded shard when `layout`
    /// (its index in the group layout and its sharding) is given, read from
    /// the source as that rank's rows alone, else the whole parameter
    /// (replicated); into host memory under `offload`.
    pub(crate) fn new(
        init: DeferredParam,
        layout: Option<(usize, &ParamLayout)>,
        rank: usize,
        stream: &<C::B as Backend>::Stream,
        offload: Option<OffloadPolicy>,
    ) -> Result<Self> {
        let upload = |values: &[f32]| -> Result<Buf<C>> {
            let buf = match offload {
                Some(o) => stream.device().alloc_host(DType::F32, values.len(), o.pin_memory)?,
                None => stream.alloc(DType::F32, values.len())?,
            };
            stream.upload(values, buf.view())?;
            Ok(buf)
        };
        let numel: usize = init.shape.iter().product();
        let master = match layout {
            Some((_, l)) => {
                let first = (rank * l.shard_rows).min(l.rows);
                let real = init.read(l.dim, first..first + l.real_rows(rank), l.outer, l.inner)?;
                // The padded shard `[outer, shard_rows, inner]`, zeros in the padding.
                let row_len = l.real_rows(rank) * l.inner;
                let shard = if row_len == l.shard_rows * l.inner {
                    real
                } else {
                    let mut shard = vec![0.0; l.shard_numel];
                    for o in 0..l.outer {
                        let dst = o * l.shard_rows * l.inner;
                        shard[dst..dst + row_len].copy_from_slice(&real[o * row_len..(o + 1) * row_len]);
                    }
                    shard
                };
                upload(&shard)?
            }
            None => {
                let rows = init.shape.first().copied().unwrap_or(1);
                upload(&init.read(0, 0..rows, 1, numel / rows.max(1))?)?
            }
        };
        Ok(Param {
            name: init.name,
            shape: init.shape,
            numel,
            layout: layout.map(|(i, _)| i),
            master,
            grad: None,
            offload,
            unsharded: None,
            unsharded_grad: None,
            acc_grad: None,
        })
    }

    /// Gives every parameter of a group a zeroed unsharded gradient in
    /// `dtype` unless it already has one (a second backward of the same
    /// micro-batch adds to it), with one fill for all of them.
    pub(crate) fn ensure_unsharded_grads(
        params: &mut [Param<C>],
        stream: &<C::B as Backend>::Stream,
        dtype: DType,
    ) -> Result<()> {
        let missing: Vec<usize> = (0..params.len()).filter(|i| params[*i].unsharded_grad.is_none()).collect();
        let fresh = missing
            .iter()
            .map(|i| stream.alloc(dtype, params[*i].numel))
            .collect::<chorus_devices::Result<Vec<_>>>()?;
        stream.fill_batch(&fresh.iter().map(|b| b.view()).collect::<Vec<_>>(), Scalar::Float(0.0))?;
        for (i, buf) in missing.into_iter().zip(fresh) {
            params[i].unsharded_grad = Some(buf);
        }
        Ok(())
    }

    /// Adds a fresh unsharded gradient into the reduce-dtype accumulator, if
    /// both exist, and frees the fresh one.
    pub(crate) fn fold_into_accumulator(&mut self, stream: &<C::B as Backend>::Stream) -> Result<()> {
        if let (Some(acc), Some(fresh)) = (&self.acc_grad, &self.unsharded_grad) {
            stream.accumulate(fresh.view(), acc.view())?;
            self.unsharded_grad = None;
        }
        Ok(())
    }

    /// Without gradient sync: moves a fresh gradient into a new accumulator
    /// in `reduce_dtype` (called only when it differs from the param dtype;
    /// otherwise the fresh gradient itself keeps accumulating).
    pub(crate) fn start_accumulator(&mut self, stream: &<C::B as Backend>::Stream, reduce_dtype: DType) -> Result<()> {
        if self.acc_grad.is_none() {
            if let Some(fresh) = self.unsharded_grad.take() {
                let acc = stream.alloc(reduce_dtype, self.numel)?;
                stream.cast(fresh.view(), acc.view())?;
                self.acc_grad = Some(acc);
            }
        }
        Ok(())
    }

    /// Takes the unsharded gradient to reduce, in `reduce_dtype`: the
    /// accumulator if there is one, else the fresh gradient (cast if the
    /// dtypes differ); `None` when the parameter got no gradient.
    pub(crate) fn take_grad_to_reduce(
        &mut self,
        stream: &<C::B as Backend>::Stream,
        param_dtype: DType,
        reduce_dtype: DType,
    ) -> Result<Option<Buf<C>>> {
        Ok(match (self.acc_grad.take(), self.unsharded_grad.take()) {
            (Some(acc), _) => Some(acc),
            (None, Some(fresh)) if param_dtype == reduce_dtype => Some(fresh),
            (None, Some(fresh)) => {
                let cast = stream.alloc(reduce_dtype, self.numel)?;
                stream.cast(fresh.view(), cast.view())?;
                Some(cast)
            }
            (None, None) => None,
        })
    }
}
