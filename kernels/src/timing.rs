//! Device time per kind of fused op, when asked (off by default, so a
//! normal step records nothing): on candle's CUDA device a pair of events
//! around each op's launches on candle's stream, resolved when the times
//! are taken; on the CPU the op's wall time (the CPU ops run in the call).
//!
//! Per thread, because each rank drives its model from its own thread
//! (simulated ranks are threads of one process): [`take`] returns what this
//! thread's ops recorded since the last call.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use candle_core::{Device, Result};

/// A kind of fused op, forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// [`rms_norm`](mod@crate::rms_norm).
    RmsNorm,
    /// Its backward (`dx` and `dw`).
    RmsNormBackward,
    /// [`rope`](mod@crate::rope).
    Rope,
    /// Its backward.
    RopeBackward,
    /// [`swiglu`](mod@crate::swiglu).
    Swiglu,
    /// Its backward.
    SwigluBackward,
    /// [`attention`](mod@crate::attention).
    Attention,
    /// Its backward.
    AttentionBackward,
    /// [`cross_entropy`](mod@crate::cross_entropy).
    CrossEntropy,
    /// Its backward.
    CrossEntropyBackward,
}

impl OpKind {
    /// Every kind, forward then backward per op.
    pub const ALL: [OpKind; 10] = [
        OpKind::RmsNorm,
        OpKind::RmsNormBackward,
        OpKind::Rope,
        OpKind::RopeBackward,
        OpKind::Swiglu,
        OpKind::SwigluBackward,
        OpKind::Attention,
        OpKind::AttentionBackward,
        OpKind::CrossEntropy,
        OpKind::CrossEntropyBackward,
    ];

    /// The kind's name in reports (`summary.json`).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::RmsNorm => "rms_norm",
            OpKind::RmsNormBackward => "rms_norm_backward",
            OpKind::Rope => "rope",
            OpKind::RopeBackward => "rope_backward",
            OpKind::Swiglu => "swiglu",
            OpKind::SwigluBackward => "swiglu_backward",
            OpKind::Attention => "attention",
            OpKind::AttentionBackward => "attention_backward",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::CrossEntropyBackward => "cross_entropy_backward",
        }
    }
}

/// Device time of one kind over some calls.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTime {
    /// Calls recorded.
    pub calls: usize,
    /// Their device time summed.
    pub time: Duration,
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns the recording on or off for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether ops are being timed.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

enum Pending {
    Done(OpKind, Duration),
    #[cfg(feature = "cuda")]
    Events(
        OpKind,
        candle_core::cuda_backend::cudarc::driver::CudaEvent,
        candle_core::cuda_backend::cudarc::driver::CudaEvent,
    ),
}

thread_local! {
    static PENDING: RefCell<Vec<Pending>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` (one op's launches on `device`), recording its time as `kind` when timing is on.
pub(crate) fn timed<R>(kind: OpKind, device: &Device, f: impl FnOnce() -> Result<R>) -> Result<R> {
    if !enabled() {
        return f();
    }
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            let stream = dev.cuda_stream();
            // Timing events: cudarc's default (`None`) disables timing, and
            // cuEventElapsedTime then fails with CUDA_ERROR_INVALID_HANDLE
            // (seen on the H200, 2026-11-27).
            let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(timing).map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
            let out = f()?;
            let end = stream.record_event(timing).map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
            PENDING.with(|p| p.borrow_mut().push(Pending::Events(kind, start, end)));
            Ok(out)
        }
        _ => {
            let t0 = Instant::now();
            let out = f()?;
            let spent = t0.elapsed();
            PENDING.with(|p| p.borrow_mut().push(Pending::Done(kind, spent)));
            Ok(out)
        }
    }
}

/// This thread's recorded time per kind since the last call, in
/// [`OpKind::ALL`]'s order (kinds never run included, at zero). On CUDA it
/// waits for the last recorded event (once), so call it after the step.
pub fn take() -> Result<Vec<(OpKind, OpTime)>> {
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let mut out: Vec<(OpKind, OpTime)> = OpKind::ALL.iter().map(|k| (*k, OpTime::default())).collect();
    for p in pending {
        let (kind, spent) = match p {
            Pending::Done(kind, spent) => (kind, spent),
            #[cfg(feature = "cuda")]
            Pending::Events(kind, start, end) => {
                end.synchronize().map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
                let ms = start.elapsed_ms(&end).map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
                (kind, Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
        };
        if let Some((_, t)) = out.iter_mut().find(|(k, _)| *k == kind) {
            t.calls += 1;
            t.time += spent;
        }
    }
    Ok(out)
}
