//! The virtual device's and communicator's contract, checked by hand-computed clocks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_collectives::recorder::RecorderOptions;
use chorus_collectives::{CommError, Communicator};
use chorus_devices::{Buffer, Copy2d, DType, Device, MemorySpace, Priority, Stream, StreamExt};

use super::comm::{VirtComm, VirtWorld};
use super::{VirtConfig, VirtDevice};
use crate::cost::{CollectiveShape, CostModel, HostCost, Issuer, KernelCost, KernelKind};

/// One byte per nanosecond everywhere; a collective costs a microsecond per byte of its larger buffer.
#[derive(Debug)]
struct Unit;

impl CostModel for Unit {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        match k.kind {
            KernelKind::MemoryBound => k.bytes * 1e-9,
            _ => k.flops * 1e-12,
        }
    }
    fn collective_seconds(&self, s: &CollectiveShape) -> f64 {
        s.bytes as f64 * 1e-6
    }
    fn copy_seconds(&self, bytes: u64, _: MemorySpace, _: MemorySpace) -> f64 {
        bytes as f64 * 1e-9
    }
    fn peak_flops(&self) -> Option<f64> {
        None
    }
}

fn device(rank: usize) -> VirtDevice {
    VirtDevice::new(VirtConfig { ordinal: rank, kernels_reach_host: false }, Arc::new(Unit))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-15
}

/// Runs `f` on a thread per rank of a fresh world of `ranks`, each with
/// its device and its communicator on the world (no recorder); marks the
/// rank ended when `f` returns, and gives each rank's result in rank order.
fn on_every_rank<T: Send>(
    ranks: usize,
    timeout: Duration,
    f: impl Fn(usize, &VirtDevice, Communicator<VirtComm>) -> T + Sync,
) -> (Arc<VirtWorld>, Vec<T>) {
    let world = VirtWorld::new(ranks, Arc::new(Unit), timeout);
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = (0..ranks)
            .map(|r| {
                let (world, f) = (world.clone(), &f);
                s.spawn(move || {
                    let d = device(r);
                    let comm = world.communicator(r, d.clone(), Arc::new(Mutex::new(Vec::new()))).unwrap();
                    let out = f(r, &d, Communicator::with_recorder(comm, &RecorderOptions::off()));
                    world.rank_ended(r);
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (world, results)
}

#[test]
fn memory_counts_sizes_and_peaks_like_the_cpu_device() {
    let d = device(0);
    let a = d.alloc(DType::F32, 100).unwrap();
    let s = d.create_stream(Priority::Normal).unwrap();
    let b = s.alloc(DType::BF16, 50).unwrap();
    assert_eq!(d.memory_stats().bytes_in_use, 500);
    drop(a);
    assert_eq!((d.memory_stats().bytes_in_use, d.memory_stats().peak_bytes), (100, 500));
    let h = d.alloc_host(DType::F32, 10, true).unwrap();
    assert_eq!(
        (h.space(), d.host_memory_stats().bytes_in_use, d.memory_stats().bytes_in_use),
        (MemorySpace::Host, 40, 100)
    );
    let act = d.alloc_activation(1000).unwrap();
    // Activations count in the total, not in FSDP's device counters.
    assert_eq!(
        (d.memory_stats().bytes_in_use, d.total_stats().bytes_in_use, d.total_stats().peak_bytes),
        (100, 1100, 1100)
    );
    drop((act, b, h));
    assert_eq!((d.total_stats().bytes_in_use, d.activation_stats().peak_bytes), (0, 1000));
}

/// [`Unit`]'s times; the host issues an FSDP operation in 1 µs and each
/// piece of a batched copy in 10 µs more (the cuda device's driver call per piece).
#[derive(Debug)]
struct Pieces;

impl CostModel for Pieces {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        Unit.kernel_seconds(k)
    }
    fn collective_seconds(&self, s: &CollectiveShape) -> f64 {
        Unit.collective_seconds(s)
    }
    fn copy_seconds(&self, bytes: u64, from: MemorySpace, to: MemorySpace) -> f64 {
        Unit.copy_seconds(bytes, from, to)
    }
    fn peak_flops(&self) -> Option<f64> {
        None
    }
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        let issue_s = match issuer {
            Issuer::Fsdp => 1e-6,
            Issuer::CopyPiece => 10e-6,
            _ => 0.0,
        };
        HostCost { issue_s, runs_on_host: false }
    }
}

#[test]
fn a_batched_copy_is_one_operation_whose_pieces_each_cost_the_host() {
    let d = VirtDevice::new(VirtConfig { ordinal: 0, kernels_reach_host: false }, Arc::new(Pieces));
    let s = d.create_stream(Priority::Normal).unwrap();
    let (src, dst) = (d.alloc(DType::F32, 750).unwrap(), d.alloc(DType::F32, 750).unwrap());
    let piece = |i: usize| Copy2d {
        rows: 1,
        row_len: 250,
        src_offset: 250 * i,
        src_stride: 250,
        dst_offset: 250 * i,
        dst_stride: 250,
    };
    let copies: Vec<_> = (0..3).map(|i| (src.view(), dst.view(), piece(i))).collect();
    s.copy_2d_batch(&copies).unwrap();
    // The host: three pieces and the operation; then the 3,000 bytes run as one copy.
    assert!(close(d.host_issue_seconds(), 31e-6), "{}", d.host_issue_seconds());
    assert!(close(s.clock(), 34e-6), "{}", s.clock());
    // A copy of one piece through copy_2d is one operation, no piece cost.
    s.copy_2d(src.view(), dst.view(), piece(0)).unwrap();
    assert!(close(d.host_issue_seconds(), 32e-6) && close(s.clock(), 35e-6), "{}", s.clock());
}

#[test]
fn events_carry_clocks_between_streams_and_the_host_waits() {
    let d = device(0);
    let (a, b) = (d.create_stream(Priority::Normal).unwrap(), d.create_stream(Priority::High).unwrap());
    let x = d.alloc(DType::F32, 250).unwrap(); // 1000 bytes
    a.fill(x.view(), chorus_devices::Scalar::Float(0.0)).unwrap(); // 1 µs on a
    let e = d.create_event().unwrap();
    a.record(&e).unwrap();
    b.fill(x.view(), chorus_devices::Scalar::Float(1.0)).unwrap(); // b runs 0..1 µs, not after a
    assert!(close(b.clock(), 1e-6));
    b.wait(&e).unwrap();
    b.scale(x.view(), 2.0).unwrap(); // 2000 bytes after a's fill: 1..3 µs
    assert!(close(b.clock(), 3e-6), "{}", b.clock());
    assert!(close(a.clock(), 1e-6));
    // A host readback waits for its stream; work enqueued later starts after it.
    let v: Vec<f32> = b.read_vec(x.view()).unwrap();
    assert_eq!(v, vec![0.0; 250]);
    assert!(close(d.host_clock(), 4e-6), "{}", d.host_clock());
    a.fill(x.view(), chorus_devices::Scalar::Float(0.0)).unwrap();
    assert!(close(a.clock(), 5e-6), "{}", a.clock());
}

/// A deferred readback runs in its stream's order but the host does not wait
/// for it; the host waits where the caller says (an event after it).
#[test]
fn a_deferred_readback_leaves_the_host_until_it_waits() {
    use chorus_devices::Event as _;
    let d = device(0);
    let s = d.create_stream(Priority::Normal).unwrap();
    let x = d.alloc(DType::F32, 250).unwrap(); // 1000 bytes
    s.fill(x.view(), chorus_devices::Scalar::Float(0.0)).unwrap(); // 0..1 µs
    d.set_deferred_readbacks(true);
    let host = d.host_clock();
    let _pending = s.copy_to_host(x.view()).unwrap();
    assert!(close(d.host_clock(), host), "the host waited for a deferred readback: {}", d.host_clock());
    let end = s.clock();
    assert!(end > 1e-6, "the copy ran after the fill: {end}");
    let e = d.create_event().unwrap();
    s.record(&e).unwrap();
    e.synchronize().unwrap();
    assert!(close(d.host_clock(), end), "{} vs {end}", d.host_clock());
    // Off again: a readback is a blocking read.
    d.set_deferred_readbacks(false);
    let _done = s.copy_to_host(x.view()).unwrap();
    assert!(close(d.host_clock(), s.clock()), "{} vs {}", d.host_clock(), s.clock());
}

#[test]
fn a_collective_starts_at_the_last_arrival_and_every_rank_ends_together() {
    let (_, ends) = on_every_rank(2, Duration::from_secs(10), |r, d, c| {
        let st = d.create_stream(Priority::Normal).unwrap();
        let x = d.alloc(DType::F32, 250).unwrap();
        // Rank 1 computes 1 µs longer before the all-reduce.
        for _ in 0..=r {
            st.fill(x.view(), chorus_devices::Scalar::Float(0.0)).unwrap();
        }
        c.all_reduce_in_place(x.view(), chorus_collectives::ReduceOp::Sum, &st).unwrap();
        st.clock()
    });
    // Last arrival at 2 µs, then 1000 bytes at 1 µs/byte.
    assert!(ends.iter().all(|e| close(*e, 2e-6 + 1000e-6)), "{ends:?}");
}

#[test]
fn ranks_that_call_different_collectives_fail_with_the_first_divergence_instead_of_hanging() {
    let (world, results) = on_every_rank(3, Duration::from_secs(30), |r, d, c| -> Result<(), CommError> {
        let st = d.create_stream(Priority::Normal).unwrap();
        let x = d.alloc(DType::F32, 8).unwrap();
        let r0 = c.all_reduce_in_place(x.view(), chorus_collectives::ReduceOp::Sum, &st);
        // Rank 2 gathers 4 elements where the others gather 8... after rank 1 has ended.
        match r {
            1 => r0,
            2 => r0.and_then(|_| c.all_gather(x.slice(0, 2).unwrap(), x.slice(0, 6).unwrap(), &st)),
            _ => r0.and_then(|_| c.all_reduce_in_place(x.view(), chorus_collectives::ReduceOp::Sum, &st)),
        }
    });
    assert!(results[1].is_ok());
    assert!(results[0].is_err() && results[2].is_err(), "{results:?}");
    let d = world.divergence().unwrap();
    assert_eq!((d.group.as_str(), d.seq), ("root", 1));
    assert!(d.to_string().contains("call #1"), "{d}");
}

#[test]
fn split_makes_communicators_named_as_the_flight_recorder_names_them() {
    let (_, got) = on_every_rank(4, Duration::from_secs(10), |r, _, c| {
        let sub =
            chorus_collectives::CommBackend::split(c.backend(), Some((r % 2) as u32), -(r as i64)).unwrap().unwrap();
        (sub.id().to_string(), chorus_collectives::CommBackend::rank(&sub), chorus_collectives::CommBackend::size(&sub))
    });
    // Keys are minus the rank, so the higher rank comes first.
    assert_eq!(got[0], ("root/split0:color0".to_string(), 1, 2));
    assert_eq!(got[2], ("root/split0:color0".to_string(), 0, 2));
    assert_eq!(got[3], ("root/split0:color1".to_string(), 0, 2));
}

/// Rank 0 all-reduces on a fresh world of two; `other` is what rank 1 does meanwhile.
fn lone_all_reduce(timeout: Duration, other: impl FnOnce(&Arc<VirtWorld>) + Send) -> (Result<(), CommError>, Duration) {
    let world = VirtWorld::new(2, Arc::new(Unit), timeout);
    std::thread::scope(|s| {
        let w = world.clone();
        let h = s.spawn(move || {
            let d = device(0);
            let c = Communicator::with_recorder(
                w.communicator(0, d.clone(), Arc::new(Mutex::new(Vec::new()))).unwrap(),
                &RecorderOptions::off(),
            );
            let st = d.create_stream(Priority::Normal).unwrap();
            let x = d.alloc(DType::F32, 8).unwrap();
            let t0 = std::time::Instant::now();
            let r = c.all_reduce_in_place(x.view(), chorus_collectives::ReduceOp::Sum, &st);
            (r, t0.elapsed())
        });
        other(&world);
        h.join().unwrap()
    })
}

#[test]
fn a_rank_that_ends_while_another_waits_for_it_fails_the_wait_at_once() {
    let (r, took) = lone_all_reduce(Duration::from_secs(60), |w| {
        std::thread::sleep(Duration::from_millis(50));
        w.rank_ended(1);
    });
    let e = r.unwrap_err().to_string();
    assert!(e.contains("rank 1 called nothing (its run ended)") && e.contains("rank 0 called all_reduce"), "{e}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn a_rank_that_never_arrives_nor_ends_is_named_at_the_deadline() {
    let (r, _) = lone_all_reduce(Duration::from_millis(200), |_| {});
    match r.unwrap_err() {
        CommError::Timeout { missing, .. } => assert_eq!(missing, vec![1]),
        e => panic!("{e}"),
    }
}
