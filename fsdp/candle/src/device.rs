//! Where the stages compute: candle's CUDA device where FSDP's device is a
//! chorus `cuda` device and the `candle-cuda` feature is on ([`crate::cuda`]),
//! else candle's CPU (moving data through [`crate::convert`]). Without the
//! feature these answer "not on a device" and the adapter is unchanged.

use candle_core::{Device as CandleDevice, Tensor, Var};
use chorus_devices::{Backend, Stream, View};

use crate::Result;

/// The candle device for stages whose FSDP buffers are on `device`.
pub(crate) fn candle_device<B: Backend>(device: &B::Device) -> Result<CandleDevice> {
    #[cfg(feature = "candle-cuda")]
    if let Some(cuda) = crate::cuda::candle_device::<B>(device)? {
        return Ok(cuda);
    }
    let _ = device;
    Ok(CandleDevice::Cpu)
}

/// A group's unsharded parameters as candle variables on `dev` when it is a
/// CUDA device (device to device; `params` gives the views and shapes in
/// the group's order); `None` on candle's CPU, which the caller handles.
pub(crate) fn vars_on_device<'a, B: Backend, S: Stream<B = B>, I>(
    compute: &S,
    dev: &CandleDevice,
    params: impl FnOnce() -> I,
) -> Result<Option<Vec<Var>>>
where
    I: Iterator<Item = Result<(View<'a, B>, Vec<usize>)>>,
{
    if !dev.is_cuda() {
        return Ok(None);
    }
    #[cfg(feature = "candle-cuda")]
    return Ok(Some(crate::cuda::vars_from_device(compute, dev, &params().collect::<Result<Vec<_>>>()?)?));
    #[cfg(not(feature = "candle-cuda"))]
    {
        let _ = (compute, params);
        Err(crate::Error::InvalidArgument("a CUDA candle device without the candle-cuda feature".into()))
    }
}

/// Adds candle gradients into FSDP's unsharded gradients on the device when
/// `dev` is a CUDA device (`grads` gives each gradient with its
/// destination); `false` on candle's CPU, which the caller handles.
pub(crate) fn grads_on_device<'a, B: Backend, S: Stream<B = B>>(
    compute: &S,
    dev: &CandleDevice,
    grads: impl FnOnce() -> Result<Vec<(Tensor, View<'a, B>)>>,
) -> Result<bool> {
    if !dev.is_cuda() {
        return Ok(false);
    }
    #[cfg(feature = "candle-cuda")]
    {
        crate::cuda::add_grads_on_device(compute, dev, &grads()?)?;
        Ok(true)
    }
    #[cfg(not(feature = "candle-cuda"))]
    {
        let _ = (compute, grads);
        Err(crate::Error::InvalidArgument("a CUDA candle device without the candle-cuda feature".into()))
    }
}
