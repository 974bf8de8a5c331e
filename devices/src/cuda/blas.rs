//! `matmul` through cuBLAS: one handle per stream, `cublasGemmEx` with f32
//! compute for f32/f16/bf16 (f64 for f64), row-major by swapping operands.

use std::ffi::c_void;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType, cudaStream_t,
};
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::result as res;
use crate::{DType, DeviceError, MatmulSpec};

/// A cuBLAS handle bound to one stream.
#[derive(Debug)]
pub(crate) struct BlasHandle(cublasHandle_t);

// SAFETY: the handle is used only under its stream's lock.
unsafe impl Send for BlasHandle {}

impl BlasHandle {
    /// Creates a handle on `stream` (the device's context must be current).
    pub(crate) fn create(stream: CUstream) -> Result<BlasHandle, DeviceError> {
        super::loader::cublas_library()?;
        super::loader::guarded("libcublas", || {
            let handle = blas::create_handle().map_err(|e| res::cublas("cublasCreate", e))?;
            // SAFETY: a fresh handle and a live stream of the current context.
            if let Err(e) = unsafe { blas::set_stream(handle, stream as cudaStream_t) } {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { blas::destroy_handle(handle) };
                return Err(res::cublas("cublasSetStream", e));
            }
            Ok(BlasHandle(handle))
        })
    }

    /// Destroys the handle (the context must be current).
    pub(crate) fn destroy(self) -> Result<(), DeviceError> {
        // SAFETY: destroyed once; `self` is consumed.
        unsafe { blas::destroy_handle(self.0) }.map_err(|e| res::cublas("cublasDestroy", e))
    }

    /// `C (+)= op(A) op(B)`, row-major, per `spec`; `ad` is A's and B's
    /// dtype, `cd` C's (equal to `ad`, or f32 for f16/bf16/f32 inputs).
    ///
    /// Row-major `C = op(A) op(B)` is column-major `Cᵀ = op(B)ᵀ op(A)ᵀ`, and a
    /// row-major matrix read column-major is its transpose: so B goes first,
    /// each operand's transpose flag stays as given, and the leading
    /// dimensions are the stored row lengths.
    ///
    /// # Safety
    /// The pointers must be valid for the extents of `spec` in this handle's
    /// stream order; m, n and k must be non-zero.
    pub(crate) unsafe fn gemm(
        &self,
        spec: MatmulSpec,
        ad: DType,
        cd: DType,
        a: CUdeviceptr,
        b: CUdeviceptr,
        c: CUdeviceptr,
    ) -> Result<(), DeviceError> {
        let MatmulSpec { m, n, k, trans_a, trans_b, accumulate } = spec;
        let int = |v: usize| i32::try_from(v).map_err(|_| DeviceError::invalid("matmul", "dimension exceeds i32"));
        let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let ldb = if trans_b { ki } else { ni };
        let lda = if trans_a { mi } else { ki };
        let ty = |d: DType| match d {
            DType::F32 => Ok(cudaDataType::CUDA_R_32F),
            DType::F64 => Ok(cudaDataType::CUDA_R_64F),
            DType::F16 => Ok(cudaDataType::CUDA_R_16F),
            DType::BF16 => Ok(cudaDataType::CUDA_R_16BF),
            other => Err(DeviceError::invalid("matmul", format!("cuBLAS has no {other} gemm"))),
        };
        let (alpha32, beta32) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (alpha64, beta64) = (1.0f64, if accumulate { 1.0f64 } else { 0.0 });
        let (compute, alpha, beta) = if ad == DType::F64 {
            (
                cublasComputeType_t::CUBLAS_COMPUTE_64F,
                &alpha64 as *const f64 as *const c_void,
                &beta64 as *const f64 as *const c_void,
            )
        } else {
            (
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                &alpha32 as *const f32 as *const c_void,
                &beta32 as *const f32 as *const c_void,
            )
        };
        // SAFETY: per the caller's contract; alpha and beta are host scalars
        // of the compute type (the handle's default pointer mode is host).
        unsafe {
            blas::gemm_ex(
                self.0,
                op(trans_b),
                op(trans_a),
                ni,
                mi,
                ki,
                alpha,
                b as *const c_void,
                ty(ad)?,
                ldb,
                a as *const c_void,
                ty(ad)?,
                lda,
                beta,
                c as *mut c_void,
                ty(cd)?,
                ni,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| res::cublas("cublasGemmEx", e))
    }
}
