//! The candle custom-op plumbing every fused op shares, written once: an op
//! states its output's shape, its CPU reference on its inputs' host values
//! and its CUDA launch ([`Kernel`]); [`Op`] makes that candle's `CustomOp1`,
//! `CustomOp2` or `CustomOp3` by the number of inputs.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

use crate::host::{f32_values, storage_from_f32, u32_values};

/// A [`Kernel`]'s input on candle's CUDA device: its storage and layout.
#[cfg(feature = "cuda")]
pub(crate) type CudaInput<'a> = (&'a CudaStorage, &'a Layout);

/// One fused op's forward on `N` contiguous inputs.
pub(crate) trait Kernel<const N: usize>: Send + Sync {
    /// candle's name for the op, also the CPU side's in its errors.
    const NAME: &'static str;

    /// The output's shape from the inputs' (on both devices, before any launch).
    fn shape(&self, inputs: [&Shape; N]) -> Result<Shape>;

    /// The CPU output's dtype, given the first input's: that one unless the op's output is always f32.
    fn dtype(&self, first: DType) -> DType {
        first
    }

    /// The CPU reference: the output's values in f32, rounded once to [`Kernel::dtype`] by [`Op`].
    fn cpu(&self, inputs: [CpuInput<'_>; N]) -> Result<Vec<f32>>;

    /// The CUDA launches that write the output.
    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [CudaInput<'_>; N]) -> Result<CudaStorage>;

    /// The inputs' gradients from the inputs, the output and its gradient.
    /// None by default, as candle's: the backward ops are applied without one.
    fn bwd(&self, _inputs: [&Tensor; N], _out: &Tensor, _grad: &Tensor) -> Result<[Option<Tensor>; N]> {
        Err(candle_core::Error::BackwardNotSupported { op: Self::NAME })
    }
}

/// An input of a [`Kernel`] on the CPU, read as the op needs it (errors name the op).
pub(crate) struct CpuInput<'a> {
    op: &'static str,
    storage: &'a CpuStorage,
    layout: &'a Layout,
}

impl CpuInput<'_> {
    /// The elements widened to f32.
    pub(crate) fn f32(&self) -> Result<Vec<f32>> {
        f32_values(self.op, self.storage, self.layout)
    }

    /// The elements as u32 token ids.
    pub(crate) fn u32(&self) -> Result<Vec<u32>> {
        u32_values(self.op, self.storage, self.layout)
    }

    /// The shape the layout gives it.
    pub(crate) fn shape(&self) -> &Shape {
        self.layout.shape()
    }

    /// The dtype it is stored in.
    pub(crate) fn dtype(&self) -> DType {
        self.storage.dtype()
    }
}

/// A [`Kernel`] as candle's custom op of its arity.
pub(crate) struct Op<K>(pub(crate) K);

impl<K> Op<K> {
    fn cpu<const N: usize>(&self, inputs: [(&CpuStorage, &Layout); N]) -> Result<(CpuStorage, Shape)>
    where
        K: Kernel<N>,
    {
        let shape = self.0.shape(inputs.map(|(_, l)| l.shape()))?;
        let dtype = self.0.dtype(inputs[0].0.dtype());
        let y = self.0.cpu(inputs.map(|(storage, layout)| CpuInput { op: K::NAME, storage, layout }))?;
        Ok((storage_from_f32(y, dtype)?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda<const N: usize>(&self, inputs: [CudaInput<'_>; N]) -> Result<(CudaStorage, Shape)>
    where
        K: Kernel<N>,
    {
        let shape = self.0.shape(inputs.map(|(_, l)| l.shape()))?;
        Ok((self.0.cuda(inputs)?, shape))
    }
}

impl<K: Kernel<1>> CustomOp1 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu([(s, l)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.cuda([(s, l)])
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let [d] = self.0.bwd([arg], res, grad)?;
        Ok(d)
    }
}

impl<K: Kernel<2>> CustomOp2 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu([(s1, l1), (s2, l2)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.cuda([(s1, l1), (s2, l2)])
    }

    fn bwd(&self, a1: &Tensor, a2: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [d1, d2] = self.0.bwd([a1, a2], res, grad)?;
        Ok((d1, d2))
    }
}

impl<K: Kernel<3>> CustomOp3 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu([(s1, l1), (s2, l2), (s3, l3)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        a1: &Tensor,
        a2: &Tensor,
        a3: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [d1, d2, d3] = self.0.bwd([a1, a2, a3], res, grad)?;
        Ok((d1, d2, d3))
    }
}
