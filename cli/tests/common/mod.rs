//! What the CLI's end-to-end tests share: the binary, bounded waits,
//! scratch directories, free ports and process liveness.
#![allow(dead_code)] // each test file uses its own part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub fn chorus_path() -> &'static str {
    env!("CARGO_BIN_EXE_chorus")
}

/// The binary, its flight-recorder dumps (of ranks that fail or are
/// stopped) going to a scratch directory instead of the current one, and
/// the signals the tests send at their default action (`default_signals`).
pub fn chorus() -> Command {
    let mut cmd = Command::new(chorus_path());
    // Under the target directory: the dumps of every failing rank of every
    // run would otherwise pile up in the temporary directory.
    cmd.env(
        "CHORUS_TRACE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chorus-cli-trace-{}", std::process::id())),
    );
    default_signals(&mut cmd);
    cmd
}

/// The signals tests send to a child (SIGINT, SIGTERM, SIGHUP, SIGQUIT,
/// SIGUSR1, SIGUSR2) at their default action in it, and its signal mask
/// empty, whatever this test process inherited. A suite started in the
/// background by a script (`nohup bash ci/test.sh &`) has SIGINT ignored;
/// the child would inherit that, chorus rightly keeps an inherited ignore,
/// and a test that interrupts it would see it run to the end. Every test
/// that signals a child it starts without `chorus()` calls this itself.
/// A test that wants an ignored signal adds its own `pre_exec` after this
/// one (they run in order).
pub fn default_signals(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls (sigemptyset, pthread_sigmask,
    // signal) between fork and exec; no memory of the parent is touched.
    unsafe {
        cmd.pre_exec(|| {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2] {
                if libc::signal(signal, libc::SIG_DFL) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Waits for `child` at most `limit`, then kills it and fails with its output.
pub fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {limit:?}; stdout: {}\nstderr: {}", text(&out.stdout), text(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

/// Runs `cmd` to the end (at most `limit`), its output going to files so a
/// long output cannot fill a pipe nobody reads while waiting.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Output {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("chorus-cli-out-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (o, e) = (dir.join("stdout"), dir.join("stderr"));
    let child =
        cmd.stdout(std::fs::File::create(&o).unwrap()).stderr(std::fs::File::create(&e).unwrap()).spawn().unwrap();
    let mut out = wait_bounded(child, limit);
    out.stdout = std::fs::read(&o).unwrap_or_default();
    out.stderr = std::fs::read(&e).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// A fresh, empty directory unique to this test process, removed when the
/// test ends unless it failed (what a failed test left is kept to look at):
/// a suite run again and again must not fill the temporary directory.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("chorus-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A test's scratch directory ([`scratch`]); a path everywhere one is taken.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A loopback port that is free now, for a store a test's launcher will
/// host. Drawn below Linux's ephemeral range (32768 and up), where the
/// kernel's own choice (`bind :0`) would land: every outgoing connection of
/// every test running at the same time takes its port from that range, so a
/// port chosen there is often taken again before the launcher listens.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    for _ in 0..1000 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let port = 20000 + (h.finish() % 12000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between 20000 and 32000");
}

/// Whether a process runs (a zombie does not: it has exited).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Fails unless every process of `pids` has exited within 5 s.
pub fn assert_all_dead(pids: &[u32]) {
    let start = Instant::now();
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "left running: {:?}",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A C-order `.npy` file with dtype `descr`, `shape` and raw little-endian `data`.
pub fn npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}
