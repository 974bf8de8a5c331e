//! The UCX backend with one rank per process, end to end: the real binary
//! under `chorus launch` (and torchrun: the venv's, run with `--ignored`), real
//! processes on loopback. Every run is bounded (a process still running
//! after its limit is killed and the test fails).
#![cfg(feature = "ucx")]

use crate::common;
use crate::torch_python;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{chorus, chorus_path, free_port, run_bounded as run, scratch, text, wait_bounded};

use chorus_collectives::bootstrap::TcpStoreServer;

/// The tests start several processes each and time their failures: one at
/// a time, so they do not compete for the machine's cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A float32 `.npy` file's values (the little-endian `<f4` files `chorus train` writes).
fn npy(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{}", path.display());
    let (major, header_len, start) = match bytes[6] {
        1 => (1, u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (2, u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
    };
    let header = text(&bytes[start..start + header_len]);
    assert!(header.contains("<f4"), "npy v{major} {}: {header}", path.display());
    bytes[start + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Every `.npy` of `a` (the parameters) equals `b`'s within `tol`; returns how many were compared.
fn same_params(a: &Path, b: &Path, tol: f32) -> usize {
    let mut compared = 0;
    for entry in std::fs::read_dir(a).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("npy") {
            continue;
        }
        let name = path.file_name().unwrap();
        let (x, y) = (npy(&path), npy(&b.join(name)));
        assert_eq!(x.len(), y.len(), "{name:?}");
        let worst = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        assert!(worst <= tol, "{name:?} differs by {worst} (> {tol})");
        compared += 1;
    }
    compared
}

#[test]
fn the_whole_suite_passes_across_four_processes() {
    let _turn = turn();
    let out = run(
        chorus().args([
            "launch",
            "--nproc-per-node",
            "4",
            "--",
            chorus_path(),
            "conformance",
            "--backend",
            "ucx",
            "--world-size",
            "4",
        ]),
        Duration::from_secs(300),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", text(&out.stderr));
    let summary =
        stdout.lines().rev().find(|l| l.contains(" passed, ")).unwrap_or_else(|| panic!("no summary line: {stdout}"));
    assert!(summary.contains(" 0 failed"), "{summary}");
    let passed: usize = summary.trim_start_matches("[rank 0] ").split(' ').next().unwrap().parse().unwrap();
    assert!(passed > 1000, "{summary}");
    // Only rank 0 reports cases.
    assert!(!stdout.lines().any(|l| l.starts_with("[rank 1] passed")), "{stdout}");
}

fn train_args<'a>(out: &'a str, init: Option<&'a str>) -> Vec<&'a str> {
    let mut v =
        vec!["train", "--model", "mlp", "--world-size", "4", "--steps", "6", "--optimizer", "adamw", "--out-dir", out];
    // The init directory gives the model; without one, these widths.
    match init {
        Some(dir) => v.extend(["--init-dir", dir]),
        None => v.extend(["--dims", "24,80,48,6"]),
    }
    v
}

#[test]
fn fsdp_over_four_processes_equals_the_simulator() {
    let _turn = turn();
    let dir = scratch("train");
    let (sim, ucx) = (dir.join("sim"), dir.join("ucx"));
    let (sim_s, ucx_s) = (sim.to_str().unwrap(), ucx.to_str().unwrap());
    let init = sim.join("init");
    let out = run(chorus().args(train_args(sim_s, None)).args(["--backend", "sim"]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut launch = chorus();
    launch.args(["launch", "--nproc-per-node", "4", "--", chorus_path()]);
    launch.args(train_args(ucx_s, Some(init.to_str().unwrap()))).args(["--backend", "ucx"]);
    let out = run(&mut launch, Duration::from_secs(180));
    assert!(out.status.success(), "stdout: {}\nstderr: {}", text(&out.stdout), text(&out.stderr));
    assert_eq!(same_params(&sim, &ucx, 1e-6), 6, "weights and biases of 3 layers");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `chorus train` with `args(out-dir)` on simulated ranks into `sim`
/// and one rank per process over UCX under `chorus launch` into `ucx`,
/// checks that both runs' losses and every tensor of the model each wrote
/// (`model`, a safetensors file under the out-dir) agree within 1e-6, and
/// returns the losses and how many tensors the model has.
fn sim_and_ucx_agree(args: &dyn Fn(&Path) -> Vec<String>, sim: &Path, ucx: &Path, model: &str) -> (Vec<f64>, usize) {
    let out = run(chorus().args(args(sim)).args(["--backend", "sim"]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut launch = chorus();
    launch.args(["launch", "--nproc-per-node", "4", "--", chorus_path()]).args(args(ucx)).args(["--backend", "ucx"]);
    let out = run(&mut launch, Duration::from_secs(180));
    assert!(out.status.success(), "stdout: {}\nstderr: {}", text(&out.stdout), text(&out.stderr));
    let losses = |d: &Path, backend: &str| -> Vec<f64> {
        let s: serde_json::Value = serde_json::from_slice(&std::fs::read(d.join("summary.json")).unwrap()).unwrap();
        assert_eq!(s["config"]["backend"], backend);
        serde_json::from_value(s["losses"].clone()).unwrap()
    };
    let (on_sim, on_ucx) = (losses(sim, "sim"), losses(ucx, "ucx"));
    assert_eq!(on_sim.len(), on_ucx.len());
    for (a, b) in on_sim.iter().zip(&on_ucx) {
        assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "losses {on_sim:?} vs {on_ucx:?}");
    }
    let (a, b) = (std::fs::read(sim.join(model)).unwrap(), std::fs::read(ucx.join(model)).unwrap());
    let (a, b) =
        (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    assert_eq!(a.len(), b.len());
    for (name, t) in a.tensors() {
        let u = b.tensor(&name).unwrap();
        assert_eq!(t.shape(), u.shape(), "{name}");
        let f = |bytes: &[u8]| -> Vec<f32> {
            bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let worst = f(t.data()).iter().zip(f(u.data())).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-6, "{name} differs by {worst}");
    }
    (on_sim, a.len())
}

/// The transformer through the candle adapter (`--model gpt`) with one rank
/// per process over UCX ends where the simulator's ranks end.
#[test]
fn the_transformer_over_four_processes_equals_the_simulator() {
    let _turn = turn();
    let dir = scratch("gpt");
    let args = |out: &Path| -> Vec<String> {
        ["train", "--model", "gpt", "--world-size", "4", "--batch", "2", "--d-model", "32", "--layers", "2"]
            .iter()
            .map(|s| s.to_string())
            .chain(["--seq-len", "16", "--steps", "5", "--out-dir"].iter().map(|s| s.to_string()))
            .chain([out.display().to_string()])
            .collect()
    };
    let (losses, tensors) = sim_and_ucx_agree(&args, &dir.join("sim"), &dir.join("ucx"), "model.safetensors");
    assert_eq!(losses.len(), 5);
    assert_eq!(tensors, 3 + 2 * 8, "root and two blocks");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The mixture-of-experts transformer (`--model moe`: each rank routes its
/// own tokens, each expert a routed group) with one rank per process over
/// UCX ends where the simulator's ranks end, without a hang.
#[test]
fn the_mixture_of_experts_over_four_processes_equals_the_simulator() {
    let _turn = turn();
    let dir = scratch("moe");
    let args = |out: &Path| -> Vec<String> {
        ["train", "--model", "moe", "--experts", "4", "--world-size", "4", "--batch", "1", "--d-model", "16"]
            .iter()
            .map(|s| s.to_string())
            .chain(["--d-ff", "16", "--seq-len", "8", "--steps", "4", "--out-dir"].iter().map(|s| s.to_string()))
            .chain([out.display().to_string()])
            .collect()
    };
    let (losses, tensors) = sim_and_ucx_agree(&args, &dir.join("sim"), &dir.join("ucx"), "model.safetensors");
    assert_eq!(losses.len(), 4);
    assert_eq!(tensors, 3 + 2 * (5 + 2 + 4 * 2), "root, and two blocks of four experts");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Llama (`--model llama`, started from a Hugging Face directory an
/// earlier run wrote) with one rank per process over UCX ends where the
/// simulator's ranks end: the same losses and the same written model.
#[test]
fn the_llama_over_four_processes_equals_the_simulator() {
    let _turn = turn();
    let dir = scratch("llama");
    let init = dir.join("init");
    let sizes = ["train", "--model", "llama", "--world-size", "4", "--batch", "2", "--seq-len", "16"];
    let mut make_init = chorus();
    make_init.args(sizes).args(["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2"]);
    make_init.args(["--steps", "1", "--backend", "sim", "--out-dir"]).arg(&init);
    let out = run(&mut make_init, Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let model = init.join("model");
    let args = |out: &Path| -> Vec<String> {
        sizes
            .iter()
            .map(|s| s.to_string())
            .chain(["--optimizer", "adamw", "--steps", "4", "--init-from"].iter().map(|s| s.to_string()))
            .chain([model.display().to_string(), "--out-dir".into(), out.display().to_string()])
            .collect()
    };
    let (losses, tensors) = sim_and_ucx_agree(&args, &dir.join("sim"), &dir.join("ucx"), "model/model.safetensors");
    assert_eq!(losses.len(), 4);
    assert_eq!(tensors, 2 + 9 * 2 + 1, "embedding, norm, head and two decoder layers");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn fsdp_under_torchrun_equals_the_simulator() {
    let python = torch_python::torch_python("torch.distributed.run");
    let _turn = turn();
    let dir = scratch("torchrun");
    let (sim, ucx) = (dir.join("sim"), dir.join("ucx"));
    let (sim_s, ucx_s) = (sim.to_str().unwrap(), ucx.to_str().unwrap());
    let out = run(chorus().args(train_args(sim_s, None)).args(["--backend", "sim"]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let init = sim.join("init");
    let port = free_port().to_string();
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1"])
        .args(["--master-port", &port, "--no-python", chorus_path()])
        .args(train_args(ucx_s, Some(init.to_str().unwrap())))
        .args(["--backend", "ucx"]);
    let out = run(&mut cmd, Duration::from_secs(240));
    assert!(out.status.success(), "stdout: {}\nstderr: {}", text(&out.stdout), text(&out.stderr));
    assert_eq!(same_params(&sim, &ucx, 1e-6), 6);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts `n` ranks of `chorus ARGS` with torchrun's variables, joining
/// the test's store (so the store outlives any rank), each writing its pid to `dir/pid.R`; `world(r)` is the
/// world size rank `r` is told.
fn spawn_ranks(
    dir: &Path,
    store: &TcpStoreServer,
    n: usize,
    world: impl Fn(usize) -> usize,
    args: &[&str],
) -> Vec<Child> {
    let port = store.port().to_string();
    (0..n)
        .map(|r| {
            let script = format!("echo $$ > {}/pid.{r}; exec \"$0\" \"$@\"", dir.display());
            Command::new("sh")
                .args(["-c", &script, chorus_path()])
                .args(args)
                .args(["--world-size", &world(r).to_string()])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world(r).to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world(r).to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("CHORUS_UCX_TIMEOUT_S", "10")
                .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                .env("TORCHELASTIC_RUN_ID", "test")
                .env("TORCHELASTIC_RESTART_COUNT", "0")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Ranks that are killed if the test fails before it has waited for them.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn pid(dir: &Path, rank: usize) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(p) =
            std::fs::read_to_string(dir.join(format!("pid.{rank}"))).ok().and_then(|s| s.trim().parse().ok())
        {
            return p;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "rank {rank} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rank_killed_mid_collective_makes_every_other_rank_fail_with_a_typed_error() {
    let _turn = turn();
    let dir = scratch("kill");
    let out = dir.join("out");
    // FSDP training: every rank in collectives all the time.
    let args = [
        "train",
        "--model",
        "mlp",
        "--backend",
        "ucx",
        "--steps",
        "1000000",
        "--dims",
        "64,256,256,8",
        "--out-dir",
        out.to_str().unwrap(),
    ];
    let store = TcpStoreServer::bind_loopback(0).unwrap();
    let mut ranks = Ranks(spawn_ranks(&dir, &store, 4, |_| 4, &args));
    let victim = pid(&dir, 2);
    // Let them get into their all-reduces.
    std::thread::sleep(Duration::from_secs(3));
    let killed_at = Instant::now();
    // SAFETY: kill(2) on a pid this test started.
    assert_eq!(unsafe { libc::kill(victim, libc::SIGKILL) }, 0);
    let victim_child = ranks.0.remove(2);
    let _ = wait_bounded(victim_child, Duration::from_secs(10));
    while let Some(child) = ranks.0.pop() {
        let i = ranks.0.len();
        let out = wait_bounded(child, Duration::from_secs(60));
        let err = text(&out.stderr);
        assert!(!out.status.success(), "a survivor ({i}) exited 0: {err}");
        assert!(
            err.contains("communicator aborted") || err.contains("timed out"),
            "a survivor ({i}) should report an abort or a timeout: {err}"
        );
    }
    // Within the 10 s deadline (and the teardown), not at some later time.
    assert!(killed_at.elapsed() < Duration::from_secs(40), "{:?}", killed_at.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_that_disagree_on_the_world_size_fail_and_say_so() {
    let _turn = turn();
    let dir = scratch("size");
    let args = ["bench", "--backend", "ucx", "--op", "all_reduce", "--min-bytes", "1K", "--max-bytes", "1K"];
    // Rank 0 thinks the world has 2 ranks, ranks 1 and 2 that it has 3.
    let store = TcpStoreServer::bind_loopback(0).unwrap();
    let mut ranks = Ranks(spawn_ranks(&dir, &store, 3, |r| if r == 0 { 2 } else { 3 }, &args));
    while let Some(child) = ranks.0.pop() {
        let r = ranks.0.len();
        let out = wait_bounded(child, Duration::from_secs(60));
        let err = text(&out.stderr);
        assert!(!out.status.success(), "rank {r} exited 0");
        assert!(err.contains("a world of"), "rank {r} should name the sizes: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn under_the_launcher_a_killed_rank_is_named_and_no_process_is_left() {
    let _turn = turn();
    let dir = scratch("launch-kill");
    let script = format!("echo $$ > {}/pid.$RANK; exec \"$0\" \"$@\"", dir.display());
    let child = chorus()
        .args(["launch", "--nproc-per-node", "3", "--grace", "2", "--", "sh", "-c", &script, chorus_path()])
        .args(["bench", "--backend", "ucx", "--world-size", "3", "--op", "all_gather", "--min-bytes", "4M"])
        .args(["--max-bytes", "4M", "--iters", "100000", "--warmup", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids: Vec<i32> = (0..3).map(|r| pid(&dir, r)).collect();
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: kill(2) on a rank this test's launcher started.
    assert_eq!(unsafe { libc::kill(pids[1], libc::SIGKILL) }, 0);
    let out = wait_bounded(child, Duration::from_secs(60));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("rank 1") && err.contains("signal"), "the launcher should name rank 1: {err}");
    for p in pids {
        let start = Instant::now();
        while std::path::Path::new(&format!("/proc/{p}")).exists()
            && !std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| s.contains(") Z"))
        {
            assert!(start.elapsed() < Duration::from_secs(10), "rank pid {p} is still running");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
