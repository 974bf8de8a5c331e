//! Where the stages compute and how data crosses between candle and FSDP's
//! buffers ([`Side`], chosen once per model): candle's CUDA device on FSDP's
//! own buffers where FSDP's device is a chorus `cuda` device and the
//! `candle-cuda` feature is on ([`crate::cuda`]); else candle's CPU, with one
//! copy each way — direct host reads and writes where the device's buffers
//! are host memory, else a readback per parameter and an upload per gradient
//! through the public [`Stream`] API ([`crate::convert`]; the route a device
//! without host memory takes, selectable on any device with
//! [`Transfers::Staged`]).

use candle_core::{Device as CandleDevice, Storage, Tensor, Var};
use chorus_devices::{AccessKind, Backend, Buffer, Stream, View};
use chorus_fsdp::FsdpError;

use crate::convert::{
    add_into_host, candle_dtype, host_memory, start_readback, storage_of, upload_tensor, var_from_host,
    var_from_readback,
};
use crate::{Error, Result};

/// How parameters and gradients cross between FSDP's buffers and candle's
/// CPU tensors (on candle's CUDA device nothing is copied, whatever this says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transfers {
    /// Direct host reads and writes where the device's buffers are host
    /// memory (the `cpu` device), else [`Transfers::Staged`].
    #[default]
    Direct,
    /// A readback per parameter ([`Stream::copy_to_host`]) and an upload plus
    /// `accumulate` per gradient ([`Stream::copy_from_host`]): what a device
    /// without host memory (the hip device) takes, on any device.
    Staged,
}

/// The candle device for stages whose FSDP buffers are on `device`.
pub(crate) fn candle_device<B: Backend>(device: &B::Device) -> Result<CandleDevice> {
    #[cfg(feature = "candle-cuda")]
    if let Some(cuda) = crate::cuda::candle_device::<B>(device)? {
        return Ok(cuda);
    }
    let _ = device;
    Ok(CandleDevice::Cpu)
}

/// Refuses candle on the CPU for a device whose kernels do not reach host
/// memory (a GPU): candle would compute there silently, far slower, with
/// every parameter and gradient crossing to the host.
pub(crate) fn check_compute_placement(
    candle: &CandleDevice,
    kernels_reach_host: bool,
    device_name: impl FnOnce() -> String,
) -> Result<()> {
    if candle.is_cpu() && !kernels_reach_host {
        return Err(crate::Error::NoCandleDevice { device: device_name() });
    }
    Ok(())
}

/// A parameter or a stage input as a candle variable: a copy (candle's CPU),
/// or a variable borrowing the memory behind it (candle's CUDA device),
/// which [`BoundVar::release`] gives back.
pub(crate) struct BoundVar {
    var: Var,
    #[cfg(feature = "candle-cuda")]
    borrowed: Option<crate::cuda::Borrowed>,
}

impl BoundVar {
    fn copied(var: Var) -> Self {
        BoundVar {
            var,
            #[cfg(feature = "candle-cuda")]
            borrowed: None,
        }
    }

    /// The variable.
    pub(crate) fn var(&self) -> &Var {
        &self.var
    }

    /// Whether the variable borrows memory it has not given back yet.
    pub(crate) fn is_borrowed(&self) -> bool {
        #[cfg(feature = "candle-cuda")]
        return self.borrowed.as_ref().is_some_and(crate::cuda::Borrowed::is_bound);
        #[cfg(not(feature = "candle-cuda"))]
        false
    }

    /// Gives borrowed memory back (see `cuda::Borrowed::release`; with
    /// `keep_values` the variable keeps a copy of the values); nothing for a copy.
    pub(crate) fn release(&mut self, keep_values: bool) -> Result<()> {
        #[cfg(feature = "candle-cuda")]
        if let Some(b) = self.borrowed.as_mut() {
            b.release(keep_values)?;
        }
        let _ = keep_values;
        Ok(())
    }
}

/// Where the stages compute and how data crosses (module docs).
pub(crate) enum Side {
    /// candle's CPU, moving data as [`Transfers`] says.
    Host(Transfers),
    /// candle's CUDA device on FSDP's buffers.
    #[cfg(feature = "candle-cuda")]
    Cuda(Box<crate::cuda::CudaSide>),
}

impl Side {
    /// The side of candle's device `dev` for FSDP's compute stream `compute`.
    pub(crate) fn new<S: Stream>(compute: &S, dev: &CandleDevice, transfers: Transfers) -> Result<Side> {
        #[cfg(feature = "candle-cuda")]
        if let Some(cuda) = crate::cuda::CudaSide::new(compute, dev)? {
            return Ok(Side::Cuda(Box::new(cuda)));
        }
        if dev.is_cuda() {
            return Err(Error::InvalidArgument("a CUDA candle device without the candle-cuda feature".into()));
        }
        let _ = compute;
        Ok(Side::Host(transfers))
    }

    /// Whether candle computes on FSDP's buffers on the device (parameters
    /// borrowed, gradients added by candle's stream), so that crossings order
    /// the two streams.
    pub(crate) fn on_device(&self) -> bool {
        !matches!(self, Side::Host(_))
    }

    /// Orders candle's later work after everything enqueued on `compute`
    /// (FSDP's all-gathers, zeroed gradients); nothing on the host side,
    /// whose copies synchronize the stream themselves.
    pub(crate) fn candle_waits_for<S: Stream>(&self, compute: &S) -> Result<()> {
        match self {
            Side::Host(_) => {
                let _ = compute;
                Ok(())
            }
            #[cfg(feature = "candle-cuda")]
            Side::Cuda(c) => c.candle_waits_for(compute),
        }
    }

    /// Orders `compute`'s later work after candle's work so far, declaring
    /// `accesses` (the FSDP buffers it read or wrote); nothing on the host.
    pub(crate) fn compute_waits_for<B: Backend, S: Stream<B = B>>(
        &self,
        compute: &S,
        accesses: &[(View<'_, B>, AccessKind)],
    ) -> Result<()> {
        match self {
            Side::Host(_) => {
                let _ = (compute, accesses);
                Ok(())
            }
            #[cfg(feature = "candle-cuda")]
            Side::Cuda(c) => c.compute_waits_for(compute, accesses),
        }
    }

    /// A group's unsharded parameters (`params`: views and shapes, in the
    /// group's order) as candle variables on `dev`. On CUDA they borrow
    /// FSDP's buffers (the caller has made candle wait for `compute`); on
    /// the host each is one copy (after synchronizing `compute`, the only
    /// writer) or one readback. Also says how many were read back.
    pub(crate) fn bind_params<B: Backend, S: Stream<B = B>>(
        &self,
        compute: &S,
        dev: &CandleDevice,
        params: Vec<(View<'_, B>, Vec<usize>)>,
    ) -> Result<(Vec<BoundVar>, usize)> {
        match self {
            #[cfg(feature = "candle-cuda")]
            Side::Cuda(_) => {
                let bound = params
                    .iter()
                    .map(|(view, shape)| {
                        let borrowed = crate::cuda::borrow_view(dev, *view, shape)?;
                        Ok(BoundVar { var: borrowed.var().clone(), borrowed: Some(borrowed) })
                    })
                    .collect::<Result<_>>()?;
                Ok((bound, 0))
            }
            Side::Host(transfers) => {
                let _ = dev;
                let direct =
                    *transfers == Transfers::Direct && params.iter().all(|(view, _)| host_memory(*view).is_some());
                if direct {
                    compute.synchronize().map_err(FsdpError::from)?;
                    let bound = params
                        .iter()
                        .map(|(view, shape)| {
                            let src = host_memory(*view)
                                .ok_or_else(|| Error::InvalidArgument("a parameter that left host memory".into()))?;
                            // SAFETY: the compute stream, the only writer of the
                            // unsharded parameters, is synchronized, and nothing
                            // is enqueued until the copy is made.
                            Ok(BoundVar::copied(unsafe { var_from_host(&src, shape) }?))
                        })
                        .collect::<Result<_>>()?;
                    Ok((bound, 0))
                } else {
                    let pending = params
                        .iter()
                        .map(|(view, shape)| Ok((start_readback(compute, *view)?, shape)))
                        .collect::<Result<Vec<_>>>()?;
                    let bound = pending
                        .into_iter()
                        .map(|(rb, shape)| Ok(BoundVar::copied(var_from_readback(rb, shape)?)))
                        .collect::<Result<Vec<_>>>()?;
                    let staged = bound.len();
                    Ok((bound, staged))
                }
            }
        }
    }

    /// `x` (a float tensor on candle's device, contiguous) as a variable
    /// candle differentiates by: on CUDA a variable borrowing `x`'s
    /// allocation (and keeping `x` alive until released); on the CPU a copy
    /// (a candle variable owns its storage).
    pub(crate) fn input_var(&self, x: &Tensor) -> Result<BoundVar> {
        match self {
            Side::Host(_) => Ok(BoundVar::copied(Var::from_tensor(&x.detach())?)),
            #[cfg(feature = "candle-cuda")]
            Side::Cuda(_) => {
                let borrowed = crate::cuda::borrow_tensor(x)?;
                Ok(BoundVar { var: borrowed.var().clone(), borrowed: Some(borrowed) })
            }
        }
    }

    /// Adds each candle gradient into its destination, FSDP's unsharded
    /// gradient: on CUDA one kernel each on candle's stream (the caller
    /// orders it with crossings); on the host straight from candle's
    /// storage (after synchronizing `compute`), or through an upload and
    /// `accumulate` ([`Transfers::Staged`], or a device without host
    /// memory). Says how many were uploaded.
    pub(crate) fn add_grads<B: Backend, S: Stream<B = B>>(
        &self,
        compute: &S,
        grads: Vec<(Tensor, View<'_, B>)>,
    ) -> Result<usize> {
        match self {
            #[cfg(feature = "candle-cuda")]
            Side::Cuda(c) => {
                let _ = compute;
                c.add_grads(&grads)?;
                Ok(0)
            }
            Side::Host(transfers) => {
                let (mut synchronized, mut uploaded) = (false, 0);
                for (grad, dst) in grads {
                    let grad = grad.to_dtype(candle_dtype(dst.dtype())?)?;
                    match host_memory(dst).filter(|_| *transfers == Transfers::Direct) {
                        Some(dst) => {
                            if !synchronized {
                                compute.synchronize().map_err(FsdpError::from)?;
                                synchronized = true;
                            }
                            // SAFETY: the compute stream, the only user of the
                            // unsharded gradients until post-backward, is
                            // synchronized and nothing is enqueued during the add.
                            unsafe { add_into_host(&grad, &dst) }?;
                        }
                        None => {
                            let staged = compute.alloc(dst.dtype(), dst.len()).map_err(FsdpError::from)?;
                            upload_tensor(compute, &grad, staged.view())?;
                            compute.accumulate(staged.view(), dst).map_err(FsdpError::from)?;
                            uploaded += 1;
                        }
                    }
                }
                Ok(uploaded)
            }
        }
    }
}

/// A copy of `out`'s elements as a storage of its device (a stage's output
/// whose storage cannot be taken).
pub(crate) fn copy_storage(out: &Tensor) -> Result<Storage> {
    match out.device() {
        CandleDevice::Cpu => Ok(Storage::Cpu(storage_of(out)?)),
        #[cfg(feature = "candle-cuda")]
        CandleDevice::Cuda(_) => Ok(Storage::Cuda(crate::cuda::storage_of(out)?)),
        _ => Err(Error::InvalidArgument("a stage's output on a device the adapter does not use".into())),
    }
}
