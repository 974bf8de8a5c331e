//! A communicator's handle and what every user of it shares: its settings
//! ([`VendorConfig`]), the lock every call on the handle takes, the abort
//! that releases it, the polling of a call in progress, the list of the
//! launches the watchdog follows (followed in `launches.rs`), and the drop
//! that finalizes it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chorus_devices::wait::Backoff;
use chorus_devices::{Backend, Device, DeviceError, FailureHandle, ForeignBackend};

use super::abi::{Status, Version};
use super::result::Lib;
use super::sys::ncclComm_t;
use super::watchdog;
use super::VendorLib;
use crate::{CommError, Result};

/// Settings of an NCCL-family communicator.
#[derive(Clone, Debug)]
pub struct VendorConfig {
    /// Deadline of initialization, of a split, of reading the unique id from
    /// the store, and of each launch once its stream reaches it (the
    /// watchdog's). A peer that has not arrived by then is treated as dead:
    /// the communicator is aborted and the waiting rank gets `Timeout`.
    pub timeout: Duration,
    /// The store key rank 0 publishes the unique id under. The default is
    /// scoped by the job's run id and restart (`chorus/nccl/{run}/{restart}/unique_id`,
    /// [`process_key_scope`](crate::bootstrap::process_key_scope)), so a
    /// restarted job never reads the id an earlier attempt left in the store.
    pub store_key: String,
    /// Use the library's blocking mode: calls block inside the library until
    /// peers arrive, so no deadline applies to them and an abort waits for
    /// the call in progress. Off by default: non-blocking calls return
    /// `ncclInProgress` and are polled with the deadline.
    pub blocking: bool,
}

impl Default for VendorConfig {
    fn default() -> Self {
        VendorConfig {
            timeout: Duration::from_secs(300),
            store_key: format!("chorus/nccl/{}/unique_id", crate::bootstrap::process_key_scope()),
            blocking: false,
        }
    }
}

/// A launch the watchdog follows until its end event completes.
pub(super) struct Pending<B: Backend> {
    pub(super) start: B::Event,
    pub(super) end: B::Event,
    /// When the stream reached the launch (the start event completed).
    pub(super) reached: Option<Instant>,
    pub(super) failure: FailureHandle,
    pub(super) position: u64,
    pub(super) op: &'static str,
    pub(super) seq: u64,
}

pub(super) struct PendingList<B: Backend> {
    pub(super) launches: Vec<Pending<B>>,
    /// Whether the watchdog is following this communicator.
    pub(super) watched: bool,
}

/// The raw handle, used only under its lock.
pub(super) struct Handle {
    pub(super) raw: usize,
    /// Aborted or destroyed: the handle must never be passed to the library again.
    pub(super) released: bool,
}

/// The handle and the state every user of it shares (the communicator, its
/// launches' watchdog entry).
pub(super) struct Shared<L: VendorLib> {
    pub(super) lib: Lib,
    /// Every call on the handle is made holding this lock: the library forbids
    /// concurrent use of one communicator, and it orders calls with abort.
    pub(super) handle: Mutex<Handle>,
    /// Raised by abort before it takes the lock, so a thread that holds the
    /// lock while it polls an in-progress call gives way within one poll.
    pub(super) abort_requested: AtomicBool,
    /// The first asynchronous error or abort reason.
    pub(super) error: Mutex<Option<CommError>>,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) device: <L::B as Backend>::Device,
    pub(super) config: VendorConfig,
    pub(super) version: Version,
    pub(super) pending: Mutex<PendingList<L::B>>,
    /// Recorded events no launch uses any more.
    pub(super) spare_events: Mutex<Vec<<L::B as Backend>::Event>>,
}

pub(super) fn op_failed(op: &'static str, stream: &str, error: CommError) -> DeviceError {
    match error {
        CommError::Device(d) => d,
        other => DeviceError::OpFailed { op, stream: stream.to_string(), source: Arc::new(other) },
    }
}

impl<L: VendorLib> Shared<L> {
    pub(super) fn error(&self) -> Option<CommError> {
        self.error.lock().ok().and_then(|e| e.clone())
    }

    pub(super) fn aborted(&self) -> CommError {
        self.error().unwrap_or_else(|| CommError::Aborted { reason: "the communicator was aborted".into() })
    }

    /// The handle, locked, for a call; `Aborted` once released or while an
    /// abort is waiting for the lock.
    pub(super) fn lock(&self) -> Result<MutexGuard<'_, Handle>> {
        crate::host_fn_check(L::NAME)?;
        let guard = self.handle.lock().map_err(|_| CommError::invalid("communicator", "lock poisoned by a panic"))?;
        if guard.released || self.abort_requested.load(Ordering::Acquire) {
            return Err(self.aborted());
        }
        L::B::bind(&self.device).map_err(CommError::Device)?;
        Ok(guard)
    }

    /// Polls the communicator until its in-progress call has finished. The
    /// caller holds the lock; an abort request ends the wait at once, the
    /// deadline with `Timeout`.
    pub(super) fn wait_ready(&self, comm: ncclComm_t, op: &str, seq: u64) -> Result<()> {
        let backoff = Backoff::new();
        loop {
            if self.abort_requested.load(Ordering::Acquire) {
                return Err(self.aborted());
            }
            // SAFETY: the caller holds the lock on the live handle.
            match unsafe { self.lib.async_error(comm) }? {
                Status::Done => return Ok(()),
                Status::InProgress if backoff.expired(self.config.timeout) => {
                    return Err(CommError::Timeout {
                        op: op.to_string(),
                        seq,
                        waited: self.config.timeout,
                        missing: Vec::new(),
                    })
                }
                Status::InProgress => backoff.pause(),
            }
        }
    }

    /// Aborts with `reason` (the first reason wins): fails the stream of
    /// every launch still pending ([`Shared::begin_abort`]), then releases
    /// the handle ([`Shared::release_aborted`]). Waits for the handle's lock,
    /// but never behind a call in progress on a non-blocking communicator:
    /// such a call polls, sees the request and gives the lock up. The
    /// watchdog, which must not wait at all, releases on another thread.
    pub(super) fn abort_with(&self, reason: CommError) {
        self.begin_abort(reason);
        self.release_aborted();
    }

    /// The part of an abort that never blocks: records `reason` (the first
    /// wins), raises the request every holder of the lock polls, and fails
    /// the stream of every launch still pending, so every host wait on them
    /// ends with the reason. The locks it takes are held by others only for
    /// a push or a take, never across a call into the library.
    pub(super) fn begin_abort(&self, reason: CommError) {
        if let Ok(mut e) = self.error.lock() {
            e.get_or_insert(reason);
        }
        self.abort_requested.store(true, Ordering::Release);
        // The pending launches' streams fail first, with the reason: the
        // kernels the abort releases must not report a failure of their own first.
        let error = self.aborted();
        let launches = self.pending.lock().map(|mut p| std::mem::take(&mut p.launches)).unwrap_or_default();
        for p in launches {
            p.failure.fail(p.position, op_failed(p.op, p.failure.stream_name(), error.clone()));
        }
    }

    /// Releases the handle of an aborted communicator (`ncclCommAbort`,
    /// which makes its queued kernels return), once. Waits for the lock, and
    /// for the library: NCCL's abort joins its own threads.
    pub(super) fn release_aborted(&self) {
        if let Ok(mut h) = self.handle.lock() {
            if !h.released {
                h.released = true;
                let aborted = L::B::bind(&self.device)
                    .map_err(CommError::Device)
                    // SAFETY: the live handle, under its lock, released exactly once here.
                    .and_then(|_| unsafe { self.lib.abort(h.raw as ncclComm_t) });
                if let Err(e) = aborted {
                    L::B::park(&self.device, op_failed("ncclCommAbort", &self.device.name(), e));
                }
            }
        }
    }

    /// After a call gave way to an abort request: waits until the abort has
    /// released the handle — which ends the library's work for the call (its
    /// thread may still be enqueueing on the caller's stream) — so the caller
    /// returns only once nothing of the call can still touch its stream.
    pub(super) fn await_abort(&self) {
        let backoff = Backoff::new();
        while !backoff.expired(self.config.timeout) {
            match self.handle.lock() {
                Ok(h) if !h.released => {}
                _ => return,
            }
            backoff.pause();
        }
    }

    pub(super) fn take_event(&self) -> Result<<L::B as Backend>::Event> {
        if let Some(e) = self.spare_events.lock().ok().and_then(|mut s| s.pop()) {
            return Ok(e);
        }
        self.device.create_event().map_err(CommError::Device)
    }

    pub(super) fn give_events(&self, events: impl IntoIterator<Item = <L::B as Backend>::Event>) {
        if let Ok(mut s) = self.spare_events.lock() {
            s.extend(events);
        }
    }
}

impl<L: VendorLib> Drop for Shared<L> {
    fn drop(&mut self) {
        let Ok(h) = self.handle.get_mut() else { return };
        if h.released {
            return;
        }
        h.released = true;
        let (lib, raw, device) = (self.lib, h.raw, self.device.clone());
        let deadline = self.config.timeout.min(Duration::from_secs(60));
        // The teardown runs on a thread of its own and the drop waits for it
        // with a deadline: destroy blocks in the library (it joins its threads
        // and frees device memory, which waits for the whole device), and
        // device work that never ends would hang the dropping thread for
        // good. The watchdog does not wait at all: it can hold the last
        // reference while it polls, and every other communicator would go
        // unwatched meanwhile.
        let (done, finished) = std::sync::mpsc::channel();
        let teardown = std::thread::Builder::new().name("chorus-comm-teardown".into()).spawn(move || {
            release::<L>(lib, raw, &device, deadline);
            let _ = done.send(());
        });
        if teardown.is_err() {
            release::<L>(self.lib, raw, &self.device, deadline);
            return;
        }
        if watchdog::on_watchdog_thread() {
            return;
        }
        let waited = deadline * 2;
        let error = match finished.recv_timeout(waited) {
            Ok(()) => return,
            Err(RecvTimeoutError::Timeout) => {
                CommError::Timeout { op: "ncclCommDestroy".into(), seq: 0, waited, missing: Vec::new() }
            }
            Err(RecvTimeoutError::Disconnected) => CommError::Backend {
                library: L::NAME,
                code: -1,
                message: "the communicator's teardown thread panicked".into(),
            },
        };
        L::B::park(&self.device, op_failed("ncclCommDestroy", &self.device.name(), error));
    }
}

/// Finalizes and destroys a handle nobody holds any more (aborts it if
/// finalizing fails or outlasts `deadline`); errors are parked on the device.
fn release<L: VendorLib>(lib: Lib, raw: usize, device: &<L::B as Backend>::Device, deadline: Duration) {
    let comm = raw as ncclComm_t;
    if L::B::bind(device).is_err() {
        return;
    }
    // Finalize flushes queued work and tears connections down collectively;
    // if that fails or takes past the deadline, abort instead.
    // SAFETY: the live handle; nobody else holds this communicator any more.
    let finalized = unsafe { lib.finalize(comm) }.and_then(|s| match s {
        Status::Done => Ok(()),
        Status::InProgress => {
            let backoff = Backoff::new();
            loop {
                // SAFETY: as above.
                match unsafe { lib.async_error(comm) } {
                    Ok(Status::Done) => break Ok(()),
                    Ok(Status::InProgress) if !backoff.expired(deadline) => backoff.pause(),
                    Ok(Status::InProgress) => {
                        break Err(CommError::Timeout {
                            op: "ncclCommFinalize".into(),
                            seq: 0,
                            waited: deadline,
                            missing: Vec::new(),
                        })
                    }
                    Err(e) => break Err(e),
                }
            }
        }
    });
    let result = match finalized {
        // SAFETY: finalized; destroyed once.
        Ok(()) => unsafe { lib.destroy(comm) },
        Err(e) => {
            // SAFETY: released once (abort frees the handle).
            let _ = unsafe { lib.abort(comm) };
            Err(e)
        }
    };
    if let Err(e) = result {
        L::B::park(device, op_failed("ncclCommFinalize", &device.name(), e));
    }
}
