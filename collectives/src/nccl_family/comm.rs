//! The communicator of the NCCL family, written once for NCCL, RCCL and the
//! simulated library: [`VendorComm`].

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

use chorus_devices::{Backend, Device, ForeignBackend, Stream};

use super::abi::{CommConfig, Status, UniqueId, Version};
use super::issue::issue_group;
use super::result::Lib;
use super::shared::{op_failed, Handle, PendingList, Shared, VendorConfig};
use super::sys::ncclComm_t;
use super::translate::{self, Target};
use super::VendorLib;
use crate::backend::{Call, Capabilities, CommBackend};
use crate::bootstrap::Store;
use crate::{CommError, Communicator, Result};

/// One rank's endpoint of an NCCL-family communicator: NCCL on a cuda device
/// ([`NcclComm`](crate::nccl::NcclComm)), RCCL on a hip device
/// ([`RcclComm`](crate::rccl::RcclComm)), or the simulated library on a cpu
/// device. See the [module documentation](super) for how the contract maps
/// onto the library.
pub struct VendorComm<L: VendorLib> {
    shared: Arc<Shared<L>>,
}

impl<L: VendorLib> std::fmt::Debug for VendorComm<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}Comm(rank {}/{} on {}, {} {})",
            L::NAME,
            self.shared.rank,
            self.shared.size,
            self.shared.device.name(),
            L::NAME,
            self.shared.version
        )
    }
}

/// A heap slot the library writes a communicator handle into. It must stay
/// valid until the library has written it, which for a non-blocking split
/// is after the call returned; a slot whose operation did not complete is
/// leaked rather than freed under the library.
struct Slot(Box<AtomicPtr<c_void>>);

impl Slot {
    fn new() -> Slot {
        Slot(Box::new(AtomicPtr::new(std::ptr::null_mut())))
    }
    fn ptr(&self) -> *mut ncclComm_t {
        // AtomicPtr<c_void> has the layout of *mut c_void.
        self.0.as_ptr() as *mut ncclComm_t
    }
    /// The handle, once the operation has completed.
    fn read(self) -> ncclComm_t {
        self.0.load(Ordering::Acquire)
    }
    /// The operation did not complete: the library may still write the slot.
    fn abandon(self) {
        Box::leak(self.0);
    }
}

impl<L: VendorLib> VendorComm<L> {
    /// The library's version (loads the library).
    pub fn library_version() -> Result<Version> {
        L::lib()?.version()
    }

    /// A new unique id (`ncclGetUniqueId`), for rank 0 to hand to the others.
    pub fn unique_id() -> Result<UniqueId> {
        L::lib()?.unique_id()
    }

    /// Bootstrap through `store`: rank 0 creates the unique id and publishes
    /// its 128 bytes under [`VendorConfig::store_key`]; the other ranks wait
    /// for them (up to the deadline); then every rank calls
    /// [`VendorComm::init_with_id`]. Every rank must call this; it returns
    /// when all have joined, or fails with `Timeout` (and aborts).
    pub fn init(
        store: &dyn Store,
        rank: usize,
        size: usize,
        device: <L::B as Backend>::Device,
        config: VendorConfig,
    ) -> Result<Communicator<Self>> {
        CommError::check_rank("init", rank, size)?;
        let id = if rank == 0 {
            let id = Self::unique_id()?;
            store.set(&config.store_key, id.as_bytes())?;
            id
        } else {
            UniqueId::from_slice(&store.get(&config.store_key, config.timeout)?)?
        };
        Self::init_with_id(&id, rank, size, device, config)
    }

    /// Rank `rank` of `size` joins the communicator identified by `id` on
    /// `device`. Returns when every rank has joined, or fails with `Timeout`
    /// after the deadline (non-blocking libraries; a library without
    /// `ncclCommInitRankConfig` blocks until all have joined).
    pub fn init_with_id(
        id: &UniqueId,
        rank: usize,
        size: usize,
        device: <L::B as Backend>::Device,
        config: VendorConfig,
    ) -> Result<Communicator<Self>> {
        CommError::check_rank("init", rank, size)?;
        crate::host_fn_check(L::NAME)?;
        let lib = L::lib()?;
        let version = lib.version()?;
        L::B::bind(&device).map_err(CommError::Device)?;
        let slot = Slot::new();
        let mut cfg = CommConfig::new(config.blocking);
        // SAFETY: the device is current on this thread; the slot outlives the
        // initialization (it is leaked below if that does not complete).
        let status = unsafe { lib.comm_init_rank(slot.ptr(), size, *id, rank, Some(&mut cfg)) }?;
        // NCCL writes the handle before it returns, even when the rest of the
        // initialization goes on in the background: it is what one polls.
        let raw = slot.0.load(Ordering::Acquire);
        if raw.is_null() {
            slot.abandon();
            return Err(CommError::Backend {
                library: L::NAME,
                code: -1,
                message: "ncclCommInitRankConfig returned no communicator".into(),
            });
        }
        let blocking = config.blocking;
        let shared = Self::shared(lib, raw, rank, size, device, config, version);
        // Non-blocking: the handle's async error says when the initialization
        // is complete, whatever the call returned.
        if status == Status::InProgress || !blocking {
            let ready = shared.lock().and_then(|_guard| shared.wait_ready(raw, "ncclCommInitRankConfig", 0));
            if let Err(e) = ready {
                shared.abort_with(CommError::Aborted { reason: format!("initialization failed: {e}") });
                drop(slot);
                return Err(e);
            }
        }
        drop(slot);
        Ok(Communicator::new(VendorComm { shared }))
    }

    fn shared(
        lib: Lib,
        raw: ncclComm_t,
        rank: usize,
        size: usize,
        device: <L::B as Backend>::Device,
        config: VendorConfig,
        version: Version,
    ) -> Arc<Shared<L>> {
        Arc::new(Shared {
            lib,
            handle: Mutex::new(Handle { raw: raw as usize, released: false }),
            abort_requested: AtomicBool::new(false),
            error: Mutex::new(None),
            rank,
            size,
            device,
            config,
            version,
            pending: Mutex::new(PendingList { launches: Vec::new(), watched: false }),
            spare_events: Mutex::new(Vec::new()),
        })
    }

    /// The library's version this communicator runs on.
    pub fn version(&self) -> Version {
        self.shared.version
    }

    /// Runs `f` with the raw `ncclComm_t`, under the communicator's lock and
    /// with the device bound, for calling the library directly (the benchmark
    /// compares chorus's per-call overhead with it). Fails with `Aborted`
    /// once the communicator has been aborted.
    ///
    /// # Safety
    /// `f` must not destroy, abort or keep the handle, must not leave a call
    /// in progress, and whatever it enqueues must follow the library's rules
    /// (every rank issues the same calls).
    pub unsafe fn with_raw<R>(&self, f: impl FnOnce(ncclComm_t, &Lib) -> R) -> Result<R> {
        let guard = self.shared.lock()?;
        Ok(f(guard.raw as ncclComm_t, &self.shared.lib))
    }

    /// Fails `stream` from its next position with `error` (a call on an
    /// aborted communicator, which must not hang and must not run).
    fn fail_stream(&self, stream: &<L::B as Backend>::Stream, op: &'static str, error: CommError) -> Result<()> {
        let wrapped = op_failed(op, &stream.name(), error);
        let handle = L::B::failure_handle(stream);
        if let Some(pos) = L::B::enqueue_foreign(stream, op, &[], &mut |_| Ok(())).map_err(CommError::Device)? {
            handle.fail(pos, wrapped);
        }
        Ok(())
    }
}

/// What a communicator of `lib` at `version` can do.
fn capabilities_of(lib: &Lib, v: Version) -> Capabilities {
    Capabilities {
        avg: v.at_least(2, 10),
        premul_sum: v.at_least(2, 11) && lib.api.ncclRedOpCreatePreMulSum.is_some(),
        ranks_share_device: false,
        world_abort: false,
        fault_injection: false,
        detects_mismatch: false,
        names_missing_ranks: false,
    }
}

impl<L: VendorLib> VendorComm<L> {
    /// What a communicator of this library would offer, from the library
    /// alone (no device needed): for listing and planning before a world exists.
    pub fn declared_capabilities() -> Result<Capabilities> {
        let lib = L::lib()?;
        Ok(capabilities_of(&lib, lib.version()?))
    }
}

impl<L: VendorLib> CommBackend for VendorComm<L> {
    type B = L::B;
    const NAME: &'static str = L::NAME;

    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn device(&self) -> &<L::B as Backend>::Device {
        &self.shared.device
    }
    fn capabilities(&self) -> Capabilities {
        capabilities_of(&self.shared.lib, self.shared.version)
    }

    fn launch(&self, calls: Vec<Call<'_, L::B>>, stream: &<L::B as Backend>::Stream) -> Result<()> {
        let op = if calls.len() == 1 { calls[0].kind().kind().name() } else { "group" };
        let seq = calls.first().map(|c| c.seq()).unwrap_or(0);
        if let Some(e) = self.shared.error() {
            return self.fail_stream(stream, op, e);
        }
        let scratch = translate::barrier_scratch::<L::B>(&calls, stream)?;
        let shared = &self.shared;
        let target = Target { lib: shared.lib, rank: shared.rank, size: shared.size, version: shared.version };
        let plan = translate::translate::<L>(&target, &calls, scratch.as_ref())?;
        let guard = match shared.lock() {
            Ok(g) => g,
            Err(e) => return self.fail_stream(stream, op, e),
        };
        let start = shared.take_event()?;
        stream.record(&start).map_err(CommError::Device)?;
        let issued = issue_group(shared, &guard, &plan, stream, op, seq);
        drop(guard);
        match issued {
            Ok(Some(position)) => {
                shared.watch_launch(stream, start, position, op, seq)?;
                plan.enqueue_fixups(stream)
            }
            Ok(None) => {
                shared.give_events([start]);
                shared.after_skipped_launch(op, seq);
                Ok(())
            }
            Err(e) => {
                shared.give_events([start]);
                shared.after_failed_issue(op, seq, &e);
                Err(e)
            }
        }
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Self>> {
        let shared = &self.shared;
        let guard = shared.lock()?;
        let parent = guard.raw as ncclComm_t;
        let slot = Slot::new();
        // SAFETY: the live parent under its lock; the slot outlives the split
        // (it is abandoned, never freed, if the split does not complete).
        let status = match unsafe { shared.lib.comm_split(parent, color, key, slot.ptr()) } {
            Ok(s) => s,
            Err(e) => {
                slot.abandon();
                return Err(e);
            }
        };
        // On a non-blocking parent the library writes the child into the
        // slot from its own thread when the split completes, and only then
        // may the slot be read or freed. It reports completion through the
        // parent's async error — not through the return value: NCCL 2.28
        // returns ncclSuccess while the split is still running (seen on an
        // H100: a slot read at once held null, and the late write into the
        // freed slot corrupted the heap).
        if status == Status::InProgress || !shared.config.blocking {
            if let Err(e) = shared.wait_ready(parent, "ncclCommSplit", 0) {
                slot.abandon();
                drop(guard);
                if shared.abort_requested.load(Ordering::Acquire) {
                    shared.await_abort();
                } else {
                    shared.abort_with(CommError::Aborted { reason: format!("split failed: {e}") });
                }
                return Err(e);
            }
        }
        drop(guard);
        let child = slot.read();
        if child.is_null() {
            return match color {
                None => Ok(None),
                Some(c) => Err(CommError::Backend {
                    library: L::NAME,
                    code: -1,
                    message: format!("ncclCommSplit with color {c} completed without a communicator"),
                }),
            };
        }
        let rank_size = {
            // SAFETY: an initialized child that only this thread knows of.
            match unsafe { shared.lib.async_error(child) }.and_then(|_| unsafe { shared.lib.rank_and_size(child) }) {
                Ok(rs) => rs,
                Err(e) => {
                    // SAFETY: ours alone; released once.
                    let _ = unsafe { shared.lib.abort(child) };
                    return Err(e);
                }
            }
        };
        let (rank, size) = rank_size;
        let child =
            Self::shared(shared.lib, child, rank, size, shared.device.clone(), shared.config.clone(), shared.version);
        Ok(Some(VendorComm { shared: child }))
    }

    fn abort(&self, reason: &str) {
        self.shared
            .abort_with(CommError::Aborted { reason: format!("rank {} called abort: {reason}", self.shared.rank) });
    }

    fn async_error(&self) -> Option<CommError> {
        if let Some(e) = self.shared.error() {
            return Some(e);
        }
        let guard = self.shared.lock().ok()?;
        // SAFETY: the live handle under its lock.
        unsafe { self.shared.lib.async_error(guard.raw as ncclComm_t) }.err()
    }
}
