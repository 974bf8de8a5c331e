//! One parameter's storage (FSDP2's `_fsdp_param`): the f32 sharded master
//! and its sharded gradient, the unsharded parameter and gradient while they
//! exist, and the gradient accumulated over micro-batches without sync.

use chorus_collectives::CommBackend;
use chorus_devices::{Backend, Buffer, DType, Scalar, Stream, StreamExt};

use crate::layout::ParamLayout;
use crate::{Buf, Result};

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

pub(crate) struct Param<C: CommBackend> {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) numel: usize,
    /// Index into the group layout, or `None` when replicated.
    pub(crate) layout: Option<usize>,
    /// f32 master: the padded shard, or the whole parameter when replicated.
    pub(crate) master: Buf<C>,
    /// f32 gradient of the master, once reduced.
    pub(crate) grad: Option<Buf<C>>,
    /// The unsharded parameter in the param dtype, between unshard and reshard.
    pub(crate) unsharded: Option<Buf<C>>,
    /// The unsharded gradient in the param dtype, from pre-backward until it is reduced or accumulated.
    pub(crate) unsharded_grad: Option<Buf<C>>,
    /// Accumulated unsharded gradient in the reduce dtype (no-sync micro-batches).
    pub(crate) acc_grad: Option<Buf<C>>,
}

impl<C: CommBackend> Param<C> {
    /// Uploads `init` on `stream`: rank `rank`'s padded shard when `layout`
    /// (its index in the group layout and its sharding) is given, else the
    /// whole parameter (replicated).
    pub(crate) fn new(
        init: ParamInit,
        layout: Option<(usize, &ParamLayout)>,
        rank: usize,
        stream: &<C::B as Backend>::Stream,
    ) -> Result<Self> {
        let numel = init.values.len();
        let master = match layout {
            Some((_, l)) => stream.buffer_from(&l.shard_of(&init.values, rank))?,
            None => stream.buffer_from(&init.values)?,
        };
        Ok(Param {
            name: init.name,
            shape: init.shape,
            numel,
            layout: layout.map(|(i, _)| i),
            master,
            grad: None,
            unsharded: None,
            unsharded_grad: None,
            acc_grad: None,
        })
    }

    /// Gives the parameter a zeroed unsharded gradient in `dtype` unless it
    /// already has one (a second backward of the same micro-batch adds to it).
    pub(crate) fn ensure_unsharded_grad(&mut self, stream: &<C::B as Backend>::Stream, dtype: DType) -> Result<()> {
        if self.unsharded_grad.is_none() {
            let buf = stream.alloc(dtype, self.numel)?;
            stream.fill(buf.view(), Scalar::Float(0.0))?;
            self.unsharded_grad = Some(buf);
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
