//! A group's storage, one flat buffer per kind for the whole group: the f32
//! master shard, its sharded gradient, the unsharded parameters and
//! unsharded gradients, and the gradients accumulated without sync. Each
//! parameter is a range of them ([`Param::shard`](crate::param::Param),
//! [`Param::full`](crate::param::Param)).
//!
//! One buffer per group rather than per parameter is what keeps FSDP's host
//! work per group and step independent of how many parameters a group has:
//! an unshard allocates once and copies out in one batch, a reshard frees
//! once, the unsharded gradients are zeroed by one fill and cast to the
//! reduce dtype by one kernel, the copy-in casts the whole shard at once
//! (the masters are laid out as the all-gather input is), the reduce-scatter
//! output becomes the sharded gradient without a copy, and the optimizer
//! steps a group with one kernel. Memory is unchanged: the same bytes, held
//! over the same spans, counted exactly by the device.

use chorus_collectives::CommBackend;
use chorus_devices::{Backend, Buffer, DType, Device, Scalar, Stream};

use crate::{Buf, OffloadPolicy, Result};

/// A group's buffers. The master, sharded gradient and optimizer state are
/// laid out alike: the sharded parameters' padded shards at their layout
/// offsets (the all-gather input's layout), then each replicated parameter
/// whole. The unsharded parameters and gradients hold every parameter whole,
/// in order.
pub(crate) struct GroupStorage<C: CommBackend> {
    /// f32 masters, in host memory under `offload`.
    pub(crate) master: Buf<C>,
    /// f32 sharded gradients once reduced (host memory under `offload`).
    pub(crate) grad: Option<Buf<C>>,
    /// The group's CPU offload policy.
    pub(crate) offload: Option<OffloadPolicy>,
    /// Elements of the sharded part of `master` (the group layout's shard).
    pub(crate) sharded_numel: usize,
    /// Elements of every parameter whole (the unsharded buffers' length).
    pub(crate) full_numel: usize,
    /// The unsharded parameters in the param dtype, between unshard and reshard.
    pub(crate) unsharded: Option<Buf<C>>,
    /// The unsharded gradients in the param dtype, from pre-backward until
    /// they are reduced or accumulated.
    pub(crate) unsharded_grad: Option<Buf<C>>,
    /// Unsharded gradients accumulated in the reduce dtype (no-sync micro-batches).
    pub(crate) acc_grad: Option<Buf<C>>,
}

impl<C: CommBackend> GroupStorage<C> {
    /// Storage with zeroed masters of `shard_numel` elements (`sharded_numel`
    /// of them sharded) for parameters of `full_numel` elements in all: in
    /// host memory under `offload`, else on `stream` in stream order.
    pub(crate) fn new(
        stream: &<C::B as Backend>::Stream,
        shard_numel: usize,
        sharded_numel: usize,
        full_numel: usize,
        offload: Option<OffloadPolicy>,
    ) -> Result<Self> {
        let master = crate::offload::zeroed_f32(stream, shard_numel, offload)?;
        Ok(GroupStorage {
            master,
            grad: None,
            offload,
            sharded_numel,
            full_numel,
            unsharded: None,
            unsharded_grad: None,
            acc_grad: None,
        })
    }

    /// Gives the group zeroed unsharded gradients in `dtype` unless it has
    /// them (a second backward of the same micro-batch adds to them): one
    /// allocation and one fill.
    pub(crate) fn ensure_unsharded_grads(&mut self, stream: &<C::B as Backend>::Stream, dtype: DType) -> Result<()> {
        if self.unsharded_grad.is_none() {
            let grads = stream.alloc(dtype, self.full_numel)?;
            stream.fill(grads.view(), Scalar::Float(0.0))?;
            self.unsharded_grad = Some(grads);
        }
        Ok(())
    }

    /// Adds fresh unsharded gradients into the reduce-dtype accumulator, if
    /// both exist, and frees the fresh ones.
    pub(crate) fn fold_into_accumulator(&mut self, stream: &<C::B as Backend>::Stream) -> Result<()> {
        if let (Some(acc), Some(fresh)) = (&self.acc_grad, &self.unsharded_grad) {
            stream.accumulate(fresh.view(), acc.view())?;
            self.unsharded_grad = None;
        }
        Ok(())
    }

    /// Without gradient sync: moves fresh gradients into a new accumulator
    /// in `reduce_dtype` (called only when it differs from the param dtype;
    /// otherwise the fresh gradients themselves keep accumulating).
    pub(crate) fn start_accumulator(&mut self, stream: &<C::B as Backend>::Stream, reduce_dtype: DType) -> Result<()> {
        if self.acc_grad.is_none() {
            if let Some(fresh) = self.unsharded_grad.take() {
                let acc = stream.alloc(reduce_dtype, self.full_numel)?;
                stream.cast(fresh.view(), acc.view())?;
                self.acc_grad = Some(acc);
            }
        }
        Ok(())
    }

    /// Takes the unsharded gradients to reduce, in `reduce_dtype`: the
    /// accumulator if there is one, else the fresh gradients (cast if the
    /// dtypes differ); `None` when the group got no gradients.
    pub(crate) fn take_grads_to_reduce(
        &mut self,
        stream: &<C::B as Backend>::Stream,
        param_dtype: DType,
        reduce_dtype: DType,
    ) -> Result<Option<Buf<C>>> {
        Ok(match (self.acc_grad.take(), self.unsharded_grad.take()) {
            (Some(acc), _) => Some(acc),
            (None, Some(fresh)) if param_dtype == reduce_dtype => Some(fresh),
            (None, Some(fresh)) => {
                let cast = stream.alloc(reduce_dtype, self.full_numel)?;
                stream.cast(fresh.view(), cast.view())?;
                Some(cast)
            }
            (None, None) => None,
        })
    }

    /// Whether the masters live in host memory (CPU offload).
    pub(crate) fn in_host(&self) -> bool {
        self.offload.is_some()
    }

    /// The device the buffers belong to.
    pub(crate) fn device(&self) -> &<C::B as Backend>::Device {
        self.master.device()
    }
}

/// The device's zeroed f32 buffer for a group's optimizer state or
/// gradient, where the group keeps its masters.
pub(crate) fn zeroed_like<C: CommBackend>(
    stream: &<C::B as Backend>::Stream,
    storage: &GroupStorage<C>,
) -> Result<Buf<C>> {
    Ok(crate::offload::zeroed_f32(stream, storage.master.len(), storage.offload)?)
}

/// Whether `device` may run kernels on the group's masters where they are.
pub(crate) fn kernels_reach<C: CommBackend>(storage: &GroupStorage<C>) -> bool {
    !storage.in_host() || storage.device().kernels_reach_host()
}
