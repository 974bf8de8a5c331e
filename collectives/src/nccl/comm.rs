//! The safe NCCL communicator.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chorus_devices::cuda::{self, Cuda, CudaBuffer, CudaDevice, CudaEvent, CudaStream, StreamMonitor};
use chorus_devices::{bf16, f16, DType, Device, DeviceError, Stream, View};

use super::result as nccl;
use super::sys::Comm;
use crate::backend::{Call, CallKind, Capabilities, CommBackend};
use crate::bootstrap::Store;
use crate::nccl_abi::{CommConfig, DataType, RedOpPlan, Status, UniqueId, Version};
use crate::{CommError, Communicator, Result};

/// Settings of an NCCL communicator.
#[derive(Clone, Debug)]
pub struct NcclConfig {
    /// Deadline of initialization, of every host wait on a collective, and
    /// of reading the unique id from the store. A peer that has not arrived
    /// by then is treated as dead: the communicator is aborted and the
    /// waiting rank gets `Timeout`.
    pub timeout: Duration,
    /// The store key rank 0 publishes the unique id under.
    pub store_key: String,
    /// Use NCCL's blocking mode (calls block in NCCL until peers arrive, so
    /// no deadline can apply). Off by default.
    pub blocking: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig { timeout: Duration::from_secs(300), store_key: "chorus/nccl/unique_id".into(), blocking: false }
    }
}

/// The handle and the state every user of it shares (the communicator, its
/// splits' parents, and the monitors of its queued calls).
struct CommShared {
    /// `None` once aborted. Read-locked by calls, write-locked by abort.
    raw: RwLock<Option<Comm>>,
    aborted: AtomicBool,
    reason: Mutex<Option<CommError>>,
    rank: usize,
    size: usize,
    device: CudaDevice,
    config: NcclConfig,
    version: Version,
}

// SAFETY: the raw handle is used under the RwLock (NCCL forbids concurrent
// use of one communicator, and abort needs exclusive access); NCCL itself is
// thread-safe across communicators.
unsafe impl Send for CommShared {}
unsafe impl Sync for CommShared {}

impl CommShared {
    fn abort_error(&self) -> Option<CommError> {
        if !self.aborted.load(Ordering::Acquire) {
            return None;
        }
        self.reason.lock().ok().and_then(|r| r.clone())
    }

    /// Aborts with `reason` (the first reason wins); kernels of queued calls return.
    fn abort_with(&self, reason: CommError) {
        if let Ok(mut r) = self.reason.lock() {
            r.get_or_insert(reason);
        }
        self.aborted.store(true, Ordering::Release);
        let Ok(mut raw) = self.raw.write() else { return };
        if let Some(comm) = raw.take() {
            let _ = self.device.bind();
            // SAFETY: the live handle, taken out so nobody uses it again.
            if let Err(e) = unsafe { nccl::comm_abort(comm) } {
                self.device.park(as_device_error("ncclCommAbort", "(abort)", e));
            }
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is ready; on an
    /// error or after the deadline, aborts it.
    fn wait_ready(&self, comm: Comm, op: &str, seq: u64) -> Result<()> {
        let start = Instant::now();
        let mut round = 0u64;
        loop {
            if let Some(e) = self.abort_error() {
                return Err(e);
            }
            // SAFETY: the caller holds the read lock on the live handle.
            match unsafe { nccl::comm_get_async_error(comm) } {
                Ok(Status::Done) => return Ok(()),
                Ok(Status::InProgress) => {}
                Err(e) => return Err(e),
            }
            if start.elapsed() >= self.config.timeout {
                return Err(CommError::Timeout {
                    op: op.to_string(),
                    seq,
                    waited: self.config.timeout,
                    missing: Vec::new(),
                });
            }
            round += 1;
            if round < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros((round * 10).min(1000)));
            }
        }
    }
}

impl Drop for CommShared {
    fn drop(&mut self) {
        let Some(comm) = self.raw.get_mut().ok().and_then(|r| r.take()) else { return };
        let _ = self.device.bind();
        // Finalize flushes queued work and tears connections down collectively;
        // if that fails or hangs, abort instead.
        // SAFETY: the live handle, used by nobody else any more.
        let finalized = unsafe { nccl::comm_finalize(comm) }.and_then(|s| match s {
            Status::Done => Ok(()),
            Status::InProgress => {
                let deadline = self.config.timeout.min(Duration::from_secs(60));
                let start = Instant::now();
                loop {
                    // SAFETY: as above.
                    match unsafe { nccl::comm_get_async_error(comm) } {
                        Ok(Status::Done) => break Ok(()),
                        Ok(Status::InProgress) if start.elapsed() < deadline => {
                            std::thread::sleep(Duration::from_micros(200))
                        }
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
            Ok(()) => unsafe { nccl::comm_destroy(comm) }.map(|_| ()),
            Err(e) => {
                // SAFETY: destroyed once (abort frees the handle).
                let _ = unsafe { nccl::comm_abort(comm) };
                Err(e)
            }
        };
        if let Err(e) = result {
            self.device.park(as_device_error("ncclCommFinalize", "(drop)", e));
        }
    }
}

fn as_device_error(op: &'static str, stream: &str, e: CommError) -> DeviceError {
    match e {
        CommError::Device(d) => d,
        other => DeviceError::OpFailed { op, stream: stream.to_string(), source: Arc::new(other) },
    }
}

/// One rank's endpoint of an NCCL communicator on a cuda device.
pub struct NcclComm {
    shared: Arc<CommShared>,
    /// One f32 for barriers, allocated on first use.
    barrier: Mutex<Option<CudaBuffer>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {}/{} on {})", self.shared.rank, self.shared.size, self.shared.device.name())
    }
}

impl NcclComm {
    /// Creates rank `rank`'s communicator of `world_size` ranks on `device`.
    /// Rank 0 creates the unique id and publishes it in `store` under
    /// `config.store_key`; the others wait for it (up to `config.timeout`).
    /// Every rank must call this; it returns when all have joined, or fails
    /// with `Timeout` (and aborts) when some did not.
    pub fn init(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        device: CudaDevice,
        config: NcclConfig,
    ) -> Result<Communicator<NcclComm>> {
        if world_size == 0 || rank >= world_size {
            return Err(CommError::invalid("NcclComm::init", format!("rank {rank} of {world_size} ranks")));
        }
        let version = nccl::get_version()?;
        let id = if rank == 0 {
            let id = nccl::get_unique_id()?;
            store.set(&config.store_key, id.as_bytes())?;
            id
        } else {
            UniqueId::from_slice(&store.get(&config.store_key, config.timeout)?)?
        };
        device.bind().map_err(CommError::Device)?;
        let mut cfg = CommConfig::new(config.blocking);
        // SAFETY: the device is bound on this thread.
        let (raw, status) = unsafe { nccl::comm_init_rank_config(world_size, id, rank, &mut cfg) }?;
        let shared = Arc::new(CommShared {
            raw: RwLock::new((!raw.is_null()).then_some(raw)),
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            rank,
            size: world_size,
            device,
            config,
            version,
        });
        if status == Status::InProgress {
            if let Err(e) = shared.wait_ready(raw, "ncclCommInitRankConfig", 0) {
                shared.abort_with(CommError::Aborted { reason: format!("initialization failed: {e}") });
                return Err(e);
            }
        }
        Ok(Communicator::new(NcclComm { shared, barrier: Mutex::new(None) }))
    }

    /// Creates the device `ordinal` and the communicator on it (see [`NcclComm::init`]).
    /// Without a CUDA driver this is `CommError::Device(LibraryUnavailable)`.
    pub fn init_on_ordinal(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        ordinal: usize,
        config: NcclConfig,
    ) -> Result<Communicator<NcclComm>> {
        let device = CudaDevice::new(ordinal).map_err(CommError::Device)?;
        NcclComm::init(store, rank, world_size, device, config)
    }

    /// Runs `f` with the raw `ncclComm_t`, under the communicator's lock and
    /// with the device bound, for calling NCCL directly (the benchmark
    /// compares chorus's per-call overhead with it). Fails with `Aborted`
    /// once the communicator has been aborted.
    ///
    /// # Safety
    /// `f` must not destroy, abort or keep the handle, and whatever it
    /// enqueues must follow NCCL's rules (every rank issues the same calls).
    pub unsafe fn with_raw<R>(&self, f: impl FnOnce(Comm) -> R) -> Result<R> {
        let raw = self.shared.raw.read().map_err(|_| CommError::invalid("with_raw", "lock poisoned"))?;
        let comm = (*raw)
            .ok_or_else(|| self.shared.abort_error().unwrap_or(CommError::Aborted { reason: "aborted".into() }))?;
        self.shared.device.bind().map_err(CommError::Device)?;
        Ok(f(comm))
    }

    /// The library's version.
    pub fn version(&self) -> Version {
        self.shared.version
    }

    fn barrier_ptr(&self) -> Result<u64> {
        let mut b = self.barrier.lock().map_err(|_| CommError::invalid("barrier", "lock poisoned"))?;
        if b.is_none() {
            *b = Some(self.shared.device.alloc(DType::F32, 1).map_err(CommError::Device)?);
        }
        Ok(b.as_ref().map(|b| b.device_ptr()).unwrap_or(0))
    }

    /// Enqueues one call inside the open group.
    fn enqueue_call(
        &self,
        comm: Comm,
        call: &Call<'_, Cuda>,
        stream: super::sys::Stream,
        ops: &mut Vec<c_int>,
    ) -> Result<()> {
        let ptr = |v: &View<'_, Cuda>| cuda::device_ptr(v) as *mut c_void;
        let ty = |v: &View<'_, Cuda>| DataType::of(v.dtype()).raw();
        let int = |v: usize| c_int::try_from(v).map_err(|_| CommError::invalid("nccl", "rank exceeds i32"));
        let mut red = |op: crate::ReduceOp, dtype: DType| -> Result<c_int> {
            match RedOpPlan::of(op) {
                RedOpPlan::Builtin(b) => Ok(b.raw()),
                RedOpPlan::PreMulSum(s) => {
                    let mut scalar = encode_scalar(dtype, s);
                    // SAFETY: a live handle; the scalar is one element of dtype.
                    let op = unsafe { nccl::red_op_create_pre_mul_sum(&mut scalar, DataType::of(dtype).raw(), comm) }?;
                    ops.push(op);
                    Ok(op)
                }
            }
        };
        // SAFETY (for every call below): the views were validated by the
        // Communicator and checked to be on this device; the pointers are
        // valid for their lengths in `stream`'s order; the handle is live.
        unsafe {
            match &call.kind {
                CallKind::AllReduce { send, recv, op } => {
                    let op = red(*op, send.dtype())?;
                    nccl::all_reduce(ptr(send), ptr(recv), send.len(), ty(send), op, comm, stream)?;
                }
                CallKind::AllGather { send, recv } => {
                    nccl::all_gather(ptr(send), ptr(recv), send.len(), ty(send), comm, stream)?;
                }
                CallKind::ReduceScatter { send, recv, op } => {
                    let op = red(*op, send.dtype())?;
                    nccl::reduce_scatter(ptr(send), ptr(recv), recv.len(), ty(send), op, comm, stream)?;
                }
                CallKind::Broadcast { send, recv, root } => {
                    nccl::broadcast(ptr(send), ptr(recv), send.len(), ty(send), int(*root)?, comm, stream)?;
                }
                CallKind::Reduce { send, recv, op, root } => {
                    let op = red(*op, send.dtype())?;
                    nccl::reduce(ptr(send), ptr(recv), send.len(), ty(send), op, int(*root)?, comm, stream)?;
                }
                CallKind::AllToAll { send, recv } => {
                    let n = self.shared.size;
                    let chunk = send.len() / n;
                    let bytes = (chunk * send.dtype().size()) as u64;
                    for peer in 0..n {
                        let off = peer as u64 * bytes;
                        let s = (cuda::device_ptr(send) + off) as *const c_void;
                        let r = (cuda::device_ptr(recv) + off) as *mut c_void;
                        nccl::send(s, chunk, ty(send), int(peer)?, comm, stream)?;
                        nccl::recv(r, chunk, ty(recv), int(peer)?, comm, stream)?;
                    }
                }
                CallKind::Send { buf, peer } => {
                    nccl::send(ptr(buf), buf.len(), ty(buf), int(*peer)?, comm, stream)?;
                }
                CallKind::Recv { buf, peer } => {
                    nccl::recv(ptr(buf), buf.len(), ty(buf), int(*peer)?, comm, stream)?;
                }
                CallKind::Barrier => {
                    let p = self.barrier_ptr()? as *mut c_void;
                    let sum = crate::nccl_abi::RedOp::Sum.raw();
                    nccl::all_reduce(p, p, 1, DataType::Float32.raw(), sum, comm, stream)?;
                }
            }
        }
        Ok(())
    }

    /// Fails `stream` from its next position with `error` (a call on an
    /// aborted communicator, which must not hang and must not run).
    fn fail_stream(&self, stream: &CudaStream, op: &'static str, error: CommError) -> Result<()> {
        let wrapped = as_device_error(op, &stream.name(), error);
        if let Some(pos) = stream.enqueue_raw(op, &[], |_| Ok(())).map_err(CommError::Device)? {
            stream.watch(pos, Arc::new(Failed(wrapped)));
        }
        Ok(())
    }
}

/// A monitor that has already failed.
struct Failed(DeviceError);

impl StreamMonitor for Failed {
    fn poll(&self) -> chorus_devices::Result<bool> {
        Err(self.0.clone())
    }
}

/// Watches one enqueued batch: done when its event completes; fails on an
/// NCCL asynchronous error, on abort, or when the deadline passes.
struct NcclMonitor {
    comm: Arc<CommShared>,
    event: CudaEvent,
    started: Instant,
    op: &'static str,
    seq: u64,
    stream: String,
}

impl StreamMonitor for NcclMonitor {
    fn poll(&self) -> chorus_devices::Result<bool> {
        let fail = |e: CommError| as_device_error(self.op, &self.stream, e);
        if let Some(e) = self.comm.abort_error() {
            return Err(fail(e));
        }
        self.comm.device.bind()?;
        // SAFETY: a live event of the bound context; the raw query does not
        // poll the stream's monitors (which would call back into this one).
        match unsafe { cudarc::driver::sys::cuEventQuery(self.event.raw()) } {
            cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(true),
            cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
            other => {
                return Err(DeviceError::Backend {
                    library: "libcuda",
                    code: other as i64,
                    message: format!("cuEventQuery after {}: {other:?}", self.op),
                })
            }
        }
        let async_error = match self.comm.raw.read() {
            // SAFETY: the live handle under the read lock.
            Ok(raw) => raw.map(|c| unsafe { nccl::comm_get_async_error(c) }),
            Err(_) => None,
        };
        if let Some(Err(e)) = async_error {
            self.comm.abort_with(CommError::Aborted { reason: format!("{} #{} failed: {e}", self.op, self.seq) });
            return Err(fail(e));
        }
        let waited = self.comm.config.timeout;
        if self.started.elapsed() >= waited {
            let e = CommError::Timeout { op: self.op.to_string(), seq: self.seq, waited, missing: Vec::new() };
            self.comm.abort_with(CommError::Aborted { reason: e.to_string() });
            return Err(fail(e));
        }
        Ok(false)
    }
}

fn encode_scalar(dtype: DType, s: f64) -> [u8; 8] {
    let mut out = [0u8; 8];
    let bytes: Vec<u8> = match dtype {
        DType::F32 => (s as f32).to_le_bytes().to_vec(),
        DType::F64 => s.to_le_bytes().to_vec(),
        DType::F16 => f16::from_f64(s).to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f64(s).to_le_bytes().to_vec(),
        DType::I32 => (s as i32).to_le_bytes().to_vec(),
        DType::I64 => (s as i64).to_le_bytes().to_vec(),
        DType::I8 => (s as i8).to_le_bytes().to_vec(),
        DType::U8 => (s as u8).to_le_bytes().to_vec(),
    };
    out[..bytes.len()].copy_from_slice(&bytes);
    out
}

impl CommBackend for NcclComm {
    type B = Cuda;
    const NAME: &'static str = "nccl";

    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn device(&self) -> &CudaDevice {
        &self.shared.device
    }
    fn capabilities(&self) -> Capabilities {
        let v = self.shared.version;
        Capabilities {
            avg: v.at_least(2, 10),
            premul_sum: v.at_least(2, 11),
            ranks_share_device: false,
            world_abort: false,
            fault_injection: false,
        }
    }

    fn launch(&self, calls: Vec<Call<'_, Cuda>>, stream: &CudaStream) -> Result<()> {
        if !stream.device().is_same(&self.shared.device) {
            return Err(CommError::invalid("launch", "the stream is not on this rank's device"));
        }
        let name = if calls.len() == 1 { calls[0].kind.kind().name() } else { "group" };
        let seq = calls.first().map(|c| c.seq).unwrap_or(0);
        let all_views: Vec<View<'_, Cuda>> = calls.iter().flat_map(|c| c.kind.views()).collect();
        for v in &all_views {
            if !v.buffer().device().is_same(&self.shared.device) {
                return Err(CommError::invalid(name, "a buffer is not on this rank's device"));
            }
        }
        if calls.len() == 1 {
            if let CallKind::Send { peer, .. } | CallKind::Recv { peer, .. } = calls[0].kind {
                if peer == self.shared.rank {
                    return Err(CommError::invalid(
                        name,
                        "a send or recv with oneself outside a group can never complete",
                    ));
                }
            }
        }
        if let Some(e) = self.shared.abort_error() {
            return self.fail_stream(stream, name, e);
        }
        if calls.iter().any(|c| matches!(c.kind, CallKind::Barrier)) {
            self.barrier_ptr()?;
        }
        let raw = self.shared.raw.read().map_err(|_| CommError::invalid(name, "communicator lock poisoned"))?;
        let Some(comm) = *raw else {
            drop(raw);
            let e = self.shared.abort_error().unwrap_or(CommError::Aborted { reason: "aborted".into() });
            return self.fail_stream(stream, name, e);
        };
        let stream_name = stream.name();
        let mut failure: Option<CommError> = None;
        let position = stream
            .enqueue_raw(name, &all_views, |s| {
                let s = s as super::sys::Stream;
                let mut ops = Vec::new();
                let mut run = || -> Result<()> {
                    nccl::group_start()?;
                    let mut enqueued = Ok(());
                    for call in &calls {
                        enqueued = self.enqueue_call(comm, call, s, &mut ops);
                        if enqueued.is_err() {
                            break;
                        }
                    }
                    // The group is always closed, even after a failed call.
                    let ended = nccl::group_end();
                    enqueued?;
                    if ended? == Status::InProgress {
                        self.shared.wait_ready(comm, name, seq)?;
                    }
                    Ok(())
                };
                let result = run();
                for op in ops {
                    // SAFETY: created on this handle in this batch, destroyed once after enqueueing.
                    if let Err(e) = unsafe { nccl::red_op_destroy(op, comm) } {
                        self.shared.device.park(as_device_error("ncclRedOpDestroy", &stream_name, e));
                    }
                }
                result.map_err(|e| {
                    failure = Some(e.clone());
                    as_device_error(name, &stream_name, e)
                })
            })
            .map_err(|e| failure.take().unwrap_or(CommError::Device(e)));
        drop(raw);
        let position = match position {
            Ok(p) => p,
            Err(e) => {
                if matches!(e, CommError::Timeout { .. }) {
                    self.shared.abort_with(CommError::Aborted { reason: e.to_string() });
                }
                return Err(e);
            }
        };
        let Some(position) = position else {
            // The stream failed earlier: this rank will not take part, so
            // abort rather than leave the peers waiting for it.
            let cause = stream.failure().map(|e| e.to_string()).unwrap_or_default();
            self.shared.abort_with(CommError::Aborted {
                reason: format!("rank {}'s stream failed before {name}: {cause}", self.shared.rank),
            });
            return Ok(());
        };
        let event = self.shared.device.create_event().map_err(CommError::Device)?;
        stream.record(&event).map_err(CommError::Device)?;
        stream.watch(
            position,
            Arc::new(NcclMonitor {
                comm: self.shared.clone(),
                event,
                started: Instant::now(),
                op: name,
                seq,
                stream: stream_name,
            }),
        );
        Ok(())
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<NcclComm>> {
        if let Some(e) = self.shared.abort_error() {
            return Err(e);
        }
        self.shared.device.bind().map_err(CommError::Device)?;
        let raw = self.shared.raw.read().map_err(|_| CommError::invalid("split", "lock poisoned"))?;
        let comm = (*raw).ok_or_else(|| CommError::Aborted { reason: "aborted".into() })?;
        // SAFETY: the live parent handle under the read lock; the device is bound.
        let (child, status) = unsafe { nccl::comm_split(comm, color, key) }?;
        if status == Status::InProgress {
            self.shared.wait_ready(comm, "ncclCommSplit", 0)?;
        }
        if child.is_null() {
            return Ok(None);
        }
        if let Err(e) = self.shared.wait_ready(child, "ncclCommSplit", 0) {
            // SAFETY: the child is ours alone; aborted once.
            let _ = unsafe { nccl::comm_abort(child) };
            return Err(e);
        }
        // SAFETY: an initialized child.
        let (rank, size) = match unsafe { nccl::comm_rank_and_size(child) } {
            Ok(rs) => rs,
            Err(e) => {
                // SAFETY: as above.
                let _ = unsafe { nccl::comm_abort(child) };
                return Err(e);
            }
        };
        let shared = Arc::new(CommShared {
            raw: RwLock::new(Some(child)),
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            rank,
            size,
            device: self.shared.device.clone(),
            config: self.shared.config.clone(),
            version: self.shared.version,
        });
        Ok(Some(NcclComm { shared, barrier: Mutex::new(None) }))
    }

    fn abort(&self, reason: &str) {
        self.shared
            .abort_with(CommError::Aborted { reason: format!("rank {} called abort: {reason}", self.shared.rank) });
    }

    fn async_error(&self) -> Option<CommError> {
        if let Some(e) = self.shared.abort_error() {
            return Some(e);
        }
        let raw = self.shared.raw.read().ok()?;
        // SAFETY: the live handle under the read lock.
        match raw.map(|c| unsafe { nccl::comm_get_async_error(c) }) {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }
}
