//! The simulated library's C functions that move data: reduce operators
//! (`ncclRedOpCreatePreMulSum`), groups and their launch on the caller's
//! stream, each collective, send and receive.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use chorus_devices::cpu::{CpuStream, JobInput, RawRange};
use chorus_devices::{DType, DeviceError};

use super::state::{
    enter, handle_of, violation, AsyncState, Queued, SimComm, GROUP, INTERNAL, INVALID_ARGUMENT, IN_PROGRESS, OK,
};
use crate::backend::{Fingerprint, OpKind};
use crate::nccl_family::abi::DataType;
use crate::nccl_family::sys::{ncclComm_t, ncclResult_t, Stream};
use crate::sim::{run_group, Prepared};
use crate::{CommError, ReduceOp};

/// How long the library's own thread takes before it enqueues a
/// non-blocking group: long enough that a caller that does not wait for the
/// group to complete enqueues its next work first.
const ENQUEUE_LAG: Duration = Duration::from_micros(300);

fn dtype_of(raw: c_int) -> Option<DType> {
    Some(match raw {
        x if x == DataType::Int8.raw() => DType::I8,
        x if x == DataType::Uint8.raw() => DType::U8,
        x if x == DataType::Int32.raw() => DType::I32,
        x if x == DataType::Int64.raw() => DType::I64,
        x if x == DataType::Float16.raw() => DType::F16,
        x if x == DataType::Float32.raw() => DType::F32,
        x if x == DataType::Float64.raw() => DType::F64,
        x if x == DataType::Bfloat16.raw() => DType::BF16,
        _ => return None,
    })
}

fn reduce_of(comm: &SimComm, op: c_int) -> Result<ReduceOp, ncclResult_t> {
    Ok(match op {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        other => match comm.ops.lock().unwrap_or_else(|p| p.into_inner()).get(&other) {
            Some(s) => ReduceOp::PreMulSum(*s),
            None => {
                return Err(violation(format!(
                    "reduce operator {other} used after ncclRedOpDestroy (or never created)"
                )))
            }
        },
    })
}

pub(super) unsafe extern "C" fn premul_sum(
    out: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    comm: ncclComm_t,
) -> ncclResult_t {
    let entered = match enter(handle_of(comm), "ncclRedOpCreatePreMulSum", false) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let Some(dtype) = dtype_of(datatype) else { return INVALID_ARGUMENT };
    if out.is_null() || scalar.is_null() || residence != 1 {
        return INVALID_ARGUMENT;
    }
    let mut bytes = [0u8; 8];
    // SAFETY: the caller's host-immediate scalar holds one element of `dtype`.
    unsafe { std::ptr::copy_nonoverlapping(scalar as *const u8, bytes.as_mut_ptr(), dtype.size()) };
    let s = match dtype {
        DType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as f64,
        DType::F64 => f64::from_le_bytes(bytes),
        DType::F16 => half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes([bytes[0], bytes[1]]).to_f64(),
        DType::I32 => i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as f64,
        DType::I64 => i64::from_le_bytes(bytes) as f64,
        DType::I8 => bytes[0] as i8 as f64,
        DType::U8 => bytes[0] as f64,
        DType::F8E4M3 => chorus_devices::Float8E4M3(bytes[0]).to_f32() as f64,
    };
    let mut ops = entered.comm.ops.lock().unwrap_or_else(|p| p.into_inner());
    let op = (5..).find(|k| !ops.contains_key(k)).unwrap_or(5);
    ops.insert(op, s);
    // SAFETY: a non-null out-pointer from the caller.
    unsafe { *out = op };
    OK
}

pub(super) unsafe extern "C" fn destroy_op(op: c_int, comm: ncclComm_t) -> ncclResult_t {
    let entered = match enter(handle_of(comm), "ncclRedOpDestroy", false) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let removed = entered.comm.ops.lock().unwrap_or_else(|p| p.into_inner()).remove(&op);
    match removed {
        Some(_) => OK,
        None => violation(format!("ncclRedOpDestroy of operator {op}, which does not exist")),
    }
}

pub(super) unsafe extern "C" fn group_start() -> ncclResult_t {
    GROUP.with(|g| g.borrow_mut().0 += 1);
    OK
}

pub(super) unsafe extern "C" fn group_end() -> ncclResult_t {
    let calls = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        g.0 = g.0.saturating_sub(1);
        if g.0 == 0 {
            Some(std::mem::take(&mut g.1))
        } else {
            None
        }
    });
    match calls {
        Some(calls) if !calls.is_empty() => launch(calls),
        _ => OK,
    }
}

/// The group's calls, by communicator and stream, enqueued as one job each.
fn launch(calls: Vec<Queued>) -> ncclResult_t {
    let mut jobs: Vec<(Arc<SimComm>, usize, Vec<Queued>)> = Vec::new();
    for q in calls {
        match jobs.iter_mut().find(|(c, s, _)| c.handle == q.comm.handle && *s == q.stream) {
            Some((_, _, list)) => list.push(q),
            None => jobs.push((q.comm.clone(), q.stream, vec![q])),
        }
    }
    let mut status = OK;
    for (comm, stream, calls) in jobs {
        let entered = match enter(comm.handle, "ncclGroupEnd", false) {
            Ok(e) => e,
            Err(code) => return code,
        };
        if comm.blocking {
            // SAFETY: the caller's live stream, for the duration of this call.
            if let Err(code) = unsafe { enqueue(stream, &comm, calls) } {
                return code;
            }
            continue;
        }
        // Non-blocking: the library's own thread enqueues the kernels a moment
        // later; the communicator is in progress until it has.
        comm.set_state(AsyncState::InProgress);
        let worker = comm.clone();
        let job = std::thread::Builder::new().name("simnccl-group".into()).spawn(move || {
            std::thread::sleep(ENQUEUE_LAG);
            // SAFETY: the caller keeps the stream alive until the group has
            // completed (it polls ncclCommGetAsyncError), or until an abort,
            // which joins this thread first.
            let r = unsafe { enqueue(stream, &worker, calls) };
            worker.set_state(match r {
                Ok(()) => AsyncState::Ready,
                Err(code) => AsyncState::Failed(code),
            });
        });
        match job {
            Ok(j) => entered.comm.jobs.lock().unwrap_or_else(|p| p.into_inner()).push(j),
            Err(_) => {
                comm.set_state(AsyncState::Failed(INTERNAL));
                return INTERNAL;
            }
        }
        status = IN_PROGRESS;
    }
    status
}

/// Enqueues one job on `stream` that runs `calls` through the sim data plane.
///
/// # Safety
/// `stream` is the address of a live [`CpuStream`].
unsafe fn enqueue(stream: usize, comm: &Arc<SimComm>, calls: Vec<Queued>) -> Result<(), ncclResult_t> {
    // SAFETY: per this function's contract.
    let stream = unsafe { &*(stream as *const CpuStream) };
    comm.device
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(|| chorus_devices::Stream::device(stream).clone());
    let (world, me, version) = (comm.world.clone(), comm.rank, comm.version);
    let buggy = version < 22907 && comm.size() == 1;
    let (prepared, scaled): (Vec<Prepared>, Vec<_>) = calls.into_iter().map(|q| (q.call, q.scaled)).unzip();
    let enqueued = stream.enqueue("ncclGroup", &[], move |input| match input {
        JobInput::Run => {
            // The emulated bug: what the tail held before (unwritten) or its input (unscaled).
            let saved: Vec<_> = scaled
                .iter()
                .flatten()
                .filter(|_| buggy)
                .map(|(out, input, premul)| {
                    let tail = tail_start(out);
                    // SAFETY: stream order makes this job the only user of the ranges.
                    let before = if *premul { unsafe { input.as_bytes() } } else { unsafe { out.as_bytes() } };
                    (out.clone(), tail, before[tail..].to_vec())
                })
                .collect();
            run_group(&world, me, &prepared).map_err(|e| DeviceError::OpFailed {
                op: "ncclGroup",
                stream: "simnccl".into(),
                source: Arc::new(e),
            })?;
            for (out, tail, bytes) in saved {
                // SAFETY: as above.
                unsafe { out.as_bytes_mut()[tail..].copy_from_slice(&bytes) };
            }
            Ok(())
        }
        JobInput::Skip(cause) => {
            // This rank will not take part: the peers must not wait for it.
            world.abort.abort(CommError::Aborted { reason: format!("rank {me}'s stream failed: {cause}") });
            Ok(())
        }
    });
    enqueued.map_err(|e| violation(format!("enqueueing on the caller's stream failed: {e}")))
}

/// The first byte the emulated bug leaves alone: past the last whole 256 elements.
fn tail_start(out: &RawRange) -> usize {
    let n = out.elements();
    (n - n % 256) * out.dtype().size()
}

/// Runs `call` with the communicator's rank and size, which size the buffers
/// of a rooted or per-rank call; a communicator `name` cannot enter returns
/// that code. `call` enters again (in [`add`]): the entry here has ended.
fn sized(name: &'static str, comm: ncclComm_t, call: impl FnOnce(usize, usize) -> ncclResult_t) -> ncclResult_t {
    let (rank, size) = match enter(handle_of(comm), name, false) {
        Ok(e) => (e.comm.rank, e.comm.size()),
        Err(code) => return code,
    };
    call(rank, size)
}

/// Adds one call to the open group (or runs it as a group of one).
#[allow(clippy::too_many_arguments)]
fn add(
    name: &'static str,
    comm: ncclComm_t,
    stream: Stream,
    op: OpKind,
    dtype: c_int,
    count: usize,
    reduce: Option<c_int>,
    root: Option<c_int>,
    send: Option<(*const c_void, usize)>,
    recv: Option<(*mut c_void, usize)>,
) -> ncclResult_t {
    let entered = match enter(handle_of(comm), name, false) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let c = entered.comm.clone();
    drop(entered);
    let Some(dt) = dtype_of(dtype) else { return INVALID_ARGUMENT };
    if stream.is_null() {
        return INVALID_ARGUMENT;
    }
    let reduce_op = match reduce.map(|r| reduce_of(&c, r)).transpose() {
        Ok(r) => r,
        Err(code) => return code,
    };
    let root = match root {
        Some(r) if r < 0 || r as usize >= c.size() => return INVALID_ARGUMENT,
        Some(r) => Some(r as usize),
        None => None,
    };
    let range = |p: *const c_void, elements: usize| {
        // SAFETY: the caller's device addresses are valid for `elements` in
        // the stream's order; the communicator's launch keeps them alive.
        unsafe { RawRange::borrowed(p as *mut u8, elements * dt.size(), dt) }
    };
    let send = send.map(|(p, n)| range(p, n));
    let recv = recv.map(|(p, n)| range(p as *const c_void, n));
    let is_collective = !matches!(op, OpKind::Send | OpKind::Recv);
    let seq = if is_collective { c.next_seq.fetch_add(1, Ordering::Relaxed) } else { 0 };
    let fingerprint = Fingerprint { op, dtype: dt, count, root, reduce: reduce_op.map(|r| r.name()) };
    let scaled = match (reduce_op, op, &send, &recv) {
        (
            Some(r @ (ReduceOp::Avg | ReduceOp::PreMulSum(_))),
            OpKind::AllReduce | OpKind::ReduceScatter,
            Some(s),
            Some(o),
        ) => Some((o.clone(), s.clone(), matches!(r, ReduceOp::PreMulSum(_)))),
        _ => None,
    };
    let call = Prepared {
        seq,
        fingerprint,
        op,
        reduce: reduce_op.unwrap_or(ReduceOp::Sum),
        root: root.unwrap_or(0),
        send,
        recv,
    };
    let q = Queued { comm: c, stream: stream as usize, call, scaled };
    let in_group = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        g.1.push(q);
        g.0 > 0
    });
    if in_group {
        OK
    } else {
        // SAFETY: ends the implicit group of this one call.
        unsafe {
            group_start();
            group_end()
        }
    }
}

pub(super) unsafe extern "C" fn all_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    add(
        "ncclAllReduce",
        comm,
        stream,
        OpKind::AllReduce,
        dtype,
        count,
        Some(op),
        None,
        Some((send, count)),
        Some((recv, count)),
    )
}

pub(super) unsafe extern "C" fn broadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    sized("ncclBroadcast", comm, |me, _| {
        // The sim data plane reads the root's input only.
        let send = (me as c_int == root).then_some((send, count));
        add("ncclBroadcast", comm, stream, OpKind::Broadcast, dtype, count, None, Some(root), send, Some((recv, count)))
    })
}

pub(super) unsafe extern "C" fn reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    sized("ncclReduce", comm, |me, _| {
        let recv = (me as c_int == root).then_some((recv, count));
        add("ncclReduce", comm, stream, OpKind::Reduce, dtype, count, Some(op), Some(root), Some((send, count)), recv)
    })
}

pub(super) unsafe extern "C" fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    sized("ncclAllGather", comm, |_, n| {
        let (send, recv) = (Some((send, count)), Some((recv, count * n)));
        add("ncclAllGather", comm, stream, OpKind::AllGather, dtype, count, None, None, send, recv)
    })
}

pub(super) unsafe extern "C" fn reduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    sized("ncclReduceScatter", comm, |_, n| {
        let (send, recv) = (Some((send, count * n)), Some((recv, count)));
        add("ncclReduceScatter", comm, stream, OpKind::ReduceScatter, dtype, count, Some(op), None, send, recv)
    })
}

pub(super) unsafe extern "C" fn all_to_all(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    sized("ncclAlltoAll", comm, |_, n| {
        // The sim data plane counts an all-to-all by its whole buffer.
        let (send, recv) = (Some((send, count * n)), Some((recv, count * n)));
        add("ncclAlltoAll", comm, stream, OpKind::AllToAll, dtype, count * n, None, None, send, recv)
    })
}

pub(super) unsafe extern "C" fn send(
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    add("ncclSend", comm, stream, OpKind::Send, dtype, count, None, Some(peer), Some((buf, count)), None)
}

pub(super) unsafe extern "C" fn recv(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> ncclResult_t {
    add("ncclRecv", comm, stream, OpKind::Recv, dtype, count, None, Some(peer), None, Some((buf, count)))
}
