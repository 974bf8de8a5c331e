//! The flight recorder end to end: a mismatch, a call one rank never
//! issues, and a rank whose stream is stalled, each injected on purpose;
//! every rank's dump is read by `chorus trace`, which must name the rank
//! and call. On sim (ranks as threads of this test) and, with the `ucx`
//! feature, on UCX (ranks as processes under `chorus launch`: this test
//! binary's `ucx_rank`).

use crate::common;

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus_collectives::recorder::RecorderOptions;
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::{CommBackend, Communicator, ReduceOp};
use chorus_devices::cpu::Cpu;
use chorus_devices::{Buffer, DType, Device, Priority, Stream};
use common::{chorus, run_bounded, scratch, text};

/// What goes wrong at collective #3 (after three good all-reduces).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    /// Rank 1 all-reduces 4 elements, the others 8.
    Mismatch,
    /// Rank 1 never issues #3; its host waits elsewhere.
    Missing,
    /// Rank 1 issues #3 behind a host function that holds its stream.
    Stalled,
}

impl Case {
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    fn parse(s: &str) -> Case {
        match s {
            "mismatch" => Case::Mismatch,
            "missing" => Case::Missing,
            "stalled" => Case::Stalled,
            other => panic!("unknown case {other}"),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Case::Mismatch => "mismatch",
            Case::Missing => "missing",
            Case::Stalled => "stalled",
        }
    }
    /// The line `chorus trace` must print for a job of `world` ranks.
    fn verdict(self, world: usize) -> String {
        // The ranks other than the culprit (1), as `chorus trace` writes them.
        let others = if world == 3 { "ranks 0,2" } else { "ranks 0,2-3" };
        let line = match self {
            Case::Mismatch => {
                "MISMATCH at #3: rank 1 called all_reduce(4 x f32, sum); ranks 0,2 called all_reduce(8 x f32, sum)"
            }
            Case::Missing => {
                "NEVER REACHED: rank 1 never issued #3 all_reduce(8 x f32, sum), which ranks 0,2 are blocked in \
                 (rank 1's last call: #2 all_reduce(8 x f32, sum) completed)"
            }
            Case::Stalled => {
                "STALLED: rank 1 issued #3 all_reduce(8 x f32, sum) but its stream never reached it (stalled by \
                 earlier work)"
            }
        };
        line.replace("ranks 0,2", others)
    }
}

/// One rank's program. `idle` is how rank 1 waits where it stalls: until
/// the job has failed (sim: the world's abort), or until it is stopped.
fn rank_body<C: CommBackend<B = Cpu>>(comm: &Communicator<C>, case: Case, idle: &dyn Fn(&Communicator<C>)) {
    let dev = comm.device();
    let s = dev.create_stream(Priority::Normal).unwrap();
    let buf = dev.alloc(DType::F32, 8).unwrap();
    for _ in 0..3 {
        comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s).unwrap();
    }
    s.synchronize().unwrap();
    let me = comm.rank();
    match (case, me) {
        (Case::Mismatch, 1) => comm.all_reduce_in_place(buf.slice(0, 4).unwrap(), ReduceOp::Sum, &s).unwrap(),
        (Case::Missing, 1) => {
            idle(comm);
            return;
        }
        (Case::Stalled, 1) => {
            let (release, held) = mpsc::channel::<()>();
            s.launch_host_fn(Box::new(move |_| {
                let _ = held.recv_timeout(Duration::from_secs(60));
            }))
            .unwrap();
            comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s).unwrap();
            idle(comm);
            let _ = release.send(());
        }
        _ => comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s).unwrap(),
    }
    assert!(s.synchronize().is_err(), "rank {me}: #3 should fail ({case:?})");
}

/// Waits (at most 30 s) until `dir` holds `n` dumps.
fn wait_for_dumps(dir: &Path, n: usize) {
    let start = Instant::now();
    let count = || {
        std::fs::read_dir(dir).map_or(0, |r| {
            r.filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".json"))).count()
        })
    };
    while count() < n {
        assert!(start.elapsed() < Duration::from_secs(30), "{} of {n} dumps in {}", count(), dir.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `chorus trace DIR`'s text, checked to contain the case's verdict; and
/// its JSON, checked to parse and to carry the same verdict.
fn trace_names_the_culprit(dir: &Path, case: Case, world: usize) {
    let expected = case.verdict(world);
    let out = run_bounded(chorus().arg("trace").arg(dir), Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains(&expected), "{case:?}: {stdout}");
    let out = run_bounded(chorus().arg("trace").arg("--json").arg(dir), Duration::from_secs(60));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let verdict: Vec<String> = serde_json::from_value(json["verdict"].clone()).unwrap();
    assert!(verdict.iter().any(|l| l.starts_with(&expected)), "{case:?}: {verdict:?}");
}

fn sim_case(case: Case) {
    let dir = scratch(&format!("recorder-sim-{}", case.name())).join("trace");
    let world = SimWorld::new(3, SimConfig { timeout: Duration::from_secs(1), ..SimConfig::default() }).unwrap();
    let options = RecorderOptions { entries: 64, dump_dir: Some(dir.clone()), track_starts: case == Case::Stalled };
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let comm = Communicator::with_recorder(world.communicator(r).unwrap().into_backend(), &options);
            let dir = dir.clone();
            std::thread::spawn(move || {
                // Rank 1 waits where it stalls until the others have failed
                // (the world's abort) and the dumps are written (a stalled
                // stream is not released by a peer's failure either).
                let idle = |c: &Communicator<chorus_collectives::sim::SimComm>| {
                    let start = Instant::now();
                    while c.async_error().is_none() {
                        assert!(start.elapsed() < Duration::from_secs(30), "the others never failed");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    wait_for_dumps(&dir, 3);
                };
                rank_body(&comm, case, &idle);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    wait_for_dumps(&dir, 3);
    trace_names_the_culprit(&dir, case, 3);
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn sim_a_mismatch_is_named() {
    sim_case(Case::Mismatch);
}

#[test]
fn sim_a_missing_call_is_named() {
    sim_case(Case::Missing);
}

#[test]
fn sim_a_stalled_rank_is_named() {
    sim_case(Case::Stalled);
}

#[test]
fn trace_refuses_what_is_not_a_directory_of_dumps() {
    let dir = scratch("recorder-bad");
    let out = run_bounded(chorus().arg("trace").arg(dir.join("absent")), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("is not a directory"), "{}", text(&out.stderr));
    let out = run_bounded(chorus().arg("trace").arg(&dir), Duration::from_secs(30));
    assert!(text(&out.stderr).contains("no flight-recorder dumps"), "{}", text(&out.stderr));
    std::fs::write(dir.join("rank00000-h.json"), b"{\"version\": 1}").unwrap();
    let out = run_bounded(chorus().arg("trace").arg(&dir), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("is not a chorus flight-recorder dump"), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A dump file of the fields `chorus trace` checks (no communicators).
fn dump_json(rank: u64, world_size: u64, host: &str, run: Option<(&str, u64)>) -> Vec<u8> {
    let mut d = serde_json::json!({
        "version": 1, "rank": rank, "world_size": world_size, "host": host, "pid": 1,
        "reason": "test", "dumped_us": 5, "communicators": []
    });
    if let Some((id, started)) = run {
        d["run_id"] = id.into();
        d["run_started_us"] = started.into();
    }
    serde_json::to_vec(&d).unwrap()
}

#[test]
fn trace_refuses_sizes_a_dump_cannot_have() {
    let dir = scratch("recorder-sizes");
    let cases = [
        (dump_json(0, 4_000_000_000, "h", None), "world_size 4000000000 is not a world chorus runs"),
        (dump_json(0, 0, "h", None), "world_size 0 is not a world chorus runs"),
        (dump_json(99, 4, "h", None), "rank 99 in a world of 4 ranks"),
    ];
    for (bytes, expected) in cases {
        std::fs::write(dir.join("rank00000-h.json"), bytes).unwrap();
        let out = run_bounded(chorus().arg("trace").arg(&dir), Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains(expected), "{expected}: {}", text(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trace_reads_the_latest_run_and_names_the_dumps_of_others() {
    let dir = scratch("recorder-runs");
    // Run A (started at 1000 s) left rank 0's dump from host a; run B, under the
    // same run id, has both ranks on host b.
    std::fs::write(dir.join("rank00000-a.json"), dump_json(0, 2, "a", Some(("job", 1_000_000_000)))).unwrap();
    std::fs::write(dir.join("rank00000-b.json"), dump_json(0, 2, "b", Some(("job", 2_000_000_000)))).unwrap();
    std::fs::write(dir.join("rank00001-b.json"), dump_json(1, 2, "b", Some(("job", 2_000_000_000)))).unwrap();
    let out = run_bounded(chorus().arg("trace").arg(&dir), Duration::from_secs(30));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("note: 1 dump(s) of run \"job\" started at 1000 (Unix time, s) left out: rank00000-a.json"),
        "{stdout}"
    );
    assert!(
        stdout.contains("2 dump(s) of run \"job\" started at 2000 (Unix time, s) of a world of 2 ranks"),
        "{stdout}"
    );
    let out = run_bounded(chorus().arg("trace").arg("--json").arg(&dir), Duration::from_secs(30));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["dumps"].as_array().map(Vec::len), Some(2));
    assert_eq!(json["other_runs"].as_array().map(Vec::len), Some(1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process whose two sim ranks are healthy but not done: rank 0 waits in
/// an all-reduce that rank 1 has not issued yet (the world's timeout is two
/// minutes). What the signal tests interrupt; prints `READY` when waiting.
#[test]
#[ignore = "started by the signal tests, in a child process"]
fn signal_child() {
    let world = SimWorld::new(2, SimConfig { timeout: Duration::from_secs(120), ..SimConfig::default() }).unwrap();
    let comms: Vec<_> = (0..2).map(|r| Communicator::new(world.communicator(r).unwrap().into_backend())).collect();
    let c = &comms[0];
    let s = c.device().create_stream(Priority::Normal).unwrap();
    let buf = c.device().alloc(DType::F32, 8).unwrap();
    c.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s).unwrap();
    println!("READY");
    std::thread::sleep(Duration::from_secs(60));
}

/// Starts [`signal_child`] with the dump signals at their defaults and
/// `CHORUS_TRACE_DIR` set to `dir` (or unset); returns it and its pid once it
/// is waiting, with its stderr lines as they come.
fn start_signal_child(dir: Option<&Path>) -> (std::process::Child, mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", &this_test!("signal_child"), "--ignored", "--nocapture", "--test-threads", "1"])
        .env_remove("CHORUS_TRACE_DIR")
        .env_remove("TORCHELASTIC_RUN_ID")
        .env_remove("CHORUS_RUN_STARTED_US")
        .env_remove("CHORUS_FLIGHT_RECORDER_ENTRIES")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Some(dir) = dir {
        cmd.env("CHORUS_TRACE_DIR", dir);
    }
    common::default_signals(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let (ready_tx, ready) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if line.contains("READY") {
                let _ = ready_tx.send(());
            }
        }
    });
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    if ready.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        panic!("the signal child never got ready");
    }
    (child, lines)
}

/// Waits at most `limit` for `child` to end; how it ended and when.
fn ended_within(child: &mut std::process::Child, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, start.elapsed());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running {limit:?} after the signal");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigterm_dumps_a_snapshot_and_ends_the_process_by_sigterm() {
    use std::os::unix::process::ExitStatusExt;
    let dir = scratch("recorder-sigterm").join("trace");
    let (mut child, _) = start_signal_child(Some(&dir));
    // SAFETY: kill(2) on the child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let (status, took) = ended_within(&mut child, Duration::from_secs(20));
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    wait_for_dumps(&dir, 2);
    let out = run_bounded(chorus().arg("trace").arg(&dir), Duration::from_secs(30));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("SNAPSHOT: every dump was taken on a signal (signal SIGTERM)"), "{stdout}");
    assert!(stdout.contains("NOT YET REACHED: rank 1 had not issued #0 all_reduce(8 x f32, sum)"), "{stdout}");
    assert!(!stdout.contains("NEVER REACHED"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn sigterm_ends_the_process_within_seconds_when_the_dump_hangs() {
    use std::os::unix::process::ExitStatusExt;
    let dir = scratch("recorder-sigterm-hung").join("trace");
    std::fs::create_dir_all(&dir).unwrap();
    let (mut child, lines) = start_signal_child(Some(&dir));
    // The dumps' temporary files are FIFOs nobody reads: writing them blocks
    // as on a hung file system.
    let host = chorus_collectives::recorder::host_name();
    for rank in 0..2 {
        let name = format!(".rank{rank:05}-{host}.json.{}.tmp", child.id());
        let path = std::ffi::CString::new(dir.join(name).into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "{}", std::io::Error::last_os_error());
    }
    // SAFETY: kill(2) on the child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let (status, took) = ended_within(&mut child, Duration::from_secs(30));
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    let wait = chorus_collectives::recorder::DUMP_WAIT;
    assert!(took >= wait && took < wait + Duration::from_secs(3), "{took:?}");
    // The child is gone: its stderr ends, and the reader with it.
    let mut said = Vec::new();
    while let Ok(line) = lines.recv_timeout(Duration::from_secs(10)) {
        said.push(line);
    }
    assert!(said.iter().any(|l| l.contains("did not finish within 3 s")), "{said:?}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn sigusr1_without_a_dump_directory_says_so_and_the_run_goes_on() {
    use std::os::unix::process::ExitStatusExt;
    let (mut child, lines) = start_signal_child(None);
    // SAFETY: kill(2) on the child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGUSR1) };
    let line = lines.recv_timeout(Duration::from_secs(20)).expect("a line on stderr");
    assert!(line.contains("SIGUSR1: no flight-recorder dump written (CHORUS_TRACE_DIR is not set)"), "{line}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(child.try_wait().unwrap().is_none(), "SIGUSR1 ended the process");
    // Without a dump directory SIGTERM keeps its default action.
    // SAFETY: kill(2) on the child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let (status, _) = ended_within(&mut child, Duration::from_secs(20));
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
}

#[cfg(feature = "ucx")]
mod ucx {
    use super::*;
    use crate::common::{free_port, wait_bounded};
    use chorus_collectives::bootstrap::{connect_from_env, ConnectOptions, LaunchEnv};
    use chorus_collectives::ucx::{UcxComm, UcxConfig};
    use chorus_devices::cpu::{CpuConfig, CpuDevice};
    use std::process::Stdio;

    /// One rank of a UCX case, under `chorus launch` (which gives it
    /// `CHORUS_TRACE_DIR`); the case is `CHORUS_RECORDER_CASE`.
    #[test]
    #[ignore = "a rank of the UCX cases, started by them under chorus launch"]
    fn ucx_rank() {
        let case = Case::parse(&std::env::var("CHORUS_RECORDER_CASE").unwrap());
        let env = LaunchEnv::from_process_env().unwrap();
        let rdzv = connect_from_env(&env, &ConnectOptions::default()).unwrap();
        let config =
            UcxConfig { timeout: Duration::from_secs(3), prefix: "recorder-test".into(), ..Default::default() };
        let device = CpuDevice::new(CpuConfig::default().with_ordinal(env.rank).with_timeout(Duration::from_secs(20)));
        let comm = UcxComm::init(rdzv.store(), env.rank, env.world_size, device, config).unwrap();
        // Rank 1 stalls until the launcher stops it (SIGTERM, on which it dumps).
        let idle = |_: &Communicator<UcxComm>| std::thread::sleep(Duration::from_secs(60));
        rank_body(&comm, case, &idle);
        // #3 failed here as the case intends: the rank fails, as a real job's
        // would, so the launcher stops the others (the dump is written at exit).
        std::process::exit(1);
    }

    fn ucx_case(case: Case) {
        let dir = scratch(&format!("recorder-ucx-{}", case.name()));
        let trace = dir.join("trace");
        let exe = std::env::current_exe().unwrap();
        let mut launch = chorus();
        launch
            .args(["launch", "--nproc-per-node", "3", "--grace", "20", "--", exe.to_str().unwrap()])
            .args(["--exact", &this_test!("ucx_rank"), "--ignored", "--nocapture", "--test-threads", "1"])
            .env("CHORUS_TRACE_DIR", &trace)
            .env("CHORUS_RECORDER_CASE", case.name());
        if case == Case::Stalled {
            launch.env("CHORUS_FLIGHT_RECORDER_STARTS", "1");
        }
        let out = run_bounded(&mut launch, Duration::from_secs(120));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(&format!("flight-recorder dumps are in {}", trace.display())), "{err}");
        wait_for_dumps(&trace, 3);
        trace_names_the_culprit(&trace, case, 3);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ucx_a_mismatch_is_named() {
        ucx_case(Case::Mismatch);
    }

    #[test]
    fn ucx_a_missing_call_is_named() {
        ucx_case(Case::Missing);
    }

    #[test]
    fn ucx_a_stalled_rank_is_named() {
        ucx_case(Case::Stalled);
    }

    /// Two nodes (launchers on loopback), each with its own dump directory,
    /// as on two hosts: each launcher fetches the other node's dumps, so
    /// `chorus trace` on either directory names the culprit (rank 1, node 0).
    #[test]
    fn ucx_each_node_gathers_every_nodes_dumps() {
        let dir = scratch("recorder-ucx-two-nodes");
        let exe = std::env::current_exe().unwrap();
        let port = free_port().to_string();
        let node = |n: usize| {
            let mut launch = chorus();
            launch
                .args(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", &n.to_string()])
                .args(["--master-port", &port, "--grace", "20", "--timeout", "60", "--", exe.to_str().unwrap()])
                .args(["--exact", &this_test!("ucx_rank"), "--ignored", "--nocapture", "--test-threads", "1"])
                .env("CHORUS_TRACE_DIR", dir.join(format!("trace{n}")))
                .env("CHORUS_RECORDER_CASE", Case::Mismatch.name())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            launch.spawn().unwrap()
        };
        let (n0, n1) = (node(0), node(1));
        let (o0, o1) = (wait_bounded(n0, Duration::from_secs(120)), wait_bounded(n1, Duration::from_secs(120)));
        for (n, out) in [(0, &o0), (1, &o1)] {
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "node {n}: {err}");
            assert!(err.contains("fetched 2 flight-recorder dumps of the other nodes"), "node {n}: {err}");
            let trace = dir.join(format!("trace{n}"));
            let names: Vec<String> = std::fs::read_dir(&trace)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect();
            assert_eq!(names.len(), 4, "node {n}: {names:?}");
            trace_names_the_culprit(&trace, Case::Mismatch, 4);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
