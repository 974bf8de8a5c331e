//! Data movement where one side may be in host memory (CPU offload).
//!
//! On a GPU only copies may touch a host buffer (see
//! [`MemorySpace`](chorus_devices::MemorySpace)), so a cast or an
//! accumulation with a host operand goes through a device staging buffer:
//! copy in, the same kernel on the device, copy out. The kernel is the one
//! used without offload, so the values are the same bit for bit. These
//! helpers take that path on every device (the cpu device too), so CI runs
//! the protocol a GPU runs.

use chorus_devices::{Backend, Buffer, DType, Device, MemorySpace, Stream, View};

use crate::OffloadPolicy;

/// Whether a view is of a host-memory buffer.
pub(crate) fn is_host<B: Backend>(v: &View<'_, B>) -> bool {
    v.buffer().space() == MemorySpace::Host
}

/// A device buffer with `src`'s contents (in stream order on `s`), or
/// `None` when `src` is already in device memory.
fn staged<S: Stream>(s: &S, src: &View<'_, S::B>) -> chorus_devices::Result<Option<<S::B as Backend>::Buffer>> {
    if !is_host(src) {
        return Ok(None);
    }
    let tmp = s.alloc(src.dtype(), src.len())?;
    s.copy(*src, tmp.view())?;
    Ok(Some(tmp))
}

/// A copy, or a cast where the dtypes differ; either side may be in host memory.
pub(crate) fn cast_or_copy<S: Stream>(s: &S, src: View<'_, S::B>, dst: View<'_, S::B>) -> chorus_devices::Result<()> {
    if src.dtype() == dst.dtype() {
        return s.copy(src, dst);
    }
    let src_tmp = staged(s, &src)?;
    let src = src_tmp.as_ref().map_or(src, |b| b.view());
    if is_host(&dst) {
        let tmp = s.alloc(dst.dtype(), dst.len())?;
        s.cast(src, tmp.view())?;
        s.copy(tmp.view(), dst)
    } else {
        s.cast(src, dst)
    }
}

/// `dst += src`; either side may be in host memory.
pub(crate) fn accumulate<S: Stream>(s: &S, src: View<'_, S::B>, dst: View<'_, S::B>) -> chorus_devices::Result<()> {
    let src_tmp = staged(s, &src)?;
    let src = src_tmp.as_ref().map_or(src, |b| b.view());
    match staged(s, &dst)? {
        None => s.accumulate(src, dst),
        Some(tmp) => {
            s.accumulate(src, tmp.view())?;
            s.copy(tmp.view(), dst)
        }
    }
}

/// A zeroed f32 buffer of `len` elements: in host memory under `offload`,
/// else on `s` in stream order.
pub(crate) fn zeroed_f32<S: Stream>(
    s: &S,
    len: usize,
    offload: Option<OffloadPolicy>,
) -> chorus_devices::Result<<S::B as Backend>::Buffer> {
    match offload {
        // Host buffers are allocated zeroed, synchronously.
        Some(o) => s.device().alloc_host(DType::F32, len, o.pin_memory),
        None => {
            let b = s.alloc(DType::F32, len)?;
            s.fill(b.view(), chorus_devices::Scalar::Float(0.0))?;
            Ok(b)
        }
    }
}

/// Runs the kernel `f` on `v`, which may be in host memory: directly when
/// the device's kernels reach host memory (the cpu device), else on a device
/// copy, copied back when `writes`.
pub(crate) fn on_kernel_view<S: Stream>(
    s: &S,
    v: View<'_, S::B>,
    writes: bool,
    f: impl FnOnce(View<'_, S::B>) -> chorus_devices::Result<()>,
) -> chorus_devices::Result<()> {
    if !is_host(&v) || s.device().kernels_reach_host() {
        return f(v);
    }
    let tmp = s.alloc(v.dtype(), v.len())?;
    s.copy(v, tmp.view())?;
    f(tmp.view())?;
    if writes {
        s.copy(tmp.view(), v)?;
    }
    Ok(())
}
