//! The UCX communicator's own tests: joining, scratch memory, and how a
//! rank that leaves the job is seen by the others (in this process and
//! one rank per process).

use std::time::{Duration, Instant};

use chorus_devices::cpu::{CpuConfig, CpuDevice};

use super::*;
use crate::bootstrap::MemStore;

/// Rank `rank` of 2 joins, after `delay`, with the default config;
/// how long its `init` took.
fn join(
    store: &Arc<dyn Store>,
    rank: usize,
    delay: Duration,
) -> std::thread::JoinHandle<(Communicator<UcxComm>, Duration)> {
    let store = store.clone();
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let device = CpuDevice::new(CpuConfig::default().with_ordinal(rank));
        let start = Instant::now();
        let config = UcxConfig { timeout: Duration::from_secs(20), ..UcxConfig::default() };
        let comm = UcxComm::init(store, rank, 2, device, config).unwrap();
        (comm, start.elapsed())
    })
}

/// The scratch a ring all-reduce uses is counted while it lives (in the
/// pool between calls), reused by the next call, and freed on release.
#[test]
fn scratch_memory_is_counted_reused_and_released() {
    use chorus_devices::{Buffer, Device, Priority, StreamExt};
    const COUNT: usize = 256 * 1024; // 1 MiB of f32: over small_bytes, so the ring
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let ranks = [join(&store, 0, Duration::ZERO), join(&store, 1, Duration::ZERO)];
    let results: Vec<_> = ranks
        .map(|t| {
            std::thread::spawn(move || {
                let (comm, _) = t.join().unwrap();
                let s = comm.device().create_stream(Priority::Normal).unwrap();
                let buf = s.buffer_from(&vec![1.0f32; COUNT]).unwrap();
                let mut seen = Vec::new();
                for want in [2.0f32, 4.0] {
                    comm.all_reduce_in_place(buf.view(), crate::ReduceOp::Sum, &s).unwrap();
                    let out = s.read_vec::<f32>(buf.view()).unwrap();
                    assert!(out.iter().all(|v| *v == want));
                    seen.push(comm.backend().scratch_memory());
                }
                let released = comm.backend().release_scratch();
                (seen, released, comm.backend().scratch_memory())
            })
        })
        .into_iter()
        .collect();
    // Each rank: its reduced half (512 KiB) and two ring buffers of a half
    // each, and the hello's inbox (one 512-byte slot, the 4 KiB minimum).
    let expected = 3 * 512 * 1024 + 4096;
    for r in results {
        let (seen, released, after) = r.join().unwrap();
        for stats in &seen {
            assert_eq!(stats.bytes_in_use, expected, "{seen:?}");
            assert_eq!(stats.live_allocations, 4, "{seen:?}");
        }
        assert_eq!(seen[1].peak_bytes, expected, "the second call reused the first one's buffers");
        assert_eq!(released, expected);
        assert_eq!((after.bytes_in_use, after.live_allocations), (0, 0));
    }
}

#[test]
fn a_second_world_in_the_same_store_waits_for_its_own_ranks() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let first = [join(&store, 0, Duration::ZERO), join(&store, 1, Duration::ZERO)];
    drop(first.map(|t| t.join().unwrap()));
    // The second world's rank 1 comes late: rank 0 must wait for it, not
    // take the first world's address and count of connected ranks.
    let late = Duration::from_millis(400);
    let second = [join(&store, 0, Duration::ZERO), join(&store, 1, late)];
    let [(_c0, took), (_c1, _)] = second.map(|t| t.join().unwrap());
    assert!(took >= late - Duration::from_millis(50), "rank 0 joined in {took:?}, before rank 1 came");
}

/// The deadline of the worlds below: a failure that comes well before it
/// was not found by it.
const LONG_DEADLINE: Duration = Duration::from_secs(60);

/// Within how long the ranks waiting for a rank that failed outside the
/// communicator must fail (the leave grace and a loaded machine's slack).
const SECONDS: Duration = Duration::from_secs(10);

/// Rank `rank` of `size` joins through `store` under `prefix`, with [`LONG_DEADLINE`].
fn join_world(store: Arc<dyn Store>, rank: usize, size: usize, prefix: &str) -> Communicator<UcxComm> {
    let device = CpuDevice::new(CpuConfig::default().with_ordinal(rank));
    let config = UcxConfig { timeout: LONG_DEADLINE, prefix: prefix.into(), ..UcxConfig::default() };
    UcxComm::init(store, rank, size, device, config).unwrap()
}

/// How a rank fails outside its communicator.
#[derive(Clone, Copy, Debug)]
enum Failing {
    /// Its code returns an error: the communicator is dropped as usual.
    Returns,
    /// Its code panics: the communicator is dropped while the thread unwinds.
    Panics,
}

/// Waits `delay` (the others are then in their all-reduce), then fails
/// `how`, with `comm` alive until then.
fn fail_outside(comm: Communicator<UcxComm>, how: Failing, delay: Duration) {
    std::thread::sleep(delay);
    match how {
        Failing::Returns => drop(comm),
        Failing::Panics => panic!("the rank's own code failed (world rank {})", comm.backend().world_rank()),
    }
}

/// An all-reduce that the failing rank never joins: how long it took to
/// fail, and its error.
fn all_reduce_without_the_failing_rank(comm: &Communicator<UcxComm>) -> (Duration, String) {
    use chorus_devices::{Buffer, Device, Priority, StreamExt};
    let s = comm.device().create_stream(Priority::Normal).unwrap();
    let buf = s.buffer_from(&[1.0f32; 64]).unwrap();
    let start = Instant::now();
    let r = comm.all_reduce_in_place(buf.view(), crate::ReduceOp::Sum, &s).and_then(|_| Ok(s.synchronize()?));
    (start.elapsed(), r.expect_err("an all-reduce without one of its ranks succeeded").to_string())
}

/// The error of a rank that waited for `culprit`, who failed `how`.
fn check_failed_in_time(waited: Duration, error: &str, how: Failing, culprit: usize) {
    let cause = match how {
        Failing::Returns => format!("world rank {culprit} left the job"),
        Failing::Panics => format!("world rank {culprit} failed outside the communicator (it panicked)"),
    };
    assert!(error.contains(&cause), "{how:?}: {error}");
    assert!(waited < SECONDS, "{how:?}: failed after {waited:?} (deadline {LONG_DEADLINE:?}): {error}");
}

/// Rank 2 of 3 fails outside the communicator while ranks 0 and 1 wait
/// for it in an all-reduce: they fail within seconds, not at the deadline,
/// saying why (ranks as threads of this process).
#[test]
fn a_rank_that_fails_outside_the_communicator_fails_the_others_within_seconds() {
    for how in [Failing::Returns, Failing::Panics] {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let comm = join_world(store, rank, 3, "leave");
                    if rank == 2 {
                        fail_outside(comm, how, Duration::from_millis(300));
                        None
                    } else {
                        Some(all_reduce_without_the_failing_rank(&comm))
                    }
                })
            })
            .collect();
        for (rank, t) in ranks.into_iter().enumerate() {
            match (rank, t.join()) {
                (2, Ok(_)) => assert!(matches!(how, Failing::Returns), "rank 2 did not panic"),
                (2, Err(_)) => assert!(matches!(how, Failing::Panics), "rank 2 panicked"),
                (_, Ok(Some((waited, error)))) => check_failed_in_time(waited, &error, how, 2),
                (_, other) => panic!("rank {rank}: {other:?}"),
            }
        }
    }
}

/// The environment of [`one_rank_of_a_process_world`]: the store's port,
/// this process's rank, how rank 2 fails.
const CHILD_VARS: [&str; 3] = ["CHORUS_TEST_UCX_STORE_PORT", "CHORUS_TEST_UCX_RANK", "CHORUS_TEST_UCX_FAILING"];

/// One rank per process: rank 2 of 3 fails outside the communicator while
/// ranks 0 and 1 wait for it; they fail within seconds, saying why.
#[test]
fn a_rank_process_that_fails_outside_the_communicator_fails_the_others_within_seconds() {
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe().unwrap();
    for how in [Failing::Returns, Failing::Panics] {
        let server = crate::bootstrap::TcpStoreServer::bind_loopback(0).unwrap();
        let mut children: Vec<_> = (0..3)
            .map(|rank| {
                let mut cmd = Command::new(&exe);
                cmd.args(["--exact", "ucx::tests::one_rank_of_a_process_world", "--ignored", "--nocapture"]);
                cmd.env(CHILD_VARS[0], server.port().to_string())
                    .env(CHILD_VARS[1], rank.to_string())
                    .env(CHILD_VARS[2], format!("{how:?}"))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                cmd.spawn().unwrap()
            })
            .collect();
        // Every child ends within the deadline of a world that failed in
        // seconds, or is killed (and the test fails).
        let limit = Instant::now() + LONG_DEADLINE + SECONDS;
        while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(50));
        }
        let outputs: Vec<_> = children
            .into_iter()
            .map(|mut c| {
                let _ = c.kill();
                c.wait_with_output().unwrap()
            })
            .collect();
        for (rank, out) in outputs.iter().enumerate().take(2) {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            let line = stdout
                .lines()
                .find_map(|l| l.strip_prefix("RANK-RESULT "))
                .unwrap_or_else(|| panic!("{how:?}: rank {rank} reported nothing\n{stdout}\n{stderr}"));
            let (millis, error) = line.split_once(' ').unwrap();
            check_failed_in_time(Duration::from_millis(millis.parse().unwrap()), error, how, 2);
        }
        let culprit = String::from_utf8_lossy(&outputs[2].stdout);
        assert!(culprit.contains("RANK-FAILING"), "{how:?}: rank 2 never got to fail\n{culprit}");
    }
}

/// Run by the test above, in a child process: one rank of its world.
#[test]
#[ignore = "run by a_rank_process_that_fails_outside_the_communicator_fails_the_others_within_seconds, in a child process"]
fn one_rank_of_a_process_world() {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is unset: this test runs in a child process"));
    let port: u16 = var(CHILD_VARS[0]).parse().unwrap();
    let rank: usize = var(CHILD_VARS[1]).parse().unwrap();
    let how = match var(CHILD_VARS[2]).as_str() {
        "Returns" => Failing::Returns,
        "Panics" => Failing::Panics,
        other => panic!("{other}: not a way to fail"),
    };
    let options = crate::bootstrap::ClientOptions::default();
    let store: Arc<dyn Store> = Arc::new(crate::bootstrap::TcpStore::connect("127.0.0.1", port, options).unwrap());
    let comm = join_world(store, rank, 3, "leave");
    if rank == 2 {
        println!("RANK-FAILING {how:?}");
        fail_outside(comm, how, Duration::from_millis(300));
    } else {
        let (waited, error) = all_reduce_without_the_failing_rank(&comm);
        println!("RANK-RESULT {} {}", waited.as_millis(), error.replace('\n', " "));
    }
}
