//! `chorus launch --max-restarts` end to end: the real binary starting
//! real processes, attempt after attempt. Every run is bounded (a launcher
//! still running after its limit is killed and the test fails).

mod common;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::Duration;

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
    unsafe { libc::kill(victim_rank, libc::SIGKILL) };
    victim.kill().unwrap();
    victim.wait().unwrap();
    let o1 = wait_bounded(nodes.pop().unwrap(), Duration::from_secs(60));
    let o0 = wait_bounded(nodes.pop().unwrap(), Duration::from_secs(60));
    let took = killed_at.elapsed().as_secs_f64();
    let seen = lines(&dir, "seen", 3);
    let _ = std::fs::remove_dir_all(&dir);
    (o0, o1, took, seen)
}

#[test]
fn with_elastic_nodes_a_dead_host_is_left_behind_and_the_job_finishes_on_the_others() {
    let (o0, o1, took, seen) = a_node_dies("2:3");
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
    assert!(took < 15.0, "{took} s from the host's death to the end of the job: {stderr}");
    eprintln!("a dead host to the end of the job on the others: {took:.1} s");
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
