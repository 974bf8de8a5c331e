//! candle storages behind the stage op: a stage's output handed to candle
//! without a copy where the output is the stage's own ([`take_output`]),
//! and the op that seeds a stage's backward with the gradient of its output
//! ([`seed_backward`]).
//!
//! A candle custom op returns an owned storage, while a stage's output is a
//! tensor whose storage candle's `Arc` holds. candle's in-place op hands out
//! `&mut` to a tensor's storage, so the adapter moves the storage out and
//! leaves an allocation of the same size in its place (zeroed on the CPU,
//! uninitialised on CUDA): a tensor that still shares the storage reads
//! memory it owns, never freed memory. It does so only for a compact output
//! (contiguous, from the storage's first element to its last) that is not
//! the stage's input or one of its parameters (compared by address); any
//! other output is copied as before.

use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cpu_backend::CpuDevice;
use candle_core::{CpuStorage, CustomOp1, InplaceOp1, Layout, Shape, Storage, Tensor};

use crate::{Error, Result};

/// The address of `storage`'s first element and its element count (the
/// dtypes a stage's output may have).
fn cpu_extent(storage: &CpuStorage) -> Option<(u64, usize)> {
    macro_rules! extent {
        ($v:expr) => {
            Some(($v.as_ptr() as u64, $v.len()))
        };
    }
    match storage {
        CpuStorage::U8(v) => extent!(v),
        CpuStorage::U32(v) => extent!(v),
        CpuStorage::I64(v) => extent!(v),
        CpuStorage::BF16(v) => extent!(v),
        CpuStorage::F16(v) => extent!(v),
        CpuStorage::F32(v) => extent!(v),
        CpuStorage::F64(v) => extent!(v),
        _ => None,
    }
}

/// The address of the allocation behind `t`'s storage (not its layout's
/// start) and the storage's element count; tensors that share a storage,
/// and a storage and a variable borrowing it, have the same address.
pub(crate) fn storage_extent(t: &Tensor) -> Option<(u64, usize)> {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => cpu_extent(s),
        #[cfg(feature = "candle-cuda")]
        Storage::Cuda(s) => crate::cuda::cuda_extent(s),
        _ => None,
    }
}

/// The in-place op that moves a storage out of its tensor.
#[derive(Default)]
struct TakeStorage {
    taken: Mutex<Option<Storage>>,
}

impl TakeStorage {
    fn put(&self, storage: Storage) -> candle_core::Result<()> {
        let mut taken = self.taken.lock().map_err(|_| candle_core::Error::msg("a poisoned lock"))?;
        *taken = Some(storage);
        Ok(())
    }
}

impl InplaceOp1 for TakeStorage {
    fn name(&self) -> &'static str {
        "chorus-take-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let fresh = CpuDevice.zeros_impl(layout.shape(), storage.dtype())?;
        self.put(Storage::Cpu(std::mem::replace(storage, fresh)))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let taken = crate::cuda::take_cuda_storage(storage, layout)?;
        self.put(Storage::Cuda(taken))
    }
}

/// `out`'s storage, moved out of it without a copy, when `out` is compact
/// (contiguous over its whole storage) and its storage is none of
/// `protected` (addresses of [`storage_extent`]: the stage's input and
/// parameters); `None` when it cannot be taken (the caller copies).
pub(crate) fn take_output(out: &Tensor, protected: &[u64]) -> Result<Option<Storage>> {
    if !out.is_contiguous() || out.layout().start_offset() != 0 {
        return Ok(None);
    }
    match storage_extent(out) {
        Some((address, len)) if len == out.elem_count() && !protected.contains(&address) => {}
        _ => return Ok(None),
    }
    let take = TakeStorage::default();
    out.inplace_op1(&take)?;
    let taken = take.taken.into_inner().map_err(|_| Error::InvalidArgument("a poisoned lock".into()))?;
    Ok(taken)
}

/// The op whose output is a scalar and whose gradient for its argument is
/// a given tensor: the root of a stage's backward, so candle's backward
/// from it gives exactly the vector-Jacobian product with `grad`.
struct Seed {
    grad: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "chorus-backward-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::cuda_scalar_zero(storage)?, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // The seed is only ever the root of a backward (`seed_backward`),
        // which starts from ones: `grad_res` is 1 and the chain rule's
        // product with it would change nothing.
        Ok(Some(self.grad.to_dtype(arg.dtype())?))
    }
}

/// candle's backward of `out` seeded with `grad_out` (of `out`'s shape):
/// the gradients of everything `out` depends on, as those of
/// `sum(out · grad_out)`, without computing that product.
pub(crate) fn seed_backward(out: &Tensor, grad_out: &Tensor) -> Result<candle_core::backprop::GradStore> {
    if out.dims() != grad_out.dims() {
        return Err(Error::InvalidArgument(format!(
            "a stage's output of shape {:?} and its gradient of shape {:?}",
            out.dims(),
            grad_out.dims()
        )));
    }
    Ok(out.apply_op1(Seed { grad: grad_out.detach() })?.backward()?)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;

    fn address(t: &Tensor) -> u64 {
        storage_extent(t).expect("a CPU storage").0
    }

    #[test]
    fn a_compact_output_is_moved_not_copied_and_the_rest_are_refused() {
        let dev = Device::Cpu;
        let x = Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((3, 4)).unwrap();
        let out = (&x * 2.0).unwrap();
        let (before, values) = (address(&out), out.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let Some(Storage::Cpu(CpuStorage::F32(taken))) = take_output(&out, &[address(&x)]).unwrap() else {
            panic!("a compact output of its own was not taken")
        };
        // The very allocation the stage computed, with its values; the output
        // keeps a zeroed allocation of its own.
        assert_eq!(taken.as_ptr() as u64, before);
        assert_eq!(taken, values);
        assert_ne!(address(&out), before);
        assert_eq!(out.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 12]);
        // The input itself, a view of it, a strided view and a protected
        // parameter are left alone (the caller copies them).
        assert!(take_output(&x, &[address(&x)]).unwrap().is_none());
        assert!(take_output(&x.reshape(12).unwrap(), &[address(&x)]).unwrap().is_none());
        let other = (&x + 1.0).unwrap();
        assert!(take_output(&other.t().unwrap(), &[]).unwrap().is_none(), "not contiguous");
        assert!(take_output(&other.narrow(0, 1, 2).unwrap(), &[]).unwrap().is_none(), "not its whole storage");
        // A parameter, returned as is or detached (the storage is the same).
        let w = Var::from_tensor(&other).unwrap();
        assert!(take_output(&w.as_detached_tensor(), &[address(w.as_tensor())]).unwrap().is_none(), "a parameter");
        assert_eq!(w.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0], 1.0, "left as it was");
    }

    #[test]
    fn the_seeded_backward_is_the_vector_jacobian_product() {
        let dev = Device::Cpu;
        let w = Var::from_vec(vec![0.5f32, -1.0, 2.0, 0.25, 3.0, -0.75], (2, 3), &dev).unwrap();
        let x = Var::from_vec(vec![1.0f32, 2.0, -3.0, 0.5], (2, 2), &dev).unwrap();
        let g = Tensor::from_vec(vec![0.1f32, -0.2, 0.3, 0.4, 0.5, -0.6], (2, 3), &dev).unwrap();
        // out = tanh(x·w): candle's backward reads its result too.
        let out = x.as_tensor().matmul(w.as_tensor()).unwrap().tanh().unwrap();
        let grads = seed_backward(&out, &g).unwrap();
        // Closed form: d = g ⊙ (1 - out²); dW = xᵀ·d, dX = d·wᵀ.
        let d = (&g * (1.0 - out.sqr().unwrap()).unwrap()).unwrap();
        let dw = x.as_tensor().t().unwrap().matmul(&d).unwrap();
        let dx = d.matmul(&w.as_tensor().t().unwrap()).unwrap();
        for (got, want) in [(grads.get(w.as_tensor()).unwrap(), dw), (grads.get(x.as_tensor()).unwrap(), dx)] {
            let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-6, "{diff}");
        }
        // A gradient of another shape is refused.
        assert!(seed_backward(&out, &g.reshape(6).unwrap()).is_err());
    }

    /// candle as ci/candle-cuda.sh patches it keeps a tensor's first
    /// gradient as it comes instead of adding it to zeros: the seeded
    /// gradient reaches a parameter added to a constant as that very
    /// allocation; a second use adds; a weight's through `x·Wᵀ` is the
    /// transposed view. candle from crates.io makes each a tensor of its own.
    #[test]
    #[ignore = "needs candle-core patched by ci/candle-cuda.sh (ci/test.sh builds from that copy and runs it)"]
    fn a_first_gradient_is_kept_as_it_comes_with_candle_patched() {
        let dev = Device::Cpu;
        let w = Var::from_vec(vec![1.0f32, 2.0, 3.0], 3, &dev).unwrap();
        let c = Tensor::from_vec(vec![0.5f32, 0.5, 0.5], 3, &dev).unwrap();
        let g = Tensor::from_vec(vec![0.1f32, -0.2, 0.3], 3, &dev).unwrap();
        let grads = seed_backward(&(w.as_tensor() + &c).unwrap(), &g).unwrap();
        let once = grads.get(w.as_tensor()).unwrap();
        assert_eq!(once.to_vec1::<f32>().unwrap(), vec![0.1, -0.2, 0.3]);
        assert_eq!(address(once), address(&g), "the first gradient was copied: candle-core is not the patched copy");
        let grads = seed_backward(&(w.as_tensor() + w.as_tensor()).unwrap(), &g).unwrap();
        let twice = grads.get(w.as_tensor()).unwrap();
        assert_eq!(twice.to_vec1::<f32>().unwrap(), vec![0.2, -0.4, 0.6]);
        assert_ne!(address(twice), address(&g), "a sum written into the seed");
        assert_eq!(g.to_vec1::<f32>().unwrap(), vec![0.1, -0.2, 0.3], "the seed is left as it was");
        // A Linear's weight: out = x·Wᵀ, so dW = gᵀ·x, reached through the transpose.
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], (3, 2), &dev).unwrap();
        let w = Var::from_vec(vec![0.5f32, -1.0, 2.0, 0.25], (2, 2), &dev).unwrap();
        let g = Tensor::from_vec(vec![0.1f32, 0.2, 0.3, -0.4, 0.5, 0.6], (3, 2), &dev).unwrap();
        let grads = seed_backward(&x.matmul(&w.as_tensor().t().unwrap()).unwrap(), &g).unwrap();
        let dw = grads.get(w.as_tensor()).unwrap();
        assert!(!dw.is_contiguous(), "a weight's gradient was copied out of the transpose");
        let want = g.t().unwrap().matmul(&x).unwrap();
        let diff = (dw - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "{diff}");
    }
}
