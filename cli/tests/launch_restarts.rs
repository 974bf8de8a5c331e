//! `chorus launch --max-restarts` end to end: the real binary starting
//! real processes, attempt after attempt; and `chorus train --resume auto`,
//! the job that continues itself. Every run is bounded (a launcher still
//! running after its limit is killed and the test fails).

use crate::common;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::Duration;

#[cfg(feature = "ucx")]
use common::chorus_path;
use common::{assert_all_dead, chorus, free_port, run_bounded, scratch, text, wait_bounded};

fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string()
}

fn launch(args: &[&str], limit: Duration) -> Output {
    run_bounded(chorus().arg("launch").args(args), limit)
}

/// The lines of `dir/<name>.<rank>` for ranks `0..n` (empty where absent).
fn lines(dir: &Path, name: &str, n: usize) -> Vec<Vec<String>> {
    (0..n)
        .map(|r| {
            std::fs::read_to_string(dir.join(format!("{name}.{r}")))
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect()
        })
        .collect()
}

/// Every rank records its attempt, the restart budget, its store's port
/// and its pid; in the first attempt rank 1 fails (exit 3) while the others
/// wait to be stopped; in the second every rank succeeds.
fn fails_once(dir: &Path) -> String {
    format!(
        "echo \"$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $MASTER_PORT $$\" >> {d}/seen.$RANK; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
           if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; exec sleep 60; \
         fi; echo \"$CHORUS_LAUNCH_HISTORY\" > {d}/history.$RANK",
        d = dir.display()
    )
}

#[test]
fn a_rank_exiting_non_zero_restarts_every_rank_and_the_job_finishes() {
    let dir = scratch("restart-once");
    let script = fails_once(&dir);
    let out = launch(
        &["--nproc-per-node", "3", "--max-restarts", "2", "--grace", "2", "--run-id", "r1", "--", "sh", "-c", &script],
        Duration::from_secs(60),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let seen = lines(&dir, "seen", 3);
    let mut first_pids = Vec::new();
    for (rank, seen) in seen.iter().enumerate() {
        let fields: Vec<Vec<&str>> = seen.iter().map(|l| l.split(' ').collect()).collect();
        // Two attempts, numbered as torchrun numbers them, with the real budget.
        assert_eq!(fields.len(), 2, "rank {rank}: {seen:?}");
        assert_eq!((fields[0][0], fields[0][1]), ("0", "2"), "rank {rank}: {seen:?}");
        assert_eq!((fields[1][0], fields[1][1]), ("1", "2"), "rank {rank}: {seen:?}");
        // The restart's ranks have a store of their own.
        assert_ne!(fields[0][2], fields[1][2], "rank {rank}: {seen:?}");
        first_pids.push(fields[0][3].parse::<u32>().unwrap());
    }
    assert_all_dead(&first_pids);
    // Every rank of the restart was told what failed before.
    for history in lines(&dir, "history", 3) {
        let h: serde_json::Value = serde_json::from_str(&history[0]).unwrap();
        let h = h.as_array().unwrap();
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h[0]["attempt"], 0);
        let failure = h[0]["failure"].as_str().unwrap();
        assert!(failure.starts_with(&format!("rank 1 (node 0 on host {}", this_host())), "{failure}");
        assert!(failure.ends_with("exited with code 3"), "{failure}");
    }
    assert!(stderr.contains("restarting: attempt 1 of at most 3"), "{stderr}");
    assert!(stderr.contains("2 attempt(s):") && stderr.contains("  attempt 1: succeeded after"), "{stderr}");
    assert!(stderr.contains("  attempt 0: failed after") && stderr.contains("exited with code 3"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same job without restarts ends at the first failure: the test above
/// sees the restart, not a script that would succeed anyway.
#[test]
fn without_restarts_the_same_job_fails_at_once() {
    let dir = scratch("restart-none");
    let script = fails_once(&dir);
    let out = launch(&["--nproc-per-node", "3", "--grace", "2", "--", "sh", "-c", &script], Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(lines(&dir, "seen", 3).iter().all(|l| l.len() == 1 && l[0].starts_with("0 0 ")));
    assert!(!text(&out.stderr).contains("attempt"), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn restarts_exhausted_end_the_job_with_every_attempt() {
    let dir = scratch("restart-spent");
    // Rank 0 fails each attempt with another code; rank 1 waits to be stopped.
    let script = format!(
        "echo \"$CHORUS_LAUNCH_HISTORY\" > {d}/history.$TORCHELASTIC_RESTART_COUNT.$RANK; \
         if [ \"$RANK\" = 0 ]; then sleep 0.3; exit $((10 + TORCHELASTIC_RESTART_COUNT)); fi; exec sleep 60",
        d = dir.display()
    );
    let out = launch(
        &["--nproc-per-node", "2", "--max-restarts", "2", "--grace", "1", "--", "sh", "-c", &script],
        Duration::from_secs(60),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the 2 restarts (--max-restarts) are spent"), "{stderr}");
    assert!(stderr.contains("3 attempt(s):"), "{stderr}");
    for attempt in 0..3 {
        let line = stderr
            .lines()
            .find(|l| l.starts_with(&format!("  attempt {attempt}: failed after")))
            .unwrap_or_else(|| panic!("attempt {attempt} missing: {stderr}"));
        assert!(line.contains("rank 0 (") && line.ends_with(&format!("exited with code {}", 10 + attempt)), "{line}");
    }
    // The last attempt's ranks knew the two before it.
    let h: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(dir.join("history.2.1")).unwrap().trim()).unwrap();
    let codes: Vec<bool> = h
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(a, e)| e["failure"].as_str().unwrap().ends_with(&format!("code {}", 10 + a)))
        .collect();
    assert_eq!(codes, [true, true], "{h}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_stop_signal_is_not_restarted() {
    let dir = scratch("restart-sigterm");
    let script = format!("echo $$ >> {}/pid.$RANK; exec sleep 60", dir.display());
    let child = chorus()
        .args(["launch", "--nproc-per-node", "2", "--max-restarts", "3", "--grace", "1", "--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = wait_for_pids(&dir, 2);
    // SAFETY: kill(2) on the launcher this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = wait_bounded(child, Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("received SIGTERM") && stderr.contains("not restarting"), "{stderr}");
    assert!(lines(&dir, "pid", 2).iter().all(|l| l.len() == 1), "no rank started twice");
    assert_all_dead(&pids);
    let _ = std::fs::remove_dir_all(&dir);
}

fn wait_for_pids(dir: &Path, n: usize) -> Vec<u32> {
    let start = std::time::Instant::now();
    loop {
        let pids: Vec<u32> = lines(dir, "pid", n).iter().filter_map(|l| l.first()?.parse().ok()).collect();
        if pids.len() == n {
            return pids;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "ranks did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Node `rank` of a two-node job on this host, node 0's store on `port`.
fn node(port: &str, rank: &str, extra: &[&str], script: &str) -> Child {
    chorus()
        .args(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", rank, "--master-port", port])
        .args(["--timeout", "20", "--grace", "1"])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_failure_on_one_node_restarts_both_nodes() {
    let dir = scratch("restart-nodes");
    let port = free_port().to_string();
    // Rank 3 (node 1) fails the first attempt; every rank of the second succeeds.
    let script = format!(
        "echo \"$TORCHELASTIC_RESTART_COUNT $GROUP_RANK\" >> {d}/seen.$RANK; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
           if [ \"$RANK\" = 3 ]; then sleep 0.5; exit 7; fi; exec sleep 60; fi",
        d = dir.display()
    );
    let (n0, n1) =
        (node(&port, "0", &["--max-restarts", "1"], &script), node(&port, "1", &["--max-restarts", "1"], &script));
    let (o0, o1) = (wait_bounded(n0, Duration::from_secs(60)), wait_bounded(n1, Duration::from_secs(60)));
    assert!(o0.status.success() && o1.status.success(), "{}\n{}", text(&o0.stderr), text(&o1.stderr));
    let seen = lines(&dir, "seen", 4);
    for (rank, seen) in seen.iter().enumerate() {
        let node = rank / 2;
        assert_eq!(seen, &[format!("0 {node}"), format!("1 {node}")], "rank {rank}");
    }
    for o in [&o0, &o1] {
        let stderr = text(&o.stderr);
        assert!(stderr.contains("attempt 0: failed after") && stderr.contains("rank 3 (node 1 on host"), "{stderr}");
        assert!(stderr.contains("attempt 1: succeeded"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nodes_that_disagree_on_restarts_start_nothing() {
    let port = free_port().to_string();
    let (n0, n1) = (
        node(&port, "0", &["--max-restarts", "1"], "echo started"),
        node(&port, "1", &["--max-restarts", "2"], "echo started"),
    );
    let (o0, o1) = (wait_bounded(n0, Duration::from_secs(30)), wait_bounded(n1, Duration::from_secs(30)));
    assert_eq!((o0.status.code(), o1.status.code()), (Some(1), Some(1)));
    assert!(text(&o0.stderr).contains("same --max-restarts") || text(&o1.stderr).contains("same --max-restarts"));
    assert!(!text(&o0.stdout).contains("started") && !text(&o1.stdout).contains("started"));
}

#[test]
fn bad_restart_counts_exit_2() {
    for (value, says) in [("-1", "-1 is negative"), ("many", "\"many\" is not a whole number")] {
        let out = launch(&["--nproc-per-node", "1", "--max-restarts", value, "--", "true"], Duration::from_secs(10));
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
}

/// Node `rank` of a job of up to three one-rank nodes on this host
/// (`--nnodes nnodes`), node 0's store on `port`.
fn node_of_three(port: &str, nnodes: &str, rank: &str, extra: &[&str], script: &str) -> Child {
    chorus()
        .args(["launch", "--nproc-per-node", "1", "--nnodes", nnodes, "--node-rank", rank, "--master-port", port])
        .args(["--timeout", "20", "--grace", "1", "--node-timeout", "2"])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Three nodes; node 2's host dies (its launcher and rank get SIGKILL)
/// while the ranks run. Returns the two survivors' outputs, the seconds
/// from the kill to their end, and what each rank recorded per attempt.
fn a_node_dies(nnodes: &str) -> (Output, Output, f64, Vec<Vec<String>>) {
    a_node_fails(nnodes, libc::SIGKILL)
}

/// [`a_node_dies`] with the signal node 2's launcher and rank get: SIGKILL
/// (a dead host) or SIGSTOP (a hung one: both stay, silent, until the
/// survivors have ended, and are then killed).
fn a_node_fails(nnodes: &str, signal: i32) -> (Output, Output, f64, Vec<Vec<String>>) {
    let dir = scratch(&format!("elastic-{}", nnodes.replace(':', "-")));
    let port = free_port().to_string();
    let script = format!(
        "echo \"$TORCHELASTIC_RESTART_COUNT $RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE\" >> {d}/seen.$NODE; \
         echo $$ > {d}/pid.$NODE.$TORCHELASTIC_RESTART_COUNT; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exec sleep 60; fi",
        d = dir.display()
    );
    let extra = ["--max-restarts", "1"];
    let mut nodes: Vec<Child> = (0..3)
        .map(|n| {
            let script = script.replace("$NODE", &n.to_string());
            node_of_three(&port, nnodes, &n.to_string(), &extra, &script)
        })
        .collect();
    let start = std::time::Instant::now();
    let victim_rank = loop {
        if let Some(pid) = std::fs::read_to_string(dir.join("pid.2.0")).ok().and_then(|p| p.trim().parse::<i32>().ok())
        {
            if (0..2).all(|n| dir.join(format!("pid.{n}.0")).exists()) {
                break pid;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the ranks did not start");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut victim = nodes.pop().unwrap();
    let killed_at = std::time::Instant::now();
    // SAFETY: kill(2) on processes this test started.
    unsafe {
        libc::kill(victim_rank, signal);
        libc::kill(victim.id() as i32, signal);
    }
    let o1 = wait_bounded(nodes.pop().unwrap(), Duration::from_secs(60));
    let o0 = wait_bounded(nodes.pop().unwrap(), Duration::from_secs(60));
    let took = killed_at.elapsed().as_secs_f64();
    // SAFETY: as above; a hung host's processes end here, a dead one's already have.
    unsafe { libc::kill(victim_rank, libc::SIGKILL) };
    let _ = victim.kill();
    let _ = victim.wait();
    let seen = lines(&dir, "seen", 3);
    let _ = std::fs::remove_dir_all(&dir);
    (o0, o1, took, seen)
}

#[test]
fn with_elastic_nodes_a_dead_host_is_left_behind_and_the_job_finishes_on_the_others() {
    node_two_is_left_behind(libc::SIGKILL, "dead");
}

/// A hung host (its launcher and rank stopped, SIGSTOP: alive, silent) is
/// taken for dead within the node timeout, as torchrun's agents take a
/// node whose heartbeat stopped: the job continues on the two others.
#[test]
fn with_elastic_nodes_a_hung_host_is_left_behind_as_a_dead_one() {
    node_two_is_left_behind(libc::SIGSTOP, "hung");
}

/// Under `--nnodes 2:3`, node 2's host fails (`signal`, a `what` host):
/// node 0 leaves it behind at the node timeout and the job finishes on the
/// two others.
fn node_two_is_left_behind(signal: i32, what: &str) {
    let (o0, o1, took, seen) = a_node_fails("2:3", signal);
    assert!(o0.status.success() && o1.status.success(), "{}\n{}", text(&o0.stderr), text(&o1.stderr));
    // attempt, RANK, WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE: three nodes, then two.
    assert_eq!(seen[0], ["0 0 3 0 3", "1 0 2 0 2"], "{seen:?}");
    assert_eq!(seen[1], ["0 1 3 1 3", "1 1 2 1 2"], "{seen:?}");
    assert_eq!(seen[2], ["0 2 3 2 3"], "{seen:?}");
    let stderr = text(&o0.stderr);
    assert!(stderr.contains("node 2 on host") && stderr.contains("has not been heard from"), "{stderr}");
    assert!(stderr.contains("attempt 1 continues without node 2 on host"), "{stderr}");
    assert!(stderr.contains("attempt 1: succeeded"), "{stderr}");
    // The node timeout (2 s), stopping the ranks and meeting again: well within 15 s.
    assert!(took < 15.0, "{took} s from the {what} host's failure to the end of the job: {stderr}");
    eprintln!("a {what} host to the end of the job on the others: {took:.1} s");
}

/// With a fixed node count the same death ends the job: the test above
/// sees the elastic restart, not a job that goes on by accident.
#[test]
fn with_a_fixed_node_count_a_dead_host_ends_the_job() {
    let (o0, o1, _, seen) = a_node_dies("3");
    assert_eq!((o0.status.code(), o1.status.code()), (Some(1), Some(1)), "{}", text(&o0.stderr));
    assert!(seen.iter().all(|s| s.len() == 1), "{seen:?}");
    assert!(text(&o0.stderr).contains("not restarting"), "{}", text(&o0.stderr));
}

#[test]
fn an_elastic_job_starts_at_the_timeout_with_the_nodes_that_joined() {
    let port = free_port().to_string();
    let out = wait_bounded(
        chorus()
            .args(["launch", "--nproc-per-node", "2", "--nnodes", "1:2", "--master-port", &port, "--timeout", "2"])
            .args(["--", "sh", "-c", "echo $RANK of $WORLD_SIZE on $GROUP_WORLD_SIZE"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("[rank 0] 0 of 2 on 1") && stdout.contains("[rank 1] 1 of 2 on 1"), "{stdout}");
    assert!(text(&out.stderr).contains("starting run \"none\" with nodes [0] of 2"), "{}", text(&out.stderr));
    // Too few nodes within the timeout start nothing.
    let out = launch(
        &[
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2:3",
            "--master-port",
            &port,
            "--timeout",
            "1",
            "--",
            "echo",
            "started",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("needs at least 2") && !text(&out.stdout).contains("started"));
}

/// Waits until every file of `names` is in `dir` (at most `limit`).
fn wait_for_files(dir: &Path, names: &[&str], limit: Duration) {
    let start = std::time::Instant::now();
    while !names.iter().all(|n| dir.join(n).exists()) {
        assert!(start.elapsed() < limit, "{names:?} not in {} within {limit:?}", dir.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for each launcher in turn (each within `limit`) and asserts that
/// every one succeeded, showing all their stderr where one did not.
fn all_succeed<const N: usize>(launchers: [Child; N], limit: Duration) -> [Output; N] {
    let outs = launchers.map(|launcher| wait_bounded(launcher, limit));
    let said: Vec<String> = outs.iter().map(|o| text(&o.stderr)).collect();
    assert!(outs.iter().all(|o| o.status.success()), "{}", said.join("\n"));
    outs
}

/// Node 2's host dies: its rank (whose pid is in `dir/pid.2.0`) and its
/// launcher, the last of `nodes`, are killed (SIGKILL).
fn kill_node_two(dir: &Path, nodes: &mut Vec<Child>) {
    let rank: i32 = std::fs::read_to_string(dir.join("pid.2.0")).unwrap().trim().parse().unwrap();
    let mut launcher = nodes.pop().unwrap();
    // SAFETY: kill(2) on a process this test's launcher started.
    unsafe { libc::kill(rank, libc::SIGKILL) };
    launcher.kill().unwrap();
    launcher.wait().unwrap();
}

/// Node `rank` of an elastic job of up to three one-rank nodes on this
/// host (`--nnodes 2:3`, at most `--timeout timeout`), node 0's store on `port`.
fn elastic_node(port: &str, rank: usize, timeout: &str, extra: &[&str], script: &str) -> Child {
    let script = script.replace("$NODE", &rank.to_string());
    chorus()
        .args(["launch", "--nproc-per-node", "1", "--nnodes", "2:3", "--node-rank", &rank.to_string()])
        .args(["--master-port", port, "--timeout", timeout, "--grace", "1", "--node-timeout", "2"])
        .args(extra)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// What every rank of these elastic jobs records, in `dir`: its attempt,
/// `RANK`, `WORLD_SIZE`, `GROUP_RANK` and `GROUP_WORLD_SIZE` (in `seen.<node>`)
/// and its pid (in `pid.<node>.<attempt>`); then it sleeps in the attempts
/// before `last`, and in `last` waits (at most 60 s) for the file `go`.
fn elastic_rank(dir: &Path, last: usize) -> String {
    format!(
        "echo started; \
         echo \"$TORCHELASTIC_RESTART_COUNT $RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE\" >> {d}/seen.$NODE; \
         echo $$ > {d}/pid.$NODE.$TORCHELASTIC_RESTART_COUNT; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt {last} ]; then exec sleep 60; fi; \
         i=0; while [ ! -e {d}/go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
        d = dir.display()
    )
}

/// Runs a launcher that must be refused: it exits 1 within 10 s, saying `says`.
fn refused(child: Child, says: &str) -> f64 {
    let start = std::time::Instant::now();
    let out = wait_bounded(child, Duration::from_secs(30));
    let took = start.elapsed().as_secs_f64();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(says), "{says:?} not in: {stderr}");
    assert!(took < 10.0, "refused after {took:.1} s: {stderr}");
    assert!(!text(&out.stdout).contains("started"), "a refused launcher started ranks: {}", text(&out.stdout));
    took
}

/// Issue 44: a node that comes back joins at the next attempt. Three
/// one-rank nodes (`--nnodes 2:3`, `--max-restarts 2`); node 2's host dies
/// (launcher and rank killed) and the two others restart without it. A
/// second launcher for node 1, whose launcher runs, is refused at once; a
/// launcher started again for node 2 waits at the rendezvous, node 0 stops
/// the attempt to take it in, and the third attempt runs on all three nodes,
/// numbered as at the start. In that last attempt no restart is left, and
/// one more launcher for node 2 is refused at once.
#[test]
fn a_node_that_comes_back_joins_the_next_attempt() {
    let dir = scratch("come-back");
    let port = free_port().to_string();
    let script = elastic_rank(&dir, 2);
    let extra = ["--max-restarts", "2"];
    let mut nodes: Vec<Child> = (0..3).map(|n| elastic_node(&port, n, "20", &extra, &script)).collect();
    wait_for_files(&dir, &["pid.0.0", "pid.1.0", "pid.2.0"], Duration::from_secs(30));
    kill_node_two(&dir, &mut nodes);
    wait_for_files(&dir, &["pid.0.1", "pid.1.1"], Duration::from_secs(30));
    let duplicate = refused(elastic_node(&port, 1, "20", &extra, &script), "another launcher is running as node 1");
    let back_at = std::time::Instant::now();
    let back = elastic_node(&port, 2, "20", &extra, &script);
    wait_for_files(&dir, &["pid.0.2", "pid.1.2", "pid.2.2"], Duration::from_secs(60));
    let rejoined = back_at.elapsed().as_secs_f64();
    let spent = refused(elastic_node(&port, 2, "20", &extra, &script), "no restart is left to take node 2 in");
    std::fs::write(dir.join("go"), "").unwrap();
    let [o2, _, o0] = all_succeed([back, nodes.pop().unwrap(), nodes.pop().unwrap()], Duration::from_secs(60));
    // attempt, RANK, WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE: three nodes, two, three again.
    let seen = lines(&dir, "seen", 3);
    assert_eq!(seen[0], ["0 0 3 0 3", "1 0 2 0 2", "2 0 3 0 3"], "{seen:?}");
    assert_eq!(seen[1], ["0 1 3 1 3", "1 1 2 1 2", "2 1 3 1 3"], "{seen:?}");
    assert_eq!(seen[2], ["0 2 3 2 3", "2 2 3 2 3"], "{seen:?}");
    let stderr = text(&o0.stderr);
    assert!(stderr.contains("node 2 on host") && stderr.contains("is waiting to join"), "{stderr}");
    assert!(stderr.contains("attempt 2 takes in node 2 on host"), "{stderr}");
    let stderr = text(&o2.stderr);
    assert!(stderr.contains("node 2 waits to join run \"none\""), "{stderr}");
    assert!(stderr.contains("node 2 joins run \"none\" at attempt 2, with nodes [0, 1, 2]"), "{stderr}");
    // The node taken in knows the attempts before it, as the ranks' history does.
    assert!(stderr.contains("3 attempt(s):") && stderr.contains("  attempt 2: succeeded"), "{stderr}");
    assert!(stderr.contains("  attempt 0: failed after") && stderr.contains("is waiting to join"), "{stderr}");
    eprintln!(
        "a node back to its ranks running again: {rejoined:.1} s; a duplicate launcher refused in {duplicate:.1} s, \
         one with no restart left in {spent:.1} s"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node that never joined (node 0 started the job at `--timeout` without
/// it) is taken in while the job runs: node 0 restarts the nodes to take it
/// in, as torchrun's agent scales up, spending a restart.
#[test]
fn a_late_node_is_taken_in_at_a_restart() {
    let dir = scratch("late-node");
    let port = free_port().to_string();
    let script = elastic_rank(&dir, 1);
    let extra = ["--max-restarts", "1"];
    let mut nodes: Vec<Child> = (0..2).map(|n| elastic_node(&port, n, "2", &extra, &script)).collect();
    wait_for_files(&dir, &["pid.0.0", "pid.1.0"], Duration::from_secs(30));
    let late_at = std::time::Instant::now();
    let late = elastic_node(&port, 2, "2", &extra, &script);
    wait_for_files(&dir, &["pid.0.1", "pid.1.1", "pid.2.1"], Duration::from_secs(30));
    let took = late_at.elapsed().as_secs_f64();
    std::fs::write(dir.join("go"), "").unwrap();
    let [_, o1, o0] = all_succeed([late, nodes.pop().unwrap(), nodes.pop().unwrap()], Duration::from_secs(60));
    let seen = lines(&dir, "seen", 3);
    assert_eq!(seen, [vec!["0 0 2 0 2", "1 0 3 0 3"], vec!["0 1 2 1 2", "1 1 3 1 3"], vec!["1 2 3 2 3"]]);
    assert!(text(&o0.stderr).contains("starting run \"none\" with nodes [0, 1] of 3"), "{}", text(&o0.stderr));
    assert!(text(&o1.stderr).contains("attempt 1 takes in node 2 on host"), "{}", text(&o1.stderr));
    eprintln!("a late node to its rank running: {took:.1} s");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A launcher that comes to a started job without restarts is refused at
/// once, and so is one that comes once the job has ended (node 0's store
/// still up for its last nodes), each saying why; the job is not disturbed.
#[test]
fn a_node_that_comes_when_no_attempt_can_take_it_is_refused_at_once() {
    let dir = scratch("late-refused");
    let port = free_port().to_string();
    // Node 0's rank ends at the file `go.0`, the others' at `go.1`.
    let script = format!(
        "echo started; echo $$ > {d}/pid.$NODE.0; n=$NODE; [ $n -gt 1 ] && n=1; \
         i=0; while [ ! -e {d}/go.$n ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
        d = dir.display()
    );
    let nodes: Vec<Child> = (0..3).map(|n| elastic_node(&port, n, "20", &[], &script)).collect();
    wait_for_files(&dir, &["pid.0.0", "pid.1.0", "pid.2.0"], Duration::from_secs(30));
    refused(elastic_node(&port, 2, "20", &[], &script), "the job has no restarts (--max-restarts 0)");
    // Without restarts node 0 ends when its own ranks have, and keeps the
    // store up for the other nodes.
    std::fs::write(dir.join("go.0"), "").unwrap();
    let start = std::time::Instant::now();
    loop {
        let tried = std::time::Instant::now();
        let out = wait_bounded(elastic_node(&port, 2, "20", &[], &script), Duration::from_secs(30));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(tried.elapsed() < Duration::from_secs(10), "refused after {:?}: {stderr}", tried.elapsed());
        if stderr.contains("run \"none\" has ended (succeeded): node 2 is not taken in") {
            break;
        }
        // Node 0 had not ended yet.
        assert!(stderr.contains("--max-restarts 0"), "{stderr}");
        assert!(start.elapsed() < Duration::from_secs(20), "node 0 did not end: {stderr}");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(dir.join("go.1"), "").unwrap();
    for (n, node) in nodes.into_iter().enumerate().rev() {
        let o = wait_bounded(node, Duration::from_secs(60));
        assert!(o.status.success(), "node {n}: {}", text(&o.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_node_ranges_exit_2() {
    for (value, says) in
        [("3:2", "MIN 3 is above MAX 2"), ("0:2", "at least 1"), ("1:x", "\"x\" is not a whole number")]
    {
        let out = launch(&["--nproc-per-node", "1", "--nnodes", value, "--", "true"], Duration::from_secs(10));
        assert_eq!(out.status.code(), Some(2), "{value}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(says), "{value}: {}", text(&out.stderr));
    }
}

/// The small transformer `chorus train` trains in these tests, on
/// `backend`, into `out` with its checkpoints in `ck` every 2 steps.
fn small_gpt(backend: &str, steps: &str, out: &Path, ck: &Path) -> Vec<String> {
    let (out, ck) = (out.display().to_string(), ck.display().to_string());
    [
        "train",
        "--model",
        "gpt",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--world-size",
        "2",
        "--batch",
        "4",
        "--backend",
        backend,
        "--steps",
        steps,
        "--save-every",
        "2",
        "--out-dir",
        &out,
        "--checkpoint-dir",
        &ck,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

/// Every tensor of two safetensors files, bit for bit; the names that differ.
fn differing_tensors(a: &Path, b: &Path) -> Vec<String> {
    let (a, b) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    let (a, b) =
        (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    assert_eq!(a.len(), b.len());
    let mut differ: Vec<String> = a
        .tensors()
        .into_iter()
        .filter(|(name, t)| b.tensor(name).unwrap().data() != t.data())
        .map(|(n, _)| n)
        .collect();
    differ.sort();
    differ
}

/// `chorus train --resume auto` on simulated ranks: started fresh where
/// there is no checkpoint, continued from the newest one when started
/// again, ending bit for bit where an uninterrupted run ends; a checkpoint
/// of another job is refused.
#[test]
fn resume_auto_starts_fresh_then_continues_where_the_job_saved_last() {
    let dir = scratch("resume-auto");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let run = |steps: &str, extra: &[&str]| {
        let mut args = small_gpt("sim", steps, &out, &ck);
        args.extend(extra.iter().map(|s| s.to_string()));
        run_bounded(chorus().args(&args), Duration::from_secs(120))
    };
    let first = run("4", &["--resume", "auto"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(text(&first.stderr).contains("no checkpoint in"), "{}", text(&first.stderr));
    assert_eq!(summary(&out)["config"]["start_step"], 0);
    // Started again with more steps, the job continues from step 4.
    let second = run("8", &["--resume", "auto"]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    let s = summary(&out);
    assert_eq!(s["config"]["start_step"], 4, "{s}");
    assert_eq!(s["restart"]["resumed_from"]["step"], 4, "{s}");
    assert_eq!(s["restart"]["previous_attempt"]["reached_step"], 4, "{s}");
    assert_eq!(s["restart"]["previous_attempt"]["lost_steps"], 0, "{s}");
    // The same 8 steps in one run: the same weights, bit for bit (the
    // simulator's reductions are deterministic and each step's data is its own).
    let (whole, whole_ck) = (dir.join("whole"), dir.join("whole-ck"));
    let o = run_bounded(chorus().args(small_gpt("sim", "8", &whole, &whole_ck)), Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        differing_tensors(&out.join("model.safetensors"), &whole.join("model.safetensors")),
        Vec::<String>::new()
    );
    // A run of another learning rate from the same checkpoint ends elsewhere: the comparison sees a difference.
    let (other, other_ck) = (dir.join("other"), dir.join("other-ck"));
    let mut args = small_gpt("sim", "8", &other, &other_ck);
    let step4 = ck.join("step-00000004").display().to_string();
    args.extend(["--resume", &step4, "--lr", "0.02", "--allow-optimizer-change"].iter().map(|s| s.to_string()));
    let o = run_bounded(chorus().args(&args), Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(!differing_tensors(&out.join("model.safetensors"), &other.join("model.safetensors")).is_empty());
    // Another job (another seed) started into the same directories is refused, and nothing is lost.
    let before = std::fs::read(ck.join("latest")).unwrap();
    let refused = run("12", &["--resume", "auto", "--seed", "5"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(text(&refused.stderr).contains("--seed"), "{}", text(&refused.stderr));
    assert_eq!(std::fs::read(ck.join("latest")).unwrap(), before);
    // A job that trained every step has nothing left to resume.
    let done = run("8", &["--resume", "auto"]);
    assert_eq!(done.status.code(), Some(2), "{}", text(&done.stderr));
    assert!(text(&done.stderr).contains("leaves nothing to train"), "{}", text(&done.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_auto_and_the_launchers_variables_are_checked() {
    let dir = scratch("resume-auto-usage");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let base = small_gpt("sim", "2", &out, &ck);
    // Without checkpoints there is nothing to continue from.
    let no_saves =
        ["train", "--d-model", "32", "--layers", "1", "--seq-len", "16", "--world-size", "2", "--batch", "4"];
    let o = run_bounded(
        chorus().args(no_saves).args(["--steps", "2", "--resume", "auto", "--out-dir"]).arg(&out),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("--resume auto continues the job from its own checkpoints"),
        "{}",
        text(&o.stderr)
    );
    for (var, value, says) in [
        ("TORCHELASTIC_RESTART_COUNT", "x", "TORCHELASTIC_RESTART_COUNT=\"x\" is not a whole number"),
        ("CHORUS_LAUNCH_HISTORY", "[{", "CHORUS_LAUNCH_HISTORY: not JSON"),
        ("CHORUS_LAUNCH_HISTORY", "[{\"attempt\": 0}]", "CHORUS_LAUNCH_HISTORY: not a list"),
    ] {
        let o = run_bounded(chorus().args(&base).args(["--resume", "auto"]).env(var, value), Duration::from_secs(60));
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains(says), "{var}={value}: {}", text(&o.stderr));
    }
    assert!(!out.exists() && !ck.join("latest").exists(), "nothing written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The job issue 44 is about: `chorus train` over UCX under `chorus launch
/// --max-restarts 1`, one rank killed (SIGKILL) mid-run once a checkpoint
/// exists; the launcher restarts both ranks, which resume from the newest
/// checkpoint and finish. The final weights equal, bit for bit, those of an
/// uninterrupted run resumed from the same checkpoint, and those of a run
/// never interrupted; a run with another learning rate differs.
#[cfg(feature = "ucx")]
#[test]
fn a_training_job_killed_mid_run_resumes_from_its_last_checkpoint() {
    let dir = scratch("restart-train");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let mut train = small_gpt("ucx", "200", &out, &ck);
    train.extend(["--resume".to_string(), "auto".to_string()]);
    // Rank 1 of the first attempt dies once the first checkpoint is there
    // (200 steps: the run cannot end before).
    let script = format!(
        "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then \
           (while [ ! -e {ck}/latest ]; do sleep 0.002; done; kill -KILL $$) & \
         fi; exec \"$@\"",
        ck = ck.display()
    );
    let mut launch = chorus();
    launch.args(["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--grace", "2", "--", "sh", "-c", &script]);
    launch.arg("sh").arg(chorus_path()).args(&train);
    let o = run_bounded(&mut launch, Duration::from_secs(300));
    let stderr = text(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("attempt 0: failed after") && stderr.contains("was killed by signal 9 (SIGKILL)"),
        "{stderr}"
    );
    let s = summary(&out);
    let restart = &s["restart"];
    assert_eq!(restart["restart_count"], 1, "{s}");
    assert_eq!(restart["max_restarts"], 1, "{s}");
    let failure = restart["earlier_attempts"][0]["failure"].as_str().unwrap();
    assert!(failure.starts_with("rank 1 (") && failure.contains("SIGKILL"), "{failure}");
    let from = restart["resumed_from"]["step"].as_u64().unwrap();
    assert!((2..200).contains(&from) && from % 2 == 0, "{s}");
    assert_eq!(s["config"]["start_step"], from, "{s}");
    let lost = restart["previous_attempt"]["lost_steps"].as_u64().unwrap();
    assert!(lost < 2, "at most the save interval is lost: {s}");
    assert_eq!(restart["previous_attempt"]["reached_step"].as_u64().unwrap(), from + lost, "{s}");
    eprintln!(
        "resumed from step {from}; lost {lost} steps, {} s; {} s from the last step to the restart",
        restart["previous_attempt"]["lost_seconds"],
        restart["previous_attempt"]["seconds_from_its_last_step_to_this_start"]
    );
    // The same checkpoint resumed by a run that is never interrupted.
    let resumed_from = ck.join(format!("step-{from:08}")).display().to_string();
    let reference = |name: &str, extra: &[&str]| {
        let (o_dir, c_dir) = (dir.join(name), dir.join(format!("{name}-ck")));
        let mut args = small_gpt("ucx", "200", &o_dir, &c_dir);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut launch = chorus();
        launch.args(["launch", "--nproc-per-node", "2", "--", chorus_path()]).args(&args);
        let o = run_bounded(&mut launch, Duration::from_secs(300));
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        o_dir.join("model.safetensors")
    };
    let model = out.join("model.safetensors");
    assert_eq!(differing_tensors(&model, &reference("same", &["--resume", &resumed_from])), Vec::<String>::new());
    assert_eq!(differing_tensors(&model, &reference("whole", &[])), Vec::<String>::new());
    let other = reference("other", &["--resume", &resumed_from, "--lr", "0.02", "--allow-optimizer-change"]);
    assert!(!differing_tensors(&model, &other).is_empty(), "another learning rate must end elsewhere");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 44's elastic job on one host: three one-rank nodes (`--nnodes
/// 2:3`) train over UCX, each rank told the launcher's world size and a
/// global batch of 6; node 2's host dies (launcher and rank killed) after
/// the first checkpoint. The two others resume from the newest checkpoint
/// on a world of 2 (the checkpoint resharded) and finish; their weights
/// equal, bit for bit, a run of 2 ranks never interrupted that resumes from
/// the same checkpoint; one with another learning rate differs.
#[cfg(feature = "ucx")]
#[test]
fn an_elastic_training_job_continues_on_the_hosts_that_remain() {
    let dir = scratch("elastic-train");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let port = free_port().to_string();
    let (out_s, ck_s) = (out.display().to_string(), ck.display().to_string());
    let train = format!(
        "echo $$ > {d}/pid.$GROUP_RANK.$TORCHELASTIC_RESTART_COUNT; exec {chorus} train --model gpt --d-model 32 \
         --layers 1 --seq-len 16 --world-size $WORLD_SIZE --global-batch 6 --backend ucx --steps 200 --save-every 2 \
         --out-dir {out_s} --checkpoint-dir {ck_s} --resume auto",
        d = dir.display(),
        chorus = chorus_path()
    );
    let mut nodes: Vec<Child> =
        (0..3).map(|n| node_of_three(&port, "2:3", &n.to_string(), &["--max-restarts", "1"], &train)).collect();
    wait_for_files(&dir, &["pid.2.0"], Duration::from_secs(120));
    wait_for_files(&ck, &["latest"], Duration::from_secs(120));
    kill_node_two(&dir, &mut nodes);
    let o1 = wait_bounded(nodes.pop().unwrap(), Duration::from_secs(300));
    let o0 = wait_bounded(nodes.pop().unwrap(), Duration::from_secs(300));
    assert!(o0.status.success() && o1.status.success(), "{}\n{}", text(&o0.stderr), text(&o1.stderr));
    let s = summary(&out);
    assert_eq!(s["config"]["world_size"], 2, "{s}");
    let from = s["restart"]["resumed_from"]["step"].as_u64().unwrap();
    assert!((2..200).contains(&from), "{s}");
    let failure = s["restart"]["earlier_attempts"][0]["failure"].as_str().unwrap();
    assert!(failure.contains("node 2 on host") && failure.contains("not heard from"), "{failure}");
    eprintln!("elastic: resumed from step {from} on 2 ranks: {}", s["restart"]["previous_attempt"]);
    let resumed_from = ck.join(format!("step-{from:08}")).display().to_string();
    let reference = |name: &str, extra: &[&str]| {
        let (o_dir, c_dir) = (dir.join(name), dir.join(format!("{name}-ck")));
        let mut launch = chorus();
        launch.args(["launch", "--nproc-per-node", "2", "--", chorus_path()]);
        launch.args(["train", "--model", "gpt", "--d-model", "32", "--layers", "1", "--seq-len", "16"]);
        launch.args(["--world-size", "2", "--global-batch", "6", "--backend", "ucx", "--steps", "200"]);
        launch.args(["--save-every", "2", "--resume", &resumed_from, "--out-dir"]).arg(&o_dir);
        launch.arg("--checkpoint-dir").arg(&c_dir).args(extra);
        let o = run_bounded(&mut launch, Duration::from_secs(300));
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        o_dir.join("model.safetensors")
    };
    let model = out.join("model.safetensors");
    assert_eq!(differing_tensors(&model, &reference("same", &[])), Vec::<String>::new());
    let other = reference("other", &["--lr", "0.02", "--allow-optimizer-change"]);
    assert!(!differing_tensors(&model, &other).is_empty(), "another learning rate must end elsewhere");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 44's elastic job growing back: three one-rank nodes (`--nnodes
/// 2:3`, `--max-restarts 2`) train over UCX without `--world-size` (each
/// attempt takes the launcher's); node 2's host dies after the first
/// checkpoint, the other two restart without it (their ranks wait there),
/// and a launcher started again for node 2 is taken in: the third attempt
/// resumes from the newest checkpoint on three ranks and finishes, bit for
/// bit where a run of three ranks resumed from that checkpoint ends.
#[cfg(feature = "ucx")]
#[test]
fn an_elastic_training_job_takes_back_a_node_that_comes_back() {
    let dir = scratch("elastic-grow");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let port = free_port().to_string();
    let train = format!(
        "train --model gpt --d-model 32 --layers 1 --seq-len 16 --global-batch 6 --backend ucx --steps 200 \
         --save-every 2 --out-dir {} --checkpoint-dir {} --resume auto",
        out.display(),
        ck.display()
    );
    let script = format!(
        "echo $$ > {d}/pid.$NODE.$TORCHELASTIC_RESTART_COUNT; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ]; then exec sleep 60; fi; exec {chorus} {train}",
        d = dir.display(),
        chorus = chorus_path()
    );
    let extra = ["--max-restarts", "2"];
    let mut nodes: Vec<Child> = (0..3).map(|n| elastic_node(&port, n, "20", &extra, &script)).collect();
    wait_for_files(&dir, &["pid.2.0"], Duration::from_secs(120));
    wait_for_files(&ck, &["latest"], Duration::from_secs(120));
    kill_node_two(&dir, &mut nodes);
    wait_for_files(&dir, &["pid.0.1", "pid.1.1"], Duration::from_secs(60));
    let back = elastic_node(&port, 2, "20", &extra, &script);
    all_succeed([back, nodes.pop().unwrap(), nodes.pop().unwrap()], Duration::from_secs(300));
    let s = summary(&out);
    assert_eq!(s["config"]["world_size"], 3, "{s}");
    assert_eq!(s["restart"]["restart_count"], 2, "{s}");
    let failure = s["restart"]["earlier_attempts"][1]["failure"].as_str().unwrap();
    assert!(failure.contains("node 2 on host") && failure.contains("is waiting to join"), "{failure}");
    let from = s["restart"]["resumed_from"]["step"].as_u64().unwrap();
    assert!((2..200).contains(&from), "{s}");
    eprintln!("grown back: resumed from step {from} on 3 ranks: {}", s["restart"]["previous_attempt"]);
    let resumed_from = ck.join(format!("step-{from:08}")).display().to_string();
    let (same, same_ck) = (dir.join("same"), dir.join("same-ck"));
    let mut launch = chorus();
    launch.args(["launch", "--nproc-per-node", "3", "--", chorus_path()]);
    launch.args(train.split(' ').take_while(|a| *a != "--out-dir"));
    launch.args(["--world-size", "3", "--resume", &resumed_from, "--out-dir"]).arg(&same);
    launch.arg("--checkpoint-dir").arg(&same_ck);
    let o = run_bounded(&mut launch, Duration::from_secs(300));
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        differing_tensors(&out.join("model.safetensors"), &same.join("model.safetensors")),
        Vec::<String>::new()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `chorus train` under a launcher takes the launcher's world size where
/// `--world-size` is not given (so an elastic job's ranks need not pass
/// `$WORLD_SIZE`), and refuses one that disagrees before anything starts.
#[cfg(feature = "ucx")]
#[test]
fn a_launched_training_run_takes_the_launchers_world_size() {
    let dir = scratch("launched-world");
    let train = |name: &str, extra: &[&str]| {
        let (out, ck) = (dir.join(name), dir.join(format!("{name}-ck")));
        let mut args = small_gpt("ucx", "2", &out, &ck);
        let at = args.iter().position(|a| a == "--world-size").unwrap();
        args.drain(at..at + 2);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut launch = chorus();
        launch.args(["launch", "--nproc-per-node", "2", "--", chorus_path()]).args(&args);
        (run_bounded(&mut launch, Duration::from_secs(300)), out)
    };
    let (o, out) = train("launched", &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(summary(&out)["config"]["world_size"], 2);
    let (o, out) = train("disagrees", &["--world-size", "3"]);
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--world-size 3 but the launcher started 2 ranks (WORLD_SIZE)"), "{stderr}");
    assert!(stderr.contains("exited with code 2"), "{stderr}");
    assert!(!out.exists(), "a refused run wrote its out-dir");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tensors of every safetensors file of two checkpoint directories,
/// file by file (their save identities differ); the files whose tensors differ.
fn differing_checkpoint_files(a: &Path, b: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(a)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
    assert!(!names.is_empty(), "{}: no shard files", a.display());
    names.into_iter().filter(|n| !differing_tensors(&a.join(n), &b.join(n)).is_empty()).collect()
}

/// `--async-save`: the shards are written while the training goes on, and
/// the checkpoints and the final weights are those of blocking saves, bit
/// for bit; a run resumed from an asynchronous checkpoint ends where the
/// blocking run ends; the summary says how long each save held the step.
#[test]
fn asynchronous_saves_write_what_blocking_saves_write() {
    let dir = scratch("async-save");
    let run = |name: &str, extra: &[&str]| {
        let (out, ck) = (dir.join(name), dir.join(format!("{name}-ck")));
        let mut args = small_gpt("sim", "8", &out, &ck);
        args.extend(extra.iter().map(|s| s.to_string()));
        let o = run_bounded(chorus().args(&args), Duration::from_secs(120));
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        (out, ck)
    };
    let (async_out, async_ck) = run("async", &["--async-save"]);
    let (blocking_out, blocking_ck) = run("blocking", &[]);
    for step in ["step-00000002", "step-00000004", "step-00000006", "step-00000008"] {
        assert_eq!(differing_checkpoint_files(&async_ck.join(step), &blocking_ck.join(step)), Vec::<String>::new());
    }
    assert_eq!(std::fs::read_to_string(async_ck.join("latest")).unwrap().trim(), "step-00000008");
    let model = |d: &Path| d.join("model.safetensors");
    assert_eq!(differing_tensors(&model(&async_out), &model(&blocking_out)), Vec::<String>::new());
    // The comparison sees a difference where there is one.
    assert!(!differing_checkpoint_files(&async_ck.join("step-00000002"), &blocking_ck.join("step-00000004")).is_empty());
    let (a, b) = (summary(&async_out), summary(&blocking_out));
    let saves = |s: &serde_json::Value| s["saves"].as_array().unwrap().clone();
    assert_eq!(saves(&a).len(), 4, "{a}");
    assert!(saves(&a).iter().all(|s| s["asynchronous"] == true && s["staged_bytes"].as_u64().unwrap() > 0), "{a}");
    assert!(saves(&b).iter().all(|s| s["asynchronous"] == false && s["staged_bytes"] == 0), "{b}");
    // An asynchronous checkpoint resumes like any other.
    let resumed_from = async_ck.join("step-00000004").display().to_string();
    let (resumed, _) = run("resumed", &["--resume", &resumed_from]);
    assert_eq!(differing_tensors(&model(&resumed), &model(&blocking_out)), Vec::<String>::new());
    // It needs checkpoints to write.
    let o = run_bounded(
        chorus().args(["train", "--d-model", "32", "--layers", "1", "--seq-len", "16", "--steps", "2", "--async-save"]),
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("--async-save goes with --save-every"), "{}", text(&o.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank killed while an asynchronous save is being written, under
/// `--max-restarts 1`: the half-written save is never read; the job
/// resumes from the last complete checkpoint and ends bit for bit where a
/// run never interrupted ends.
#[cfg(feature = "ucx")]
#[test]
fn a_rank_killed_during_an_asynchronous_save_resumes_from_the_last_complete_checkpoint() {
    let dir = scratch("async-kill");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let mut train = small_gpt("ucx", "200", &out, &ck);
    train.extend(["--resume", "auto", "--async-save"].iter().map(|s| s.to_string()));
    // Rank 1 of the first attempt dies while a save after the first is under way.
    let script = format!(
        "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then \
           (while [ ! -e {ck}/latest ] || ! ls -d {ck}/.tmp-step-* >/dev/null 2>&1; do sleep 0.002; done; \
            kill -KILL $$) & \
         fi; exec \"$@\"",
        ck = ck.display()
    );
    let mut launch = chorus();
    launch.args(["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--grace", "2", "--", "sh", "-c", &script]);
    launch.arg("sh").arg(chorus_path()).args(&train);
    let o = run_bounded(&mut launch, Duration::from_secs(300));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = summary(&out);
    let from = s["restart"]["resumed_from"]["step"].as_u64().unwrap();
    assert!((2..200).contains(&from), "{s}");
    assert!(ck.join(format!("step-{from:08}")).join("chorus_checkpoint.json").is_file());
    eprintln!("async save killed: resumed from step {from}: {}", s["restart"]["previous_attempt"]);
    let (whole, whole_ck) = (dir.join("whole"), dir.join("whole-ck"));
    let mut launch = chorus();
    launch
        .args(["launch", "--nproc-per-node", "2", "--", chorus_path()])
        .args(small_gpt("ucx", "200", &whole, &whole_ck));
    let o = run_bounded(&mut launch, Duration::from_secs(300));
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        differing_tensors(&out.join("model.safetensors"), &whole.join("model.safetensors")),
        Vec::<String>::new()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two jobs never resume from one directory: while a `--resume auto` job
/// runs, a second one started into the same directories is refused by
/// their locks, and the first one's checkpoints stay as they are.
#[test]
fn a_second_job_never_resumes_from_a_running_jobs_directory() {
    let dir = scratch("resume-auto-twice");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let mut args = small_gpt("sim", "100000", &out, &ck);
    args.extend(["--resume".to_string(), "auto".to_string()]);
    let mut first = chorus().args(&args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = std::time::Instant::now();
    while !ck.join("latest").exists() {
        assert!(start.elapsed() < Duration::from_secs(60), "the first job saved nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    let second = run_bounded(chorus().args(&args), Duration::from_secs(60));
    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(second.status.code(), Some(1), "{}", text(&second.stderr));
    assert!(text(&second.stderr).contains("another chorus run"), "{}", text(&second.stderr));
    // The killed job's directories are taken over by the next start, which resumes.
    let before: u64 = std::fs::read_to_string(ck.join("latest")).unwrap().trim()["step-".len()..].parse().unwrap();
    let mut args = small_gpt("sim", &(before + 2).to_string(), &out, &ck);
    args.extend(["--resume".to_string(), "auto".to_string()]);
    let third = run_bounded(chorus().args(&args), Duration::from_secs(60));
    assert!(third.status.success(), "{}", text(&third.stderr));
    assert_eq!(summary(&out)["config"]["start_step"].as_u64(), Some(before), "{}", text(&third.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
