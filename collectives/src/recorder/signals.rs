//! The dump signals. SIGUSR1 asks every rank of the process for a dump and
//! the process goes on (without a dump directory it says that nothing was
//! written, instead of dying by SIGUSR1's default action); SIGTERM and
//! SIGINT, where some ring has a dump directory, dump and then end the
//! process as the signal would have (its conventional exit status).
//!
//! The handler only sets the signal's bit. A thread of its own takes it
//! and has the dumps written by another thread, which it waits for at most
//! [`DUMP_WAIT`]: a file system that hangs (an fsync that never returns)
//! cannot keep a stopped run alive. A second SIGTERM or SIGINT while the
//! dump is written ends the process at once (the handler resets itself).
//! Only signals at their default action get the handler; none does when
//! the recorder's threads could not start (nobody would answer them).
//!
//! A program with files of its own to remove on the way out (staged
//! outputs, locks) answers the ending signals from its start
//! ([`answer_ending_signals`]): SIGHUP too, and its clean-up runs after the
//! dumps and before the process ends.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::Duration;

use super::dump::SIGNAL_REASON;
use super::monitor;
use super::options::{DIR_VAR, POLL_INTERVAL};

/// How long a signal waits for the dumps before the process goes on (SIGUSR1)
/// or ends without them (SIGTERM, SIGINT).
pub const DUMP_WAIT: Duration = Duration::from_secs(3);

/// The signals received and not yet answered, one bit per signal number.
static PENDING: AtomicU32 = AtomicU32::new(0);

/// The signals that end the process once answered, in the order a batch of
/// them is answered.
const ENDING: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// What runs before an ending signal ends the process ([`answer_ending_signals`]).
static BEFORE_END: OnceLock<fn()> = OnceLock::new();

extern "C" fn on_signal(signal: libc::c_int) {
    // Only an atomic operation: no allocation, no lock (async-signal-safe).
    if (0..32).contains(&signal) {
        PENDING.fetch_or(1 << signal, Ordering::SeqCst);
    }
}

/// Installs the handlers (SIGTERM and SIGINT only when `dumps`: a ring has a
/// dump directory), each once, and starts the thread that answers them.
pub(super) fn install(dumps: bool) {
    let wanted: &[libc::c_int] = if dumps { &[libc::SIGUSR1, libc::SIGTERM, libc::SIGINT] } else { &[libc::SIGUSR1] };
    install_these(wanted);
}

/// Answers SIGUSR1 from now on as a communicator's recorder does, and
/// SIGTERM, SIGINT and SIGHUP too (each only where it is at its default
/// action): the dumps that are due are written, then `before_end` runs
/// (on the signal thread, once; the first program's is kept), then the
/// process ends as the signal would have. For a program that must remove
/// what it staged, its locks included, when it is interrupted.
pub fn answer_ending_signals(before_end: fn()) {
    let _ = BEFORE_END.set(before_end);
    install_these(&[libc::SIGUSR1, libc::SIGTERM, libc::SIGINT, libc::SIGHUP]);
}

fn install_these(wanted: &[libc::c_int]) {
    // UCX takes SIGHUP at start-up: given back first, so it is seen at its default.
    #[cfg(feature = "ucx")]
    crate::ucx::give_back_sighup();
    static THREAD: OnceLock<bool> = OnceLock::new();
    let running =
        *THREAD.get_or_init(|| match std::thread::Builder::new().name("chorus-signals".into()).spawn(answer) {
            Ok(_) => true,
            Err(e) => {
                eprintln!(
                    "chorus: the flight recorder's signal thread could not start ({e}); signals keep their actions"
                );
                false
            }
        });
    if !running {
        return;
    }
    static DONE: Mutex<Vec<libc::c_int>> = Mutex::new(Vec::new());
    let Ok(mut done) = DONE.lock() else { return };
    for &signal in wanted {
        if !done.contains(&signal) {
            done.push(signal);
            install_one(signal, signal != libc::SIGUSR1);
        }
    }
}

/// Sets [`on_signal`] for `signal` if it is at its default action (a
/// program's own handler, or an ignored signal, is left alone); `once`:
/// the handler resets to the default when it runs.
fn install_one(signal: libc::c_int, once: bool) {
    // SAFETY: sigaction reads the current action into `old` (a null new
    // action changes nothing), then installs a handler that only does an
    // atomic read-modify-write, which is async-signal-safe.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
            return;
        }
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = on_signal as *const () as libc::sighandler_t;
        new.sa_flags = libc::SA_RESTART | if once { libc::SA_RESETHAND } else { 0 };
        libc::sigemptyset(&mut new.sa_mask);
        libc::sigaction(signal, &new, std::ptr::null_mut());
    }
}

/// The signal thread: answers each signal taken from [`PENDING`].
fn answer() {
    loop {
        std::thread::sleep(POLL_INTERVAL);
        let pending = PENDING.swap(0, Ordering::SeqCst);
        if pending == 0 {
            continue;
        }
        let has = |s: libc::c_int| pending & (1 << s) != 0;
        let ending = ENDING.into_iter().find(|&s| has(s));
        let signal = ending.unwrap_or(libc::SIGUSR1);
        let name = name(signal);
        match dump_within(&format!("{SIGNAL_REASON}{name}"), DUMP_WAIT) {
            Some(0) if ending.is_none() => {
                eprintln!("chorus: {name}: no flight-recorder dump written ({DIR_VAR} is not set)")
            }
            Some(_) => {}
            None => eprintln!(
                "chorus: {name}: the flight-recorder dumps did not finish within {} s (a hung file system?); {}",
                DUMP_WAIT.as_secs(),
                if ending.is_some() { "ending without them" } else { "going on" }
            ),
        }
        if let Some(signal) = ending {
            if let Some(before_end) = BEFORE_END.get() {
                before_end();
            }
            end_by(signal);
        }
    }
}

/// Writes every dump for `reason` on a thread of its own and waits at most
/// `wait`; the directories written, `None` when the writing did not finish.
pub(super) fn dump_within(reason: &str, wait: Duration) -> Option<usize> {
    let (done, finished) = mpsc::channel();
    let reason = reason.to_string();
    let spawned = std::thread::Builder::new().name("chorus-dump".into()).spawn(move || {
        let _ = done.send(monitor::write_all(&reason));
    });
    match spawned {
        Ok(_) => finished.recv_timeout(wait).ok(),
        Err(_) => None,
    }
}

/// Ends the process by `signal`'s default action, so its exit status says
/// which signal ended it (as if no handler had been installed).
fn end_by(signal: libc::c_int) -> ! {
    // SAFETY: signal(2) and kill(2) touch no memory of this process; kill
    // (unlike raise) reaches any thread that does not block the signal.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::kill(libc::getpid(), signal);
    }
    // Every thread blocks it: the conventional status of a process it ended.
    std::thread::sleep(Duration::from_millis(200));
    std::process::exit(128 + signal)
}

/// The signal's name as the dumps' reasons write it.
fn name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        _ => "SIGUSR1",
    }
}
