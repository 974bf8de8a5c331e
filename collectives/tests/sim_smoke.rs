//! Quick checks of the sim backend's plumbing; the full suite lives in `conformance/`.

use std::time::Duration;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::{CommError, ReduceOp};
use chorus_devices::{Buffer, Device, Priority, Stream, StreamExt};

#[test]
fn all_reduce_all_gather_and_p2p_on_four_ranks() -> anyhow::Result<()> {
    let results = SimWorld::run(4, SimConfig::default(), |comm| -> anyhow::Result<()> {
        let (r, n) = (comm.rank(), comm.size());
        let s = comm.device().create_stream(Priority::Normal)?;
        let x: Vec<f32> = (0..10).map(|i| (i + r) as f32).collect();
        let send = s.buffer_from(&x)?;
        let recv = s.alloc(chorus_devices::DType::F32, 10)?;
        comm.all_reduce(send.view(), recv.view(), ReduceOp::Sum, &s)?;
        let got: Vec<f32> = s.read_vec(recv.view())?;
        let want: Vec<f32> = (0..10).map(|i| (n * i + n * (n - 1) / 2) as f32).collect();
        assert_eq!(got, want);

        let gathered = s.alloc(chorus_devices::DType::F32, 10 * n)?;
        comm.all_gather(send.view(), gathered.view(), &s)?;
        let got: Vec<f32> = s.read_vec(gathered.view())?;
        let want: Vec<f32> = (0..n).flat_map(|q| (0..10).map(move |i| (i + q) as f32)).collect();
        assert_eq!(got, want);

        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let inbox = s.alloc(chorus_devices::DType::F32, 10)?;
        comm.group(&s, |g| {
            g.send(send.view(), next)?;
            g.recv(inbox.view(), prev)
        })?;
        let got: Vec<f32> = s.read_vec(inbox.view())?;
        assert_eq!(got, (0..10).map(|i| (i + prev) as f32).collect::<Vec<_>>());
        Ok(())
    })?;
    for r in results {
        r??;
    }
    Ok(())
}

#[test]
fn a_missing_rank_times_out_everywhere() -> anyhow::Result<()> {
    let config = SimConfig { timeout: Duration::from_millis(300), ..SimConfig::default() };
    let results = SimWorld::run(3, config, |comm| -> anyhow::Result<Option<CommError>> {
        let s = comm.device().create_stream(Priority::Normal)?;
        let b = s.buffer_from(&[1.0f32; 4])?;
        if comm.rank() != 2 {
            comm.all_reduce_in_place(b.view(), ReduceOp::Sum, &s)?;
        }
        Ok(s.synchronize().err().map(CommError::from))
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        let e = r??;
        if rank == 2 {
            assert!(e.is_none());
        } else {
            assert!(matches!(e, Some(CommError::Timeout { ref missing, .. }) if missing == &vec![2]), "{e:?}");
        }
    }
    Ok(())
}

/// Issue 43: where a rank's thread cannot start (the address space is full,
/// `ulimit -v`), `SimWorld::run` fails at once, and the ranks started before
/// it, waiting for it in a collective, are aborted and joined before the
/// error returns: none is left running. In a child process of this test,
/// whose address-space limit it lowers; bounded by a deadline.
#[test]
fn a_rank_thread_that_cannot_start_fails_the_world_at_once() {
    const NAME: &str = "a_rank_thread_that_cannot_start_fails_the_world_at_once";
    const CHILD: &str = "CHORUS_SIM_SPAWN_FAILURE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return spawn_failure_in_this_process();
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args(["--exact", &this_test!(NAME), "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        // One arena: the rank threads' stacks are then all that takes address space, and the first
        // that does not fit fails to start (a thread's arena taking it first would leave no room for
        // the signal stack Rust maps in the new thread, which aborts the process).
        .env("MALLOC_ARENA_MAX", "1")
        // No flight recorder: each rank's ring (1,024 launches, 216 KiB) is allocated when the rank
        // first calls, which on a loaded machine can be after the 32 stacks took the room, and
        // then an allocation aborts the process before a spawn fails.
        .env(chorus_collectives::recorder::ENTRIES_VAR, "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{:?}: {said}", out.status);
    assert!(said.contains("1 passed"), "the child ran the case: {said}");
}

fn spawn_failure_in_this_process() {
    let tasks = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let mapped = || -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let kb = status.lines().find_map(|l| l.strip_prefix("VmSize:")).and_then(|v| v.trim().strip_suffix("kB"));
        kb.and_then(|k| k.trim().parse::<u64>().ok()).unwrap() << 10
    };
    // The process-wide threads a world starts (the flight recorder's) are counted in `before`.
    let warm = SimWorld::run(2, SimConfig::default(), |comm| comm.split(Some(0), 0).map(drop));
    assert!(warm.unwrap().into_iter().all(|r| r.is_ok_and(|s| s.is_ok())));
    std::thread::sleep(Duration::from_millis(500));
    let before = tasks();
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // Room for about 32 rank threads' stacks (2 MiB each), and half of one more: the 33rd cannot
    // start. (The parent runs this with one malloc arena, so only the stacks take address space.)
    let room = (64 << 20) + (1 << 20);
    // SAFETY: getrlimit and setrlimit read and write the rlimit structs, which live for the calls.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_AS, &mut old), 0);
        let tight = libc::rlimit { rlim_cur: mapped() + room, rlim_max: old.rlim_max };
        assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &tight), 0);
    }
    let started = std::time::Instant::now();
    let config = SimConfig { timeout: Duration::from_secs(120), ..SimConfig::default() };
    // Every rank waits in a collective (a split) for all the others. 64 ranks, twice what fits: the
    // aborted ranks' errors list the ranks they missed, and with thousands of ranks those lists
    // (tens of kilobytes on each of 32 threads at once) would not fit in what is left, which made
    // this case abort in allocation, not fail the spawn, on a loaded machine.
    let result = SimWorld::run(64, config, |comm| comm.split(Some(0), 0).map(drop));
    let elapsed = started.elapsed();
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_AS, &old) };
    let err = result.expect_err("64 rank threads started in 65 MiB");
    assert!(err.to_string().contains("could not start"), "{err}");
    assert!(elapsed < Duration::from_secs(60), "waited {elapsed:?} for the ranks");
    assert_eq!(tasks(), before, "rank threads outlived the failed run");
}
