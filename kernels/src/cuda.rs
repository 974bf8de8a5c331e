//! The ops on candle's CUDA device: the PTX `build.rs` made of
//! `cuda/chorus_kernels.cu`, loaded once per device (candle's custom-module
//! cache), and each op's launches on candle's stream, in stream order after
//! whatever wrote the inputs. Outputs and temporaries are candle
//! allocations on that stream (stream-ordered frees), so nothing here waits
//! on the host.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{bail, DType, Layout, Result, Storage, Tensor};

use crate::attention::AttentionShape;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/chorus_kernels.ptx"));
const MODULE: &str = "chorus_kernels";

/// The kernels' name suffix for a dtype.
fn suffix(op: &str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => bail!("{op}: no CUDA kernel for {other:?}"),
    }
}

/// The device address of the first element `layout` selects (contiguous),
/// with the guard that records the read on candle's stream once dropped
/// (after the launch).
fn read_ptr<'a>(
    op: &str,
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Some((start, _)) = l.contiguous_offsets() else { bail!("{op}: an input is not contiguous") };
    macro_rules! at {
        ($slice:expr, $t:ty) => {{
            let (p, guard) = $slice.device_ptr(stream);
            (p + (start * std::mem::size_of::<$t>()) as u64, guard)
        }};
    }
    Ok(match &s.slice {
        CudaStorageSlice::F32(x) => at!(x, f32),
        CudaStorageSlice::BF16(x) => at!(x, half::bf16),
        CudaStorageSlice::F16(x) => at!(x, half::f16),
        CudaStorageSlice::U32(x) => at!(x, u32),
        _ => bail!("{op}: an input of dtype {:?}", s.dtype()),
    })
}

/// Like [`read_ptr`] for a whole output storage being written.
fn write_ptr<'a>(
    s: &'a mut CudaStorage,
    stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let dtype = s.dtype();
    Ok(match &mut s.slice {
        CudaStorageSlice::F32(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::BF16(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::F16(x) => x.device_ptr_mut(stream),
        _ => bail!("an output of dtype {dtype:?}"),
    })
}

/// An uninitialised storage of `n` elements of `dtype` on `dev`.
///
/// # Safety
/// Every element must be written (by the kernels launched next, in stream
/// order) before anything reads it.
unsafe fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    // SAFETY: the caller writes every element before it is read.
    Ok(match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(n)? }, dev.clone()),
        DType::BF16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(n)? }, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(n)? }, dev.clone()),
        other => bail!("no CUDA output of {other:?}"),
    })
}

/// Launches kernel `$name` of the module on `$dev`'s stream with `$cfg` and the
/// arguments (locals that outlive the launch), in the kernel's order.
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let func = $dev.get_or_load_custom_func(&$name, MODULE, PTX)?;
        let mut builder = func.builder();
        $( builder.arg(&$arg); )+
        // SAFETY: the arguments are the kernel's parameters in number, order
        // and type (cuda/*.cuh: device pointers as u64, `int` as i32, `float`
        // as f32, `u64`); every pointer addresses a live allocation holding
        // the elements the kernel indexes for these sizes (the op checked the
        // shapes); the launch is on candle's stream, after the inputs' writers.
        unsafe { builder.launch($cfg) }.w()?;
    }};
}

/// One block of `threads` per row.
fn per_row(op: &str, rows: usize, threads: u32) -> Result<LaunchConfig> {
    if rows == 0 || rows > i32::MAX as usize {
        bail!("{op}: {rows} rows (1 to {} on CUDA)", i32::MAX)
    }
    Ok(LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

/// A grid-stride launch over `n` items.
fn grid_stride(n: u64, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as u64).clamp(1, 65_535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// One warp per item, four warps a block.
fn per_warp(op: &str, items: u64) -> Result<LaunchConfig> {
    let blocks = items.div_ceil(4);
    if blocks == 0 || blocks > i32::MAX as u64 {
        bail!("{op}: {items} rows")
    }
    Ok(LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 })
}

fn int(op: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::msg(format!("{op}: {what} {v} is too large for the kernel")))
}

/// `(rows, d)` of a tensor whose last dim is `d`.
fn rows_of(l: &Layout) -> (usize, usize) {
    let d = l.shape().dims().last().copied().unwrap_or(1).max(1);
    (l.shape().elem_count() / d, d)
}

pub(crate) fn rms_norm_forward(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    const OP: &str = "rms_norm";
    let dev = x.device();
    let stream = dev.cuda_stream();
    let (rows, d) = rows_of(lx);
    let cfg = per_row(OP, rows, 256)?;
    // SAFETY: the kernel writes every element of every row.
    let mut y = unsafe { alloc(dev, x.dtype(), rows * d)? };
    {
        let (px, _gx) = read_ptr(OP, x, lx, &stream)?;
        let (pw, _gw) = read_ptr(OP, w, lw, &stream)?;
        let (py, _gy) = write_ptr(&mut y, &stream)?;
        let di = int(OP, "d", d)?;
        launch!(dev, format!("chorus_rms_norm_forward_{}", suffix(OP, x.dtype())?), cfg, px, pw, py, di, eps);
    }
    Ok(y)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward_x(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    const OP: &str = "rms_norm backward";
    let dev = x.device();
    let stream = dev.cuda_stream();
    let (rows, d) = rows_of(lx);
    let cfg = per_row(OP, rows, 256)?;
    // SAFETY: the kernel writes every element of every row.
    let mut dx = unsafe { alloc(dev, x.dtype(), rows * d)? };
    {
        let (px, _gx) = read_ptr(OP, x, lx, &stream)?;
        let (pw, _gw) = read_ptr(OP, w, lw, &stream)?;
        let (pdy, _gdy) = read_ptr(OP, dy, ldy, &stream)?;
        let (pdx, _gdx) = write_ptr(&mut dx, &stream)?;
        let di = int(OP, "d", d)?;
        launch!(dev, format!("chorus_rms_norm_backward_x_{}", suffix(OP, x.dtype())?), cfg, px, pw, pdy, pdx, di, eps);
    }
    Ok(dx)
}

pub(crate) fn rms_norm_backward_w(
    x: &CudaStorage,
    lx: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    const OP: &str = "rms_norm weight backward";
    let dev = x.device();
    let stream = dev.cuda_stream();
    let sfx = suffix(OP, x.dtype())?;
    let (rows, d) = rows_of(lx);
    let parts = rows.min(256);
    let (di, rows_i, parts_i) = (int(OP, "d", d)?, int(OP, "rows", rows)?, int(OP, "parts", parts)?);
    // SAFETY: the rstd kernel writes every row's value, the partial kernel every (part, column), the sum every column.
    let mut rstd = unsafe { alloc(dev, DType::F32, rows)? };
    let mut partial = unsafe { alloc(dev, DType::F32, parts * d)? };
    let mut dw = unsafe { alloc(dev, x.dtype(), d)? };
    {
        let (px, _gx) = read_ptr(OP, x, lx, &stream)?;
        let (pdy, _gdy) = read_ptr(OP, dy, ldy, &stream)?;
        let (pr, _gr) = write_ptr(&mut rstd, &stream)?;
        let (pp, _gp) = write_ptr(&mut partial, &stream)?;
        let (pdw, _gdw) = write_ptr(&mut dw, &stream)?;
        launch!(dev, format!("chorus_rms_norm_rstd_{sfx}"), per_row(OP, rows, 256)?, px, pr, di, eps);
        let cols = (d as u32).div_ceil(256);
        let cfg = LaunchConfig { grid_dim: (cols, parts as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        launch!(dev, format!("chorus_rms_norm_backward_w_partial_{sfx}"), cfg, px, pdy, pr, pp, rows_i, di);
        let cfg = LaunchConfig { grid_dim: (cols, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        launch!(dev, format!("chorus_rms_norm_backward_w_sum_{sfx}"), cfg, pp, pdw, parts_i, di);
    }
    Ok(dw)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rope(
    x: &CudaStorage,
    lx: &Layout,
    cos: &CudaStorage,
    lc: &Layout,
    sin: &CudaStorage,
    ls: &Layout,
    inverse: bool,
) -> Result<CudaStorage> {
    const OP: &str = "rope";
    let dev = x.device();
    let stream = dev.cuda_stream();
    let [_, t, h, d] = crate::host::dims::<4>(OP, "x", lx.shape())?;
    let n = lx.shape().elem_count();
    // SAFETY: every pair, so every element, is written.
    let mut y = unsafe { alloc(dev, x.dtype(), n)? };
    {
        let (px, _gx) = read_ptr(OP, x, lx, &stream)?;
        let (pc, _gc) = read_ptr(OP, cos, lc, &stream)?;
        let (ps, _gs) = read_ptr(OP, sin, ls, &stream)?;
        let (py, _gy) = write_ptr(&mut y, &stream)?;
        let pairs = (n / 2) as u64;
        let (ti, hi, dii) = (int(OP, "seq", t)?, int(OP, "heads", h)?, int(OP, "head_dim", d)?);
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        launch!(
            dev,
            format!("chorus_rope_{}", suffix(OP, x.dtype())?),
            grid_stride(pairs, 256),
            px,
            pc,
            ps,
            py,
            pairs,
            ti,
            hi,
            dii,
            sign
        );
    }
    Ok(y)
}

pub(crate) fn swiglu_forward(g: &CudaStorage, lg: &Layout, u: &CudaStorage, lu: &Layout) -> Result<CudaStorage> {
    const OP: &str = "swiglu";
    let dev = g.device();
    let stream = dev.cuda_stream();
    let n = lg.shape().elem_count();
    // SAFETY: every element is written.
    let mut y = unsafe { alloc(dev, g.dtype(), n)? };
    {
        let (pg, _gg) = read_ptr(OP, g, lg, &stream)?;
        let (pu, _gu) = read_ptr(OP, u, lu, &stream)?;
        let (py, _gy) = write_ptr(&mut y, &stream)?;
        let nn = n as u64;
        launch!(dev, format!("chorus_swiglu_forward_{}", suffix(OP, g.dtype())?), grid_stride(nn, 256), pg, pu, py, nn);
    }
    Ok(y)
}

pub(crate) fn swiglu_backward(
    g: &CudaStorage,
    lg: &Layout,
    u: &CudaStorage,
    lu: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "swiglu backward";
    let dev = g.device();
    let stream = dev.cuda_stream();
    let n = lg.shape().elem_count();
    // SAFETY: both halves, every element, are written.
    let mut out = unsafe { alloc(dev, g.dtype(), 2 * n)? };
    {
        let (pg, _gg) = read_ptr(OP, g, lg, &stream)?;
        let (pu, _gu) = read_ptr(OP, u, lu, &stream)?;
        let (pdy, _gdy) = read_ptr(OP, dy, ldy, &stream)?;
        let (po, _go) = write_ptr(&mut out, &stream)?;
        let nn = n as u64;
        launch!(
            dev,
            format!("chorus_swiglu_backward_{}", suffix(OP, g.dtype())?),
            grid_stride(nn, 256),
            pg,
            pu,
            pdy,
            po,
            nn
        );
    }
    Ok(out)
}

pub(crate) fn cross_entropy_forward(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "cross_entropy";
    let dev = x.device();
    let stream = dev.cuda_stream();
    let (rows, vocab) = rows_of(lx);
    let cfg = per_row(OP, rows, 256)?;
    // SAFETY: one block per row writes its loss and log-sum-exp.
    let mut loss = unsafe { alloc(dev, DType::F32, rows)? };
    let mut lse = unsafe { alloc(dev, DType::F32, rows)? };
    {
        let (px, _gx) = read_ptr(OP, x, lx, &stream)?;
        let (pt, _gt) = read_ptr(OP, t, lt, &stream)?;
        let (pl, _gl) = write_ptr(&mut loss, &stream)?;
        let (pe, _ge) = write_ptr(&mut lse, &stream)?;
        let v = int(OP, "vocab", vocab)?;
        launch!(dev, format!("chorus_cross_entropy_forward_{}", suffix(OP, x.dtype())?), cfg, px, pt, pl, pe, v);
    }
    Ok((loss, lse))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    lse: &Tensor,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy backward";
    let dev = x.device();
    let stream = dev.cuda_stream();
    let (rows, vocab) = rows_of(lx);
    let cfg = per_row(OP, rows, 256)?;
    let (lse_storage, lse_layout) = lse.storage_and_layout();
    let Storage::Cuda(lse_cuda) = &*lse_storage else { bail!("{OP}: the saved log-sum-exp is not on the GPU") };
    // SAFETY: one block per row writes the whole row.
    let mut dx = unsafe { alloc(dev, x.dtype(), rows * vocab)? };
    {
        let (px, _gx) = read_ptr(OP, x, lx, &stream)?;
        let (pt, _gt) = read_ptr(OP, t, lt, &stream)?;
        let (pg, _gg) = read_ptr(OP, g, lg, &stream)?;
        let (pe, _ge) = read_ptr(OP, lse_cuda, lse_layout, &stream)?;
        let (pd, _gd) = write_ptr(&mut dx, &stream)?;
        let v = int(OP, "vocab", vocab)?;
        launch!(dev, format!("chorus_cross_entropy_backward_{}", suffix(OP, x.dtype())?), cfg, px, pt, pg, pe, pd, v);
    }
    Ok(dx)
}

/// Whether the tensor-core kernels take this call (else the warp-per-row fallback).
fn tensor_cores(dtype: DType, head_dim: usize) -> bool {
    matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128)
}

/// The most head_dim the fallback kernels take (`ATT_SIMPLE_CHUNKS` lanes' worth).
const SIMPLE_MAX_HEAD_DIM: usize = 256;

struct AttentionInts {
    b: i32,
    t: i32,
    s: i32,
    h: i32,
    kvh: i32,
    d: i32,
}

fn attention_ints(op: &str, sh: AttentionShape) -> Result<AttentionInts> {
    if !tensor_cores(DType::BF16, sh.head_dim) && sh.head_dim > SIMPLE_MAX_HEAD_DIM {
        bail!("{op}: head_dim {} on CUDA is at most {SIMPLE_MAX_HEAD_DIM}", sh.head_dim)
    }
    if sh.batch > 65_535 || sh.heads > 65_535 {
        bail!("{op}: batch {} or heads {} above 65535", sh.batch, sh.heads)
    }
    Ok(AttentionInts {
        b: int(op, "batch", sh.batch)?,
        t: int(op, "q_len", sh.q_len)?,
        s: int(op, "kv_len", sh.kv_len)?,
        h: int(op, "heads", sh.heads)?,
        kvh: int(op, "kv_heads", sh.kv_heads)?,
        d: int(op, "head_dim", sh.head_dim)?,
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_forward(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    sh: AttentionShape,
    scale: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "attention";
    let dev = q.device();
    let stream = dev.cuda_stream();
    let n = attention_ints(OP, sh)?;
    let sfx = suffix(OP, q.dtype())?;
    // SAFETY: every query row's output and log-sum-exp are written.
    let mut o = unsafe { alloc(dev, q.dtype(), lq.shape().elem_count())? };
    let mut lse = unsafe { alloc(dev, DType::F32, sh.batch * sh.heads * sh.q_len)? };
    {
        let (pq, _gq) = read_ptr(OP, q, lq, &stream)?;
        let (pk, _gk) = read_ptr(OP, k, lk, &stream)?;
        let (pv, _gv) = read_ptr(OP, v, lv, &stream)?;
        let (po, _go) = write_ptr(&mut o, &stream)?;
        let (pl, _gl) = write_ptr(&mut lse, &stream)?;
        if tensor_cores(q.dtype(), sh.head_dim) {
            let tiles = sh.q_len.div_ceil(64) as u32;
            let cfg = LaunchConfig {
                grid_dim: (tiles, sh.heads as u32, sh.batch as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let scale_log2 = scale * std::f32::consts::LOG2_E;
            let name = format!("chorus_attention_forward_{sfx}_d{}", sh.head_dim);
            launch!(dev, name, cfg, pq, pk, pv, po, pl, n.t, n.s, n.h, n.kvh, scale_log2);
        } else {
            let cfg = per_warp(OP, (sh.batch * sh.q_len * sh.heads) as u64)?;
            let name = format!("chorus_attention_forward_simple_{sfx}");
            launch!(dev, name, cfg, pq, pk, pv, po, pl, n.b, n.t, n.s, n.h, n.kvh, n.d, scale);
        }
    }
    Ok((o, lse))
}

/// `[dq | dk | dv]` in `q`'s dtype from `dO` and the forward's `[q, k, v, o, lse]`.
pub(crate) fn attention_backward(
    d_o: &CudaStorage,
    ldo: &Layout,
    saved: &[Tensor; 5],
    sh: AttentionShape,
    scale: f32,
) -> Result<CudaStorage> {
    const OP: &str = "attention backward";
    let dev = d_o.device();
    let stream = dev.cuda_stream();
    let n = attention_ints(OP, sh)?;
    let dtype = d_o.dtype();
    let sfx = suffix(OP, dtype)?;
    let (nq, nkv) = (sh.batch * sh.q_len * sh.heads * sh.head_dim, sh.batch * sh.kv_len * sh.kv_heads * sh.head_dim);
    let guards: Vec<_> = saved.iter().map(|t| t.storage_and_layout()).collect();
    let mut cuda = Vec::with_capacity(5);
    for (storage, layout) in &guards {
        let Storage::Cuda(c) = &**storage else { bail!("{OP}: a saved tensor is not on the GPU") };
        cuda.push((c, *layout));
    }
    let es = dtype.size_in_bytes() as u64;
    // SAFETY: dq (every query row), dk and dv (every key row) are written: by the tensor-core
    // kernel and the dq conversion, or by the two fallback kernels.
    let mut all = unsafe { alloc(dev, dtype, nq + 2 * nkv)? };
    let mut dvec = unsafe { alloc(dev, DType::F32, sh.batch * sh.heads * sh.q_len)? };
    {
        let (pdo, _gdo) = read_ptr(OP, d_o, ldo, &stream)?;
        let (pq, _gq) = read_ptr(OP, cuda[0].0, cuda[0].1, &stream)?;
        let (pk, _gk) = read_ptr(OP, cuda[1].0, cuda[1].1, &stream)?;
        let (pv, _gv) = read_ptr(OP, cuda[2].0, cuda[2].1, &stream)?;
        let (po, _go) = read_ptr(OP, cuda[3].0, cuda[3].1, &stream)?;
        let (pl, _gl) = read_ptr(OP, cuda[4].0, cuda[4].1, &stream)?;
        let (pall, _gall) = write_ptr(&mut all, &stream)?;
        let (pdv, _gdv) = write_ptr(&mut dvec, &stream)?;
        let (pdq, pdk, pdvv) = (pall, pall + nq as u64 * es, pall + (nq + nkv) as u64 * es);
        let rows = per_warp(OP, (sh.batch * sh.q_len * sh.heads) as u64)?;
        launch!(dev, format!("chorus_attention_backward_dot_{sfx}"), rows, pdo, po, pdv, n.b, n.t, n.h, n.d);
        if tensor_cores(dtype, sh.head_dim) {
            let mut acc = dev.alloc_zeros::<f32>(nq)?;
            let (pacc, _gacc) = acc.device_ptr_mut(&stream);
            let warps: u32 = if sh.head_dim == 64 { 4 } else { 2 };
            let tiles = sh.kv_len.div_ceil(16 * warps as usize) as u32;
            let cfg = LaunchConfig {
                grid_dim: (tiles, sh.kv_heads as u32, sh.batch as u32),
                block_dim: (32 * warps, 1, 1),
                shared_mem_bytes: 0,
            };
            let name = format!("chorus_attention_backward_{sfx}_d{}", sh.head_dim);
            launch!(dev, name, cfg, pq, pk, pv, pdo, pl, pdv, pacc, pdk, pdvv, n.t, n.s, n.h, n.kvh, scale);
            let nq64 = nq as u64;
            launch!(dev, format!("chorus_attention_backward_dq_{sfx}"), grid_stride(nq64, 256), pacc, pdq, nq64);
        } else {
            let cfg = per_warp(OP, (sh.batch * sh.q_len * sh.heads) as u64)?;
            let name = format!("chorus_attention_backward_simple_dq_{sfx}");
            launch!(dev, name, cfg, pq, pk, pv, pdo, pl, pdv, pdq, n.b, n.t, n.s, n.h, n.kvh, n.d, scale);
            let cfg = per_warp(OP, (sh.batch * sh.kv_len * sh.kv_heads) as u64)?;
            let name = format!("chorus_attention_backward_simple_dkv_{sfx}");
            launch!(dev, name, cfg, pq, pk, pv, pdo, pl, pdv, pdk, pdvv, n.b, n.t, n.s, n.h, n.kvh, n.d, scale);
        }
    }
    Ok(all)
}
