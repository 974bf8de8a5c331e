//! A raw UCX tag round trip between world ranks 0 and 1: the floor the
//! backend's own cost is measured against (`chorus bench --backend ucx
//! --raw-ucx`).
//!
//! Each rank makes a UCP worker of its own (beside the job's), publishes
//! its address in the store, and connects; rank 0 sends `bytes` to rank 1,
//! which sends them back, each progressing the worker on the calling thread
//! without a pause (no progress thread, no hand-off, no sleep): the least a
//! message exchange over UCX can cost between these processes.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ucx_rs::sys;

use super::result::{error, status_ptr};
use super::worker::{EventHandler, Worker};
use crate::bootstrap::{Store, StoreBarrier};
use crate::{CommError, Result};

/// The tag of the round trip's messages (its own worker: nothing else to match).
const TAG: u64 = 0x5241_5700;

/// Rank 0's time of each of `iters` round trips of `bytes` with rank 1, after
/// `warmup` untimed ones; `None` on every other rank. Every rank of the job
/// calls it with the same arguments (`prefix` unique per call in `store`);
/// ranks from 2 on only publish their address and wait for the end.
#[allow(clippy::too_many_arguments)]
pub fn raw_round_trips(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    bytes: usize,
    warmup: usize,
    iters: usize,
    timeout: Duration,
) -> Result<Option<Vec<Duration>>> {
    if size < 2 || rank >= size {
        return Err(CommError::invalid("ucx raw round trip", format!("rank {rank} of {size}: needs two ranks")));
    }
    // Made before the worker, so dropped after it (a failed run's requests
    // may name it until the worker is destroyed).
    let mut buf = vec![0u8; bytes.max(1)];
    let mut w = Worker::new()?;
    store.set(&format!("{prefix}/addr/{rank}"), &w.address()?)?;
    let peer = match rank {
        0 => Some(1),
        1 => Some(0),
        _ => None,
    };
    let mut times = None;
    if let Some(peer) = peer {
        let addr = store.get(&format!("{prefix}/addr/{peer}"), timeout)?;
        let mut addresses = vec![None; peer + 1];
        addresses[peer] = Some(addr);
        let ignore: EventHandler = Arc::new(|_| {});
        w.connect(&addresses, false, &ignore)?;
        let mut t = Vec::with_capacity(iters);
        for i in 0..warmup + iters {
            let start = Instant::now();
            if rank == 0 {
                let recv = post_recv(&mut w, &mut buf[..bytes])?;
                let send = post_send(&mut w, peer, &buf[..bytes])?;
                finish(&mut w, send, timeout)?;
                finish(&mut w, recv, timeout)?;
            } else {
                let recv = post_recv(&mut w, &mut buf[..bytes])?;
                finish(&mut w, recv, timeout)?;
                let send = post_send(&mut w, peer, &buf[..bytes])?;
                finish(&mut w, send, timeout)?;
            }
            if i >= warmup {
                t.push(start.elapsed());
            }
        }
        times = (rank == 0).then_some(t);
    }
    // No worker goes before the other has everything it waits for.
    StoreBarrier::new(format!("{prefix}/done"), size)?.arrive_and_wait(store, timeout)?;
    Ok(times)
}

/// A request to wait for, or `None` when the call completed in place.
type Pending = Option<sys::ucs_status_ptr_t>;

fn no_callback() -> sys::ucp_request_param_t {
    // SAFETY: a zeroed parameter struct is a valid "no field set" value
    // (no callback: the request is polled).
    unsafe { MaybeUninit::zeroed().assume_init() }
}

fn post_send(w: &mut Worker, peer: usize, data: &[u8]) -> Result<Pending> {
    let (_, ep) = w.raw(peer);
    let ep = ep.ok_or_else(|| CommError::invalid("ucx raw round trip", format!("no endpoint to rank {peer}")))?;
    let p = no_callback();
    // SAFETY: `data` outlives the request: `finish` waits for it before the
    // caller touches the buffer again.
    let r = unsafe { sys::ucp_tag_send_nbx(ep, data.as_ptr() as *const c_void, data.len(), TAG, &p) };
    status_ptr(r).map_err(|st| error(st, "ucp_tag_send_nbx"))
}

fn post_recv(w: &mut Worker, data: &mut [u8]) -> Result<Pending> {
    let (worker, _) = w.raw(0);
    let p = no_callback();
    // SAFETY: as in `post_send`.
    let r = unsafe { sys::ucp_tag_recv_nbx(worker, data.as_mut_ptr() as *mut c_void, data.len(), TAG, u64::MAX, &p) };
    status_ptr(r).map_err(|st| error(st, "ucp_tag_recv_nbx"))
}

/// Progresses the worker until `req` ends (at most `timeout`), and frees it.
fn finish(w: &mut Worker, req: Pending, timeout: Duration) -> Result<()> {
    let Some(req) = req else { return Ok(()) };
    let deadline = Instant::now() + timeout;
    loop {
        // SAFETY: a live request of this worker, freed once below.
        let st = unsafe { sys::ucp_request_check_status(req) };
        if st != sys::ucs_status_t_UCS_INPROGRESS {
            // SAFETY: ended; released once.
            unsafe { sys::ucp_request_free(req) };
            return if st == sys::ucs_status_t_UCS_OK { Ok(()) } else { Err(error(st, "ucx raw round trip")) };
        }
        if Instant::now() >= deadline {
            let (worker, _) = w.raw(0);
            // SAFETY: a live request: cancelled, then freed (UCX releases it when it ends).
            unsafe {
                sys::ucp_request_cancel(worker, req);
                sys::ucp_request_free(req);
            }
            return Err(CommError::Timeout {
                op: "ucx raw round trip".into(),
                seq: 0,
                waited: timeout,
                missing: vec![],
            });
        }
        w.progress();
    }
}
