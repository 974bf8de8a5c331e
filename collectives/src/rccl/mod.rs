//! The `rccl` backend: AMD GPUs through RCCL, on the `hip` device (feature `rccl`).
//!
//! Our own bindings in three layers: [`sys`] (RCCL's symbols, loaded at run
//! time from `CHORUS_RCCL_LIB` or `librccl.so*` — nothing links against
//! ROCm), [`result`] (one function per call, `ncclResult_t` → [`CommError`])
//! and [`RcclComm`] here. RCCL keeps NCCL's ABI, so the dtype and operator
//! values, result names, version decoding, unique id and config struct come
//! from [`crate::nccl_abi`], shared with the `nccl` backend.
//!
//! How the contract maps onto RCCL:
//! - **bootstrap**: rank 0 calls `ncclGetUniqueId` and publishes the 128
//!   bytes through a [`Store`]; every rank reads them and calls
//!   `ncclCommInitRankConfig` (non-blocking, NCCL 2.14 ABI) or, on an older
//!   RCCL, the blocking `ncclCommInitRank`;
//! - **a launch** (one call, or a [`Communicator::group`]) is one
//!   `ncclGroupStart` … `ncclGroupEnd` on the caller's `hipStream_t`, so it is
//!   stream-ordered like every other operation. A pre-multiplied sum creates
//!   its operator (`ncclRedOpCreatePreMulSum`, the scalar host-immediate in
//!   the buffer's dtype) before the group and destroys it after. Barrier is
//!   an all-reduce of one byte. All-to-all is RCCL's `ncclAllToAll` (NCCL
//!   spells it `ncclAlltoAll`) or, where absent, grouped sends and receives;
//! - **failures and deadlines**: after each launch an event is recorded on the
//!   stream; a watchdog thread per communicator polls those events and
//!   `ncclCommGetAsyncError`. An asynchronous RCCL error, or a launch not
//!   finished by its deadline ([`RcclConfig::timeout`]), aborts the
//!   communicator (`ncclCommAbort`) and fails the streams of the pending
//!   launches with the [`CommError`] inside [`DeviceError::OpFailed`], so a
//!   rank whose peer died gets `Timeout` (or RCCL's `ncclRemoteError`) from
//!   its next synchronize instead of hanging. RCCL cannot say which peer is
//!   missing, so `Timeout::missing` is empty;
//! - **abort** (`ncclCommAbort`) is local: peers see the failure through
//!   their own deadlines or RCCL's remote-error detection
//!   (`Capabilities::world_abort` is false);
//! - **drop**: `ncclCommFinalize` (waiting, with the deadline, for queued
//!   work) then `ncclCommDestroy`; if finalizing fails or times out, the
//!   communicator is aborted instead. Errors go to the device's parked
//!   errors ([`HipDevice::park_error`]);
//! - **versions**: `ncclGetVersion` decides [`Capabilities::avg`] (NCCL 2.10
//!   ABI) and `premul_sum` (2.11, and the symbol present); calls that need
//!   what the library lacks return [`CommError::Unsupported`]. `split` needs
//!   `ncclCommSplit` (ROCm 6.0's RCCL 2.18 or newer).
//!
//! Calls into one communicator are serialized (RCCL communicators are not
//! thread-safe); only `abort` and the watchdog's error poll bypass that, as
//! RCCL allows, so an abort can release a thread blocked inside RCCL.

pub mod result;
pub mod sys;

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus_devices::hip::{FailureHandle, Hip, HipBuffer, HipDevice, HipEvent, HipStream};
use chorus_devices::{Buffer, DType, Device, DeviceError, Element, Event, Stream, View};

use crate::backend::{Call, CallKind, Capabilities, CommBackend};
use crate::bootstrap::Store;
use crate::nccl_abi::{CommConfig, DataType, RedOp, RedOpPlan, Status, UniqueId, Version};
use crate::{CommError, Communicator, ReduceOp, Result};

/// Settings of an RCCL communicator.
#[derive(Clone, Debug)]
pub struct RcclConfig {
    /// Deadline of initialization, of each launch's completion on the GPU
    /// (the watchdog), of a split and of finalizing on drop.
    pub timeout: Duration,
    /// Create a non-blocking communicator (`blocking = 0`) where the library
    /// supports `ncclCommInitRankConfig`, so that initialization and splits
    /// honour the deadline too. Older RCCLs are always blocking.
    pub nonblocking: bool,
    /// The store key rank 0 publishes the unique id under.
    pub store_key: String,
}

impl Default for RcclConfig {
    fn default() -> Self {
        RcclConfig { timeout: Duration::from_secs(300), nonblocking: true, store_key: "chorus/rccl/unique_id".into() }
    }
}

/// A launch the watchdog follows until its event completes.
struct Pending {
    event: HipEvent,
    stream: FailureHandle,
    position: u64,
    op: &'static str,
    seq: u64,
    deadline: Instant,
}

/// What the communicator handle, its splits' parents and the watchdog share.
struct Shared {
    raw: usize,
    rank: usize,
    device: HipDevice,
    timeout: Duration,
    nonblocking: bool,
    /// Serializes calls into the communicator.
    calls: Mutex<()>,
    /// Held by `ncclCommAbort` and by the watchdog's error poll, so neither
    /// runs on a freed communicator.
    abort_lock: Mutex<()>,
    /// Set once `ncclCommAbort` has run: the handle is gone.
    released: AtomicBool,
    /// The first asynchronous error or abort reason.
    error: Mutex<Option<CommError>>,
    pending: Mutex<Vec<Pending>>,
    wake: Condvar,
    stop: AtomicBool,
}

impl Shared {
    fn comm(&self) -> sys::ncclComm_t {
        self.raw as sys::ncclComm_t
    }

    fn error(&self) -> Option<CommError> {
        self.error.lock().ok().and_then(|e| e.clone())
    }

    /// Aborts the communicator with `error` (the first error sticks) and fails
    /// every pending launch's stream with it.
    fn abort_with(&self, error: CommError) {
        if let Ok(mut e) = self.error.lock() {
            e.get_or_insert(error.clone());
        }
        let error = self.error().unwrap_or(error);
        // Prefer to abort between calls; if a call is blocked inside RCCL for
        // longer than a moment, abort anyway: releasing it is what abort is for.
        let start = Instant::now();
        let _calls = loop {
            match self.calls.try_lock() {
                Ok(g) => break Some(g),
                Err(_) if start.elapsed() < Duration::from_millis(200) => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => break None,
            }
        };
        if let Ok(_guard) = self.abort_lock.lock() {
            if !self.released.swap(true, Ordering::AcqRel) {
                let aborted = self.device.bind().map_err(CommError::Device).and_then(|_| {
                    // SAFETY: the handle is live (not yet released) and released exactly once here.
                    unsafe { result::comm_abort(self.comm()) }
                });
                if let Err(e) = aborted {
                    self.device.park_error(as_device_error("ncclCommAbort", &self.device.name(), e));
                }
            }
        }
        let pending = self.pending.lock().map(|mut p| std::mem::take(&mut *p)).unwrap_or_default();
        for p in pending {
            p.stream.fail(p.position, op_failed(p.op, p.stream.stream_name(), error.clone()));
        }
        self.wake.notify_all();
    }

    /// Polls a non-blocking communicator until its last call has finished,
    /// aborting with `Timeout` at the deadline.
    fn wait_ready(&self, comm: sys::ncclComm_t, what: &str) -> Result<()> {
        let start = Instant::now();
        loop {
            // SAFETY: `comm` is live while the caller holds `calls`.
            match unsafe { result::comm_async_error(comm) }? {
                Status::Done => return Ok(()),
                Status::InProgress if start.elapsed() >= self.timeout => {
                    return Err(CommError::Timeout {
                        op: what.to_string(),
                        seq: 0,
                        waited: self.timeout,
                        missing: Vec::new(),
                    })
                }
                Status::InProgress => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}

fn op_failed(op: &'static str, stream: &str, error: CommError) -> DeviceError {
    DeviceError::OpFailed { op, stream: stream.to_string(), source: Arc::new(error) }
}

fn as_device_error(op: &'static str, device: &str, error: CommError) -> DeviceError {
    match error {
        CommError::Device(d) => d,
        other => op_failed(op, device, other),
    }
}

/// The watchdog: follows pending launches and the communicator's async error.
fn watch(shared: Arc<Shared>) {
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let idle = shared.pending.lock().map(|p| p.is_empty()).unwrap_or(true);
        if idle {
            if let Ok(guard) = shared.pending.lock() {
                let _ = shared.wake.wait_timeout(guard, Duration::from_millis(100));
            }
            continue;
        }
        let async_error = match shared.abort_lock.lock() {
            Ok(_guard) if !shared.released.load(Ordering::Acquire) => {
                // SAFETY: not released, and abort cannot run while we hold the lock.
                unsafe { result::comm_async_error(shared.comm()) }.err()
            }
            _ => None,
        };
        if let Some(e) = async_error {
            shared.abort_with(e);
            continue;
        }
        let now = Instant::now();
        let mut expired = None;
        if let Ok(mut pending) = shared.pending.lock() {
            pending.retain(|p| match p.event.query() {
                Ok(false) => {
                    if now >= p.deadline && expired.is_none() {
                        expired = Some(CommError::Timeout {
                            op: p.op.to_string(),
                            seq: p.seq,
                            waited: shared.timeout,
                            missing: Vec::new(),
                        });
                    }
                    true
                }
                // Done, or the stream failed before it (already reported there).
                Ok(true) | Err(_) => false,
            });
        }
        if let Some(e) = expired {
            shared.abort_with(e);
            continue;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One rank's RCCL communicator on a hip device.
pub struct RcclComm {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
    size: usize,
    device: HipDevice,
    config: RcclConfig,
    version: Version,
}

impl std::fmt::Debug for RcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RcclComm(rank {}/{} on {}, RCCL {})", self.shared.rank, self.size, self.device.name(), self.version)
    }
}

/// The loaded library's version.
pub fn version() -> Result<Version> {
    Ok(Version::decode(result::version()?))
}

/// A new unique id (`ncclGetUniqueId`), for rank 0 to hand to the others.
pub fn unique_id() -> Result<UniqueId> {
    result::unique_id()
}

impl RcclComm {
    /// Rank `rank` of `size` joins the communicator identified by `id` on
    /// `device`. Blocks until every rank has joined (or the deadline, where
    /// the library supports non-blocking initialization).
    pub fn init(
        device: &HipDevice,
        rank: usize,
        size: usize,
        id: &UniqueId,
        config: RcclConfig,
    ) -> Result<Communicator<RcclComm>> {
        if size == 0 || rank >= size {
            return Err(CommError::invalid("RcclComm::init", format!("rank {rank} is out of range for {size} ranks")));
        }
        let lib = result::lib()?;
        let version = version()?;
        device.bind().map_err(CommError::Device)?;
        let nonblocking = config.nonblocking && lib.ncclCommInitRankConfig.is_some() && version.at_least(2, 14);
        let mut cfg = CommConfig::new(!nonblocking);
        let use_config = lib.ncclCommInitRankConfig.is_some() && version.at_least(2, 14);
        // SAFETY: the rank's device is current on this thread.
        let (raw, status) = unsafe { result::comm_init_rank(size, *id, rank, use_config.then_some(&mut cfg)) }?;
        let comm = RcclComm::from_raw(raw, rank, size, device, config, version, nonblocking);
        if status == Status::InProgress {
            if let Err(e) = comm.shared.wait_ready(raw, "ncclCommInitRankConfig") {
                comm.shared.abort_with(e.clone());
                return Err(e);
            }
        }
        Ok(Communicator::new(comm))
    }

    /// Bootstrap through `store`: rank 0 creates the unique id and publishes
    /// its 128 bytes under [`RcclConfig::store_key`]; the other ranks wait
    /// for them (up to the deadline); then every rank calls [`RcclComm::init`].
    pub fn bootstrap(
        store: &dyn Store,
        device: &HipDevice,
        rank: usize,
        size: usize,
        config: RcclConfig,
    ) -> Result<Communicator<RcclComm>> {
        let id = if rank == 0 {
            let id = unique_id()?;
            store.set(&config.store_key, id.as_bytes())?;
            id
        } else {
            UniqueId::from_slice(&store.get(&config.store_key, config.timeout)?)?
        };
        RcclComm::init(device, rank, size, &id, config)
    }

    fn from_raw(
        raw: sys::ncclComm_t,
        rank: usize,
        size: usize,
        device: &HipDevice,
        config: RcclConfig,
        version: Version,
        nonblocking: bool,
    ) -> RcclComm {
        let shared = Arc::new(Shared {
            raw: raw as usize,
            rank,
            device: device.clone(),
            timeout: config.timeout,
            nonblocking,
            calls: Mutex::new(()),
            abort_lock: Mutex::new(()),
            released: AtomicBool::new(false),
            error: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let watched = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("rccl-watchdog-r{rank}"))
            .spawn(move || watch(watched))
            .map_err(|e| {
                // Without a watchdog the deadlines cannot be enforced; say so where it will be seen.
                device.park_error(DeviceError::Backend {
                    library: "std::thread",
                    code: 0,
                    message: format!("the RCCL watchdog could not start: {e}"),
                })
            })
            .ok();
        RcclComm { shared, watchdog, size, device: device.clone(), config, version }
    }

    /// The RCCL version this communicator runs on.
    pub fn library_version(&self) -> Version {
        self.version
    }

    /// Whether the communicator was created non-blocking.
    pub fn is_nonblocking(&self) -> bool {
        self.shared.nonblocking
    }

    fn unusable(&self) -> Option<CommError> {
        if let Some(e) = self.shared.error() {
            return Some(e);
        }
        self.shared
            .released
            .load(Ordering::Acquire)
            .then(|| CommError::Aborted { reason: "communicator released".into() })
    }

    fn check_supported(&self, op: ReduceOp) -> Result<()> {
        let caps = self.capabilities();
        match op {
            ReduceOp::Avg if !caps.avg => Err(CommError::Unsupported {
                backend: "rccl",
                what: format!("ReduceOp::Avg (RCCL {} predates ncclAvg, NCCL 2.10 ABI)", self.version),
            }),
            ReduceOp::PreMulSum(_) if !caps.premul_sum => Err(CommError::Unsupported {
                backend: "rccl",
                what: format!(
                    "ReduceOp::PreMulSum (RCCL {} lacks ncclRedOpCreatePreMulSum, NCCL 2.11 ABI)",
                    self.version
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Issues the calls between `ncclGroupStart` and `ncclGroupEnd`; returns
    /// the first error, having always ended the group.
    fn issue_group(&self, calls: &[Prepared], stream: &HipStream) -> Result<()> {
        let comm = self.shared.comm();
        // Pre-multiplied sums need an operator per call, created before the group.
        let mut ops = Vec::with_capacity(calls.len());
        let mut created = Vec::new();
        let mut first: Result<()> = Ok(());
        for c in calls {
            let raw = match c.reduce.map(RedOpPlan::of) {
                None => RedOp::Sum.raw(),
                Some(RedOpPlan::Builtin(op)) => op.raw(),
                Some(RedOpPlan::PreMulSum(s)) => {
                    let mut bytes = scalar_bytes(c.dtype, s);
                    // SAFETY: the communicator is live (caller holds `calls`, not released).
                    match unsafe { result::red_op_create_pre_mul_sum(&mut bytes, DataType::of(c.dtype).raw(), comm) } {
                        Ok(op) => {
                            created.push(op);
                            op
                        }
                        Err(e) => {
                            first = Err(e);
                            break;
                        }
                    }
                }
            };
            ops.push(raw);
        }
        if first.is_ok() {
            first = result::group_start();
            if first.is_ok() {
                for (c, op) in calls.iter().zip(&ops) {
                    let args = result::Args { comm, stream: stream.raw(), datatype: DataType::of(c.dtype).raw() };
                    // SAFETY: pointers of this rank's device, kept alive past the call by
                    // their buffers' stream-ordered frees (noted on this stream).
                    if let Err(e) = unsafe { c.issue(args, *op, self.size) } {
                        first = Err(e);
                        break;
                    }
                }
                // SAFETY: ends the group started above, whatever happened inside it.
                let ended = unsafe { result::group_end(comm) }.and_then(|status| match status {
                    Status::Done => Ok(()),
                    Status::InProgress => self.shared.wait_ready(comm, "ncclGroupEnd"),
                });
                if first.is_ok() {
                    first = ended;
                }
            }
        }
        for op in created {
            // SAFETY: every call using `op` has been enqueued (the group has ended).
            if let Err(e) = unsafe { result::red_op_destroy(op, comm) } {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// A call with its buffers resolved to device addresses.
struct Prepared {
    kind: crate::backend::OpKind,
    dtype: DType,
    reduce: Option<ReduceOp>,
    send: u64,
    recv: u64,
    /// Elements: per rank for all-gather and reduce-scatter and all-to-all, the length otherwise.
    count: usize,
    root: usize,
}

impl Prepared {
    /// Issues this call inside an open group.
    ///
    /// # Safety
    /// As the `result` functions: live handles, pointers valid until the call has run.
    unsafe fn issue(&self, a: result::Args, op: c_int, size: usize) -> Result<Status> {
        use crate::backend::OpKind as K;
        // SAFETY: per this function's contract.
        unsafe {
            match self.kind {
                K::AllReduce | K::Barrier => result::all_reduce(a, self.send, self.recv, self.count, op),
                K::AllGather => result::all_gather(a, self.send, self.recv, self.count),
                K::ReduceScatter => result::reduce_scatter(a, self.send, self.recv, self.count, op),
                K::Broadcast => result::broadcast(a, self.send, self.recv, self.count, self.root),
                K::Reduce => result::reduce(a, self.send, self.recv, self.count, op, self.root),
                K::Send => result::send(a, self.send, self.count, self.root),
                K::Recv => result::recv(a, self.recv, self.count, self.root),
                K::AllToAll => match result::all_to_all(a, self.send, self.recv, self.count) {
                    Some(r) => r,
                    None => {
                        // No ncclAllToAll: one send and one receive per peer (we are inside a group).
                        let chunk = (self.count * self.dtype.size()) as u64;
                        for peer in 0..size {
                            result::send(a, self.send + peer as u64 * chunk, self.count, peer)?;
                            result::recv(a, self.recv + peer as u64 * chunk, self.count, peer)?;
                        }
                        Ok(Status::Done)
                    }
                },
            }
        }
    }
}

/// A pre-multiplied sum's scalar as one element of `dtype` (NCCL converts it the same way).
fn scalar_bytes(dtype: DType, s: f64) -> [u8; 8] {
    fn put<T: Element>(s: f64) -> [u8; 8] {
        let mut out = [0u8; 8];
        let v = T::from_f64(s);
        let b = bytemuck::bytes_of(&v);
        out[..b.len()].copy_from_slice(b);
        out
    }
    match dtype {
        DType::F32 => put::<f32>(s),
        DType::F64 => put::<f64>(s),
        DType::F16 => put::<chorus_devices::f16>(s),
        DType::BF16 => put::<chorus_devices::bf16>(s),
        DType::I32 => put::<i32>(s),
        DType::I64 => put::<i64>(s),
        DType::I8 => put::<i8>(s),
        DType::U8 => put::<u8>(s),
    }
}

impl CommBackend for RcclComm {
    type B = Hip;
    const NAME: &'static str = "rccl";

    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn device(&self) -> &HipDevice {
        &self.device
    }
    fn capabilities(&self) -> Capabilities {
        let premul = result::lib()
            .map(|l| l.ncclRedOpCreatePreMulSum.is_some() && l.ncclRedOpDestroy.is_some())
            .unwrap_or(false);
        Capabilities {
            avg: self.version.at_least(2, 10),
            premul_sum: premul && self.version.at_least(2, 11),
            ranks_share_device: false,
            world_abort: false,
            fault_injection: false,
        }
    }

    fn launch(&self, calls: Vec<Call<'_, Hip>>, stream: &HipStream) -> Result<()> {
        if !stream.device().is_same(&self.device) {
            return Err(CommError::invalid("launch", "the stream is not on this rank's device"));
        }
        let name = if calls.len() == 1 { calls[0].kind.kind().name() } else { "group" };
        for c in &calls {
            if let CallKind::Send { peer, .. } = c.kind {
                if peer == self.rank() && calls.len() == 1 {
                    return Err(CommError::invalid("send", "a send to oneself outside a group can never complete"));
                }
            }
            if let CallKind::AllReduce { op, .. } | CallKind::ReduceScatter { op, .. } | CallKind::Reduce { op, .. } =
                c.kind
            {
                self.check_supported(op)?;
            }
        }
        if let Some(e) = self.unusable() {
            return Err(e);
        }

        // Resolve every view (this also makes the buffers' frees wait for this stream).
        let ptr = |op: &'static str, v: View<'_, Hip>| stream.device_ptr(op, v).map_err(CommError::Device);
        let mut barrier_bytes: Vec<HipBuffer> = Vec::new();
        let mut prepared = Vec::with_capacity(calls.len());
        for c in &calls {
            let kind = c.kind.kind();
            let op = kind.name();
            let base = Prepared {
                kind,
                dtype: c.fingerprint.dtype,
                reduce: None,
                send: 0,
                recv: 0,
                count: c.fingerprint.count,
                root: 0,
            };
            let p = match &c.kind {
                CallKind::AllReduce { send, recv, op: r } | CallKind::ReduceScatter { send, recv, op: r } => {
                    Prepared { reduce: Some(*r), send: ptr(op, *send)?, recv: ptr(op, *recv)?, ..base }
                }
                CallKind::AllGather { send, recv } => Prepared { send: ptr(op, *send)?, recv: ptr(op, *recv)?, ..base },
                CallKind::AllToAll { send, recv } => {
                    Prepared { send: ptr(op, *send)?, recv: ptr(op, *recv)?, count: send.len() / self.size, ..base }
                }
                CallKind::Broadcast { send, recv, root } => {
                    Prepared { send: ptr(op, *send)?, recv: ptr(op, *recv)?, root: *root, ..base }
                }
                CallKind::Reduce { send, recv, op: r, root } => {
                    Prepared { reduce: Some(*r), send: ptr(op, *send)?, recv: ptr(op, *recv)?, root: *root, ..base }
                }
                CallKind::Send { buf, peer } => Prepared { send: ptr(op, *buf)?, root: *peer, ..base },
                CallKind::Recv { buf, peer } => Prepared { recv: ptr(op, *buf)?, root: *peer, ..base },
                CallKind::Barrier => {
                    let byte = stream.alloc(DType::U8, 1).map_err(CommError::Device)?;
                    let at = ptr(op, byte.view())?;
                    barrier_bytes.push(byte);
                    Prepared { dtype: DType::U8, reduce: Some(ReduceOp::Sum), send: at, recv: at, count: 1, ..base }
                }
            };
            prepared.push(p);
        }

        let position = match stream.begin_external() {
            Ok(p) => p,
            Err(cause) => {
                // The stream failed earlier: the calls are skipped, like every
                // operation after a failure; abort so the peers do not wait for them.
                self.abort(&format!("rank {}'s stream failed before {name}: {cause}", self.rank()));
                return Ok(());
            }
        };
        self.device.bind().map_err(CommError::Device)?;
        let issued = {
            let _calls =
                self.shared.calls.lock().map_err(|_| CommError::invalid("launch", "communicator lock poisoned"))?;
            if let Some(e) = self.unusable() {
                return Err(e);
            }
            self.issue_group(&prepared, stream)
        };
        // The barrier byte is freed on this stream after the collective (stream-ordered).
        drop(barrier_bytes);
        if let Err(e) = issued {
            if matches!(e, CommError::Timeout { .. } | CommError::Backend { .. }) {
                self.shared.abort_with(e.clone());
            }
            return Err(e);
        }

        let event = self.device.create_event().map_err(CommError::Device)?;
        stream.record(&event).map_err(CommError::Device)?;
        let seq = calls.first().map(|c| c.seq).unwrap_or(0);
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.push(Pending {
                event,
                stream: stream.failure_handle(),
                position,
                op: name,
                seq,
                deadline: Instant::now() + self.config.timeout,
            });
        }
        self.shared.wake.notify_all();
        Ok(())
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<RcclComm>> {
        if let Some(e) = self.unusable() {
            return Err(e);
        }
        self.device.bind().map_err(CommError::Device)?;
        let _calls = self.shared.calls.lock().map_err(|_| CommError::invalid("split", "communicator lock poisoned"))?;
        let mut cfg = CommConfig::new(!self.shared.nonblocking);
        let use_config = result::lib()?.ncclCommInitRankConfig.is_some() && self.version.at_least(2, 14);
        // SAFETY: the parent is live (checked above, under `calls`).
        let (raw, status) =
            unsafe { result::comm_split(self.shared.comm(), color, key, use_config.then_some(&mut cfg)) }?;
        if status == Status::InProgress {
            let target = if raw.is_null() { self.shared.comm() } else { raw };
            if let Err(e) = self.shared.wait_ready(target, "ncclCommSplit") {
                if !raw.is_null() {
                    // SAFETY: the child never became usable; released once here.
                    let _ = unsafe { result::comm_abort(raw) };
                }
                return Err(e);
            }
        }
        if raw.is_null() {
            return Ok(None);
        }
        // SAFETY: the child is initialized (waited for above).
        let (size, rank) = unsafe { result::comm_shape(raw) }?;
        Ok(Some(RcclComm::from_raw(
            raw,
            rank,
            size,
            &self.device,
            self.config.clone(),
            self.version,
            self.shared.nonblocking,
        )))
    }

    fn abort(&self, reason: &str) {
        self.shared.abort_with(CommError::Aborted { reason: format!("rank {} called abort: {reason}", self.rank()) });
    }

    fn async_error(&self) -> Option<CommError> {
        if let Some(e) = self.shared.error() {
            return Some(e);
        }
        let polled = match self.shared.abort_lock.lock() {
            Ok(_guard) if !self.shared.released.load(Ordering::Acquire) => {
                // SAFETY: not released, and abort cannot run while we hold the lock.
                unsafe { result::comm_async_error(self.shared.comm()) }.err()
            }
            _ => None,
        };
        if let Some(e) = polled.clone() {
            self.shared.abort_with(e);
        }
        polled
    }
}

impl Drop for RcclComm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        if self.shared.released.load(Ordering::Acquire) {
            return;
        }
        let device_name = self.device.name();
        let finished = self.device.bind().map_err(CommError::Device).and_then(|_| {
            let comm = self.shared.comm();
            // SAFETY: live (not released); no other handle to it remains.
            match unsafe { result::comm_finalize(comm) }? {
                Some(Status::InProgress) => self.shared.wait_ready(comm, "ncclCommFinalize"),
                _ => Ok(()),
            }
        });
        match finished {
            Ok(()) => {
                self.shared.released.store(true, Ordering::Release);
                // SAFETY: finalized; destroyed once.
                if let Err(e) = unsafe { result::comm_destroy(self.shared.comm()) } {
                    self.device.park_error(as_device_error("ncclCommDestroy", &device_name, e));
                }
            }
            Err(e) => {
                self.device.park_error(as_device_error("ncclCommFinalize", &device_name, e.clone()));
                self.shared.abort_with(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn premul_scalars_are_one_element_of_the_dtype() {
        assert_eq!(&scalar_bytes(DType::F32, 0.5)[..4], &0.5f32.to_le_bytes());
        assert_eq!(scalar_bytes(DType::F64, -2.0), (-2.0f64).to_le_bytes());
        assert_eq!(&scalar_bytes(DType::BF16, 1.0)[..2], &[0x80, 0x3f]);
        assert_eq!(&scalar_bytes(DType::F16, 1.0)[..2], &[0x00, 0x3c]);
        assert_eq!(&scalar_bytes(DType::I32, 3.7)[..4], &3i32.to_le_bytes());
        assert_eq!(scalar_bytes(DType::U8, 2.0)[0], 2);
    }

    #[test]
    fn the_default_config_is_non_blocking_with_a_deadline() {
        let c = RcclConfig::default();
        assert!(c.nonblocking);
        assert!(c.timeout >= Duration::from_secs(60));
        assert_eq!(c.store_key, "chorus/rccl/unique_id");
    }
}
