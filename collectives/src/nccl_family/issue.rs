//! Issuing a translated launch: one `ncclGroupStart`/`ncclGroupEnd` on the
//! caller's stream, made under the communicator's lock, and the abort policy
//! when it fails.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use chorus_devices::{Backend, ForeignBackend, Stream};

use super::abi::{encode_scalar, Status};
use super::shared::{op_failed, Handle, Shared};
use super::sys::ncclComm_t;
use super::translate::LaunchPlan;
use super::VendorLib;
use crate::{CommError, Result};

/// Issues `plan`'s calls as one group on `stream` while the caller holds the
/// handle (`guard`), and destroys the pre-multiplied sums it created once
/// the group is enqueued. Returns the launch's position on the stream, or
/// `None` when the stream had failed before it (nothing was issued).
///
/// On a non-blocking communicator `ncclGroupEnd` may return `ncclInProgress`
/// while the library's own thread enqueues the kernels; this waits for that
/// (polling, abortable) so whatever the caller enqueues next runs after the
/// collective.
pub(super) fn issue_group<L: VendorLib>(
    shared: &Shared<L>,
    guard: &MutexGuard<'_, Handle>,
    plan: &LaunchPlan<'_, L::B>,
    stream: &<L::B as Backend>::Stream,
    op: &'static str,
    seq: u64,
) -> Result<Option<u64>> {
    let lib = shared.lib;
    let comm = guard.raw as ncclComm_t;
    let stream_name = stream.name();
    let mut created: Vec<c_int> = Vec::new();
    let mut error: Option<CommError> = None;
    let issued = L::B::enqueue_foreign(stream, op, &plan.accesses, &mut |raw| {
        let mut run = || -> Result<()> {
            lib.group_start()?;
            let mut enqueued = Ok(());
            for p in &plan.calls {
                let mut call = p.call;
                if let Some((s, dtype)) = p.premul {
                    let mut scalar = encode_scalar(dtype, s);
                    // SAFETY: the live handle under its lock.
                    match unsafe { lib.premul_sum(&mut scalar, dtype, comm) } {
                        Ok(op) => {
                            created.push(op);
                            call = call.with_op(op);
                        }
                        Err(e) => {
                            enqueued = Err(e);
                            break;
                        }
                    }
                }
                // SAFETY: the calls were validated by the Communicator and
                // their views checked to be of this device; the addresses are
                // valid for their counts in the stream's order (the accesses
                // keep the buffers alive); the handle is locked.
                enqueued = unsafe { lib.issue(call, comm, raw) };
                if enqueued.is_err() {
                    break;
                }
            }
            // The group is always closed, even after a failed call.
            let ended = lib.group_end(comm);
            enqueued?;
            if ended? == Status::InProgress {
                shared.wait_ready(comm, op, seq)?;
            }
            Ok(())
        };
        run().map_err(|e| {
            error = Some(e.clone());
            op_failed(op, &stream_name, e)
        })
    });
    // After an abort request the handle must not be used again (the abort
    // frees the operators with it).
    if !shared.abort_requested.load(Ordering::Acquire) {
        for created in created {
            // SAFETY: created on this handle in this launch, destroyed once, under the lock.
            if let Err(e) = unsafe { lib.destroy_op(created, comm) } {
                L::B::park(&shared.device, op_failed("ncclRedOpDestroy", &stream_name, e));
            }
        }
    }
    issued.map_err(|e| error.take().unwrap_or(CommError::Device(e)))
}

impl<L: VendorLib> Shared<L> {
    /// The abort policy after a launch failed to issue with `e` (the lock
    /// released): a call that gave way to an abort request returns once the
    /// abort has released the handle; a library failure or a deadline
    /// aborts, since the peers may be inside the collective; an invalid
    /// argument leaves the communicator usable.
    pub(super) fn after_failed_issue(&self, op: &'static str, seq: u64, e: &CommError) {
        if self.abort_requested.load(Ordering::Acquire) {
            self.await_abort();
        } else if matches!(e, CommError::Timeout { .. } | CommError::Backend { .. }) {
            self.abort_with(CommError::Aborted { reason: format!("{op} #{seq} failed: {e}") });
        }
    }

    /// The abort policy when the stream had failed before a launch: this
    /// rank will not take part, so the communicator is aborted rather than
    /// leave the peers waiting for it.
    pub(super) fn after_skipped_launch(&self, op: &'static str, seq: u64) {
        self.abort_with(CommError::Aborted {
            reason: format!("rank {}'s stream failed before {op} #{seq}", self.rank),
        });
    }
}
