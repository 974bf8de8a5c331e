//! `chorus launch` end to end: the real binary starting real processes.
//! Every test is bounded (a launcher still running after its limit is
//! killed and the test fails).

use crate::common;
use crate::torch_python;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::{assert_all_dead, chorus, free_port, scratch, text, wait_bounded};

/// This machine's host name, which the launchers publish and their failure
/// summaries name (every node of these tests runs here).
fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string()
}

/// Starts `chorus launch` with `args`, its output captured.
fn spawn_launch(args: &[&str]) -> Child {
    chorus().arg("launch").args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn launch(args: &[&str], limit: Duration) -> Output {
    wait_bounded(spawn_launch(args), limit)
}

/// Starts node `rank` of a two-node job on this host (node 0 hosts the store
/// on `port`), with `nproc` ranks running `command`, its output captured.
fn node(port: &str, rank: &str, nproc: &str, extra: &[&str], command: &[&str]) -> Child {
    chorus()
        .args(["launch", "--nproc-per-node", nproc, "--nnodes", "2", "--node-rank", rank, "--master-port", port])
        .args(["--timeout", "20"])
        .args(extra)
        .arg("--")
        .args(command)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The pids the ranks wrote, once all `n` files exist (bounded).
fn pids(dir: &Path, n: usize) -> Vec<u32> {
    pids_in(dir, "pid", n)
}

/// The pids in the files `<name>.<rank>` of `dir`, once all `n` exist (bounded).
fn pids_in(dir: &Path, name: &str, n: usize) -> Vec<u32> {
    let start = Instant::now();
    loop {
        let found: Vec<u32> = (0..n)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("{name}.{r}"))).ok()?.trim().parse().ok())
            .collect();
        if found.len() == n {
            return found;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "ranks did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn every_line_of_every_rank_is_prefixed_and_ranks_get_torchruns_variables() {
    let script = "echo \"vars $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $TORCHELASTIC_USE_AGENT_STORE $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_RUN_ID\"; echo second line; echo to stderr >&2; printf 'no newline'";
    let out = launch(&["--nproc-per-node", "3", "--run-id", "job1", "--", "sh", "-c", script], Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for r in 0..3 {
        assert!(stdout.contains(&format!("[rank {r}] vars {r} 3 {r} 3 0 True 0 job1\n")), "{stdout}");
        assert!(stdout.contains(&format!("[rank {r}] second line\n")), "{stdout}");
        assert!(stdout.contains(&format!("[rank {r}] no newline\n")), "{stdout}");
        assert!(text(&out.stderr).contains(&format!("[rank {r}] to stderr\n")), "{}", text(&out.stderr));
    }
    assert_eq!(stdout.lines().count(), 9, "{stdout}");
    // MASTER_ADDR:MASTER_PORT is the store the launcher hosts.
    let out =
        launch(&["--nproc-per-node", "1", "--", "sh", "-c", "echo $MASTER_ADDR $MASTER_PORT"], Duration::from_secs(30));
    let line = text(&out.stdout);
    let port: u16 = line.trim().rsplit(' ').next().unwrap().parse().unwrap();
    assert!(line.starts_with("[rank 0] 127.0.0.1 ") && port != 0, "{line}");
}

#[test]
fn a_rank_exiting_non_zero_stops_the_others_and_is_named() {
    let dir = scratch("exit3");
    let script = format!(
        "echo $$ > {}/pid.$RANK; if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 60",
        dir.display()
    );
    let start = Instant::now();
    let child = spawn_launch(&["--nproc-per-node", "3", "--grace", "2", "--", "sh", "-c", &script]);
    let out = wait_bounded(child, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    assert!(start.elapsed() < Duration::from_secs(15));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!("failed: rank 1 (node 0 on host {}, local rank 1", this_host()))
            && stderr.contains("exited with code 3"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 0 (local rank 0") && stderr.contains("stopped by the launcher"), "{stderr}");
    assert_all_dead(&pids(&dir, 3));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_killed_by_a_signal_is_named() {
    let script = "if [ \"$RANK\" = 0 ]; then kill -KILL $$; fi; exec sleep 60";
    let out = launch(&["--nproc-per-node", "2", "--grace", "2", "--", "sh", "-c", script], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("failed: rank 0") && stderr.contains("was killed by signal 9 (SIGKILL)"), "{stderr}");
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank() {
    let dir = scratch("sigterm");
    // The ranks ignore SIGTERM, so the launcher must escalate to SIGKILL.
    let script = format!("trap '' TERM; echo $$ > {}/pid.$RANK; while true; do sleep 0.05; done", dir.display());
    let child = spawn_launch(&["--nproc-per-node", "2", "--grace", "0.5", "--", "sh", "-c", &script]);
    let pids = pids(&dir, 2);
    // SAFETY: kill(2) on the launcher's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = wait_bounded(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("received SIGTERM"), "{}", text(&out.stderr));
    assert_all_dead(&pids);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_launcher_takes_its_ranks_with_it() {
    let dir = scratch("sigkill");
    let script = format!("echo $$ > {}/pid.$RANK; exec sleep 60", dir.display());
    let mut child = spawn_launch(&["--nproc-per-node", "2", "--", "sh", "-c", &script]);
    let pids = pids(&dir, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_all_dead(&pids);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The children of `pid` (from /proc; empty once it is gone).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// The pids the launcher's failure summary names (`rank R (local rank L, pid P): ...`).
fn summary_pids(stderr: &str) -> Vec<u32> {
    stderr.lines().filter_map(|l| l.split_once(", pid ")?.1.split_once(')')?.0.parse().ok()).collect()
}

#[test]
fn a_killed_launcher_takes_what_its_ranks_started_with_it() {
    let dir = scratch("sigkill-tree");
    // Each rank starts a grandchild in its process group and waits for it.
    let script = format!("sleep 1000 & echo $! > {d}/child.$RANK; echo $$ > {d}/pid.$RANK; wait", d = dir.display());
    let mut child = spawn_launch(&["--nproc-per-node", "2", "--", "sh", "-c", &script]);
    let ranks = pids(&dir, 2);
    let grandchildren = pids_in(&dir, "child", 2);
    assert!(grandchildren.iter().all(|&p| common::alive(p)), "the grandchildren did not start");
    // The launcher's children: the ranks and its guardian.
    let guardian: Vec<u32> = children(child.id()).into_iter().filter(|p| !ranks.contains(p)).collect();
    child.kill().unwrap();
    child.wait().unwrap();
    assert_all_dead(&ranks);
    assert_all_dead(&grandchildren);
    // Its work done, the guardian is gone too.
    assert_eq!(guardian.len(), 1, "one guardian besides the ranks: {guardian:?}");
    assert_all_dead(&guardian);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn too_many_ranks_exit_2_before_anything_starts() {
    let dir = scratch("too-many");
    let marker = format!("touch {}/started", dir.display());
    for args in [
        vec!["--nproc-per-node", "100000", "--", "sh", "-c", &marker],
        // 1024 ranks and their launcher are one connection more than the store serves.
        vec!["--nproc-per-node", "1024", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "600", "--nnodes", "2", "--", "sh", "-c", &marker],
        // Two nodes: 2 x 511 ranks and each launcher's two connections (main
        // loop and heartbeat thread) are two more than the store serves.
        vec!["--nproc-per-node", "511", "--nnodes", "2", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--nnodes", "342", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--nnodes", "100000", "--", "sh", "-c", &marker],
    ] {
        let out = launch(&args, Duration::from_secs(10));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("store serves"), "{args:?}: {}", text(&out.stderr));
    }
    let out = launch(&["--nproc-per-node", "100000", "--", "true"], Duration::from_secs(10));
    assert!(text(&out.stderr).contains("at most 1023 ranks per node"), "{}", text(&out.stderr));
    let out = launch(&["--nproc-per-node", "600", "--nnodes", "2", "--", "true"], Duration::from_secs(10));
    assert!(text(&out.stderr).contains("at most 510 ranks per node on 2 node(s)"), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("two per launcher"), "{}", text(&out.stderr));
    assert!(!dir.join("started").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts `chorus launch` with the open-file limit set to `soft`/`hard`.
fn launch_with_open_files(soft: u64, hard: u64, args: &[&str]) -> Output {
    use std::os::unix::process::CommandExt;
    let mut command = chorus();
    command.arg("launch").args(args);
    // SAFETY: setrlimit is async-signal-safe and reads a local struct.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    common::run_bounded(&mut command, Duration::from_secs(60))
}

#[test]
fn the_launcher_raises_its_open_file_limit_and_the_ranks_get_theirs() {
    // 200 ranks hold 400 pipes in the launcher: more than 256 files.
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit fills the struct.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    assert!(
        limit.rlim_max >= 1024,
        "this test needs a hard open-file limit of 1024 (`ulimit -Hn`: {})",
        limit.rlim_max
    );
    let out = launch_with_open_files(
        256,
        limit.rlim_max.min(4096),
        &["--nproc-per-node", "200", "--", "sh", "-c", "ulimit -n"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for r in 0..200 {
        assert!(stdout.contains(&format!("[rank {r}] 256\n")), "rank {r}: {stdout}");
    }
    // A hard limit too low for them is refused before anything starts.
    let out = launch_with_open_files(256, 256, &["--nproc-per-node", "200", "--", "sh", "-c", "echo started"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("ulimit -Hn") && !text(&out.stdout).contains("started"));
}

#[test]
fn a_thousand_ranks_start_and_every_line_is_forwarded() {
    let out = common::run_bounded(
        chorus().args(["launch", "--nproc-per-node", "1000", "--", "sh", "-c", "echo rank $RANK"]),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1000);
    for r in 0..1000 {
        assert!(stdout.contains(&format!("[rank {r}] rank {r}\n")), "rank {r} missing");
    }
}

/// Runs 400 ranks whose rank 0 runs `first` and the others sleep; returns
/// the launcher's output once it has stopped every rank (bounded), after
/// checking that the start-up ended early and every started rank is gone.
fn start_up_ended_by(first: &str) -> Output {
    let script = format!("if [ \"$RANK\" = 0 ]; then {first}; fi; exec sleep 60");
    let out = common::run_bounded(
        chorus().args(["launch", "--nproc-per-node", "400", "--grace", "1", "--", "sh", "-c", &script]),
        Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    // Rank 0 acts within milliseconds; starting 400 ranks takes far longer.
    assert!(stderr.contains("..=399 (local ranks ") && stderr.contains("not started"), "{stderr}");
    let started = summary_pids(&stderr);
    assert!(!started.is_empty() && started.len() < 400, "{} ranks started", started.len());
    assert_all_dead(&started);
    out
}

#[test]
fn a_stop_signal_ends_the_start_up() {
    // The rank's parent is the launcher.
    let out = start_up_ended_by("kill -TERM $PPID");
    assert!(text(&out.stderr).contains("received SIGTERM"), "{}", text(&out.stderr));
}

#[test]
fn a_rank_failing_during_the_start_up_ends_it() {
    let out = start_up_ended_by("exit 3");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!("failed: rank 0 (node 0 on host {}, local rank 0", this_host()))
            && stderr.contains("exited with code 3"),
        "{stderr}"
    );
}

#[test]
fn a_simulated_backend_under_a_launcher_says_to_use_one_rank_per_process() {
    let dir = scratch("sim-under-launch");
    let out_dir = dir.join("out");
    let out = launch(
        &[
            "--nproc-per-node",
            "2",
            "--",
            common::chorus_path(),
            "train",
            "--backend",
            "sim",
            "--steps",
            "1",
            "--out-dir",
            out_dir.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("exited with code 2"), "{stderr}");
    // The first rank to exit says why (the other may be stopped before it does).
    assert!(stderr.contains(" of 2 that a launcher started") && stderr.contains("use --backend ucx"), "{stderr}");
    assert!(!out_dir.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_exit_2_before_anything_starts() {
    let dir = scratch("usage");
    let marker = format!("touch {}/started", dir.display());
    for args in [
        vec!["--nproc-per-node", "0", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--nnodes", "2", "--master-port", "0", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--timeout", "-1", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--node-timeout", "0.5", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--node-timeout", "nan", "--", "sh", "-c", &marker],
        vec!["--nproc-per-node", "1", "--", "/no/such/program"],
        vec!["--nproc-per-node", "1"],
        vec!["--nproc-per-node", "two", "--", "true"],
    ] {
        let out = launch(&args, Duration::from_secs(10));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
    }
    assert!(!dir.join("started").exists());
    // A negative count is named as one, not taken for a flag.
    for flag in ["--nproc-per-node", "--nnodes", "--node-rank"] {
        let mut args = if flag == "--nproc-per-node" { vec![] } else { vec!["--nproc-per-node", "1"] };
        args.extend([flag, "-1", "--", "sh", "-c", &marker]);
        let out = launch(&args, Duration::from_secs(10));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains("-1 is negative; give a whole number"), "{flag}: {err}");
        assert!(!err.contains("'-- -1'"), "{flag}: {err}");
    }
    assert!(!dir.join("started").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_nodes_on_one_host_form_one_job() {
    let port = free_port().to_string();
    let node =
        |rank: &str| node(&port, rank, "2", &[], &["sh", "-c", "echo rank $RANK of $WORLD_SIZE on node $GROUP_RANK"]);
    let (n0, n1) = (node("0"), node("1"));
    let (o0, o1) = (wait_bounded(n0, Duration::from_secs(30)), wait_bounded(n1, Duration::from_secs(30)));
    assert!(o0.status.success() && o1.status.success(), "{} {}", text(&o0.stderr), text(&o1.stderr));
    let (s0, s1) = (text(&o0.stdout), text(&o1.stdout));
    assert!(s0.contains("[rank 0] rank 0 of 4 on node 0") && s0.contains("[rank 1] rank 1 of 4 on node 0"), "{s0}");
    assert!(s1.contains("[rank 2] rank 2 of 4 on node 1") && s1.contains("[rank 3] rank 3 of 4 on node 1"), "{s1}");
}

#[test]
fn a_failure_on_one_node_stops_the_other_node() {
    let port = free_port().to_string();
    let script = "if [ \"$RANK\" = 3 ]; then sleep 0.5; exit 7; fi; exec sleep 60";
    let node = |rank: &str| node(&port, rank, "2", &["--grace", "1"], &["sh", "-c", script]);
    let (n0, n1) = (node("0"), node("1"));
    let (o0, o1) = (wait_bounded(n0, Duration::from_secs(30)), wait_bounded(n1, Duration::from_secs(30)));
    assert_eq!((o0.status.code(), o1.status.code()), (Some(1), Some(1)));
    assert!(
        text(&o0.stderr).contains(&format!("rank 3 (node 1 on host {}, local rank 1", this_host()))
            && text(&o0.stderr).contains("exited with code 7"),
        "{}",
        text(&o0.stderr)
    );
}

/// Two nodes whose ranks sleep; `victim`'s launcher and ranks get `signal`
/// (a dead host: SIGKILL; a hung one: SIGSTOP). The other launcher must
/// exit non-zero within 10 s, naming what it lost, and leave no rank
/// behind. Before the launchers watched each other, the survivor waited for
/// its ranks (60 s) and then, on node 0, for the dead node's report.
/// `{host}` in `says` stands for this machine's host name, `{port}` for the store's port.
fn a_lost_node_ends_the_job(victim: usize, signal: libc::c_int, says: &[&str]) {
    let dir = scratch(&format!("lost-node-{victim}-{signal}"));
    let port = free_port().to_string();
    let says: Vec<String> = says.iter().map(|s| s.replace("{host}", &this_host()).replace("{port}", &port)).collect();
    let script = format!("echo $$ > {}/pid.$RANK; exec sleep 60", dir.display());
    let node = |rank: &str| node(&port, rank, "2", &["--grace", "1"], &["sh", "-c", &script]);
    let mut nodes = [Some(node("0")), Some(node("1"))];
    let ranks = pids(&dir, 4);
    let lost = nodes[victim].take().unwrap();
    let mut targets = vec![lost.id()];
    targets.extend(&ranks[2 * victim..2 * victim + 2]);
    let hit_at = Instant::now();
    for &pid in &targets {
        // SAFETY: kill(2) on processes this test started.
        unsafe { libc::kill(pid as libc::pid_t, signal) };
    }
    let survivor = nodes[1 - victim].take().unwrap();
    let out = wait_bounded(survivor, Duration::from_secs(30));
    let took = hit_at.elapsed();
    for &pid in &targets {
        // SAFETY: as above; a stopped process dies of SIGKILL too.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    let _ = wait_bounded(lost, Duration::from_secs(10));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(says.iter().any(|s| err.contains(s)), "the survivor should say one of {says:?}: {err}");
    assert!(took < Duration::from_secs(10), "the survivor took {took:?}: {err}");
    assert_all_dead(&ranks);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_node_ends_the_job_within_seconds() {
    a_lost_node_ends_the_job(1, libc::SIGKILL, &["node 1 on host {host} has not been heard from"]);
}

#[test]
fn a_hung_node_ends_the_job_within_seconds() {
    a_lost_node_ends_the_job(1, libc::SIGSTOP, &["node 1 on host {host} has not been heard from"]);
}

#[test]
fn a_killed_store_node_ends_the_job_within_seconds() {
    a_lost_node_ends_the_job(0, libc::SIGKILL, &["lost the job's store at 127.0.0.1:{port} (node 0 on host {host})"]);
}

#[test]
fn a_hung_store_node_ends_the_job_within_seconds() {
    // The store does not answer, or its heartbeat stops: whichever comes first.
    a_lost_node_ends_the_job(
        0,
        libc::SIGSTOP,
        &[
            "lost the job's store at 127.0.0.1:{port} (node 0 on host {host})",
            "node 0 on host {host} has not been heard from",
        ],
    );
}

#[test]
fn nodes_that_disagree_on_the_rank_count_start_nothing() {
    let port = free_port().to_string();
    let node = |rank: &str, nproc: &str| node(&port, rank, nproc, &[], &["echo", "started"]);
    let (n0, n1) = (node("0", "2"), node("1", "3"));
    let (o0, o1) = (wait_bounded(n0, Duration::from_secs(30)), wait_bounded(n1, Duration::from_secs(30)));
    assert_eq!((o0.status.code(), o1.status.code()), (Some(1), Some(1)));
    assert!(text(&o0.stderr).contains("same --nproc-per-node"), "{}", text(&o0.stderr));
    assert!(!text(&o0.stdout).contains("started") && !text(&o1.stdout).contains("started"));
}

#[test]
fn an_unreachable_node_zero_is_an_error_after_the_timeout() {
    let port = free_port().to_string();
    let out = launch(
        &[
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            &port,
            "--timeout",
            "0.5",
            "--",
            "echo",
            "started",
        ],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&format!("127.0.0.1:{port}")) && stderr.contains("unreachable"), "{stderr}");
}

/// PyTorch ranks under `chorus launch`: they join the launcher's store as
/// torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) and all-reduce
/// with gloo (the venv's `$CHORUS_PYTHON`).
#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn pytorch_ranks_rendezvous_through_the_launchers_store() {
    let python = torch_python::torch_python("torch.distributed");
    let program = "import torch, torch.distributed as dist\n\
                   dist.init_process_group('gloo')\n\
                   t = torch.tensor([float(dist.get_rank() + 1)])\n\
                   dist.all_reduce(t)\n\
                   print('sum', int(t.item()), 'world', dist.get_world_size(), flush=True)\n\
                   dist.destroy_process_group()";
    let out =
        launch(&["--nproc-per-node", "2", "--timeout", "60", "--", &python, "-c", program], Duration::from_secs(120));
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("[rank 0] sum 3 world 2") && stdout.contains("[rank 1] sum 3 world 2"), "{stdout}");
}
