//! Copies every rank's stdout and stderr to the launcher's, each line
//! prefixed with `[rank R] `: one thread for all ranks, waiting on an epoll
//! set of their pipes (a thread per pipe would make the launcher's threads,
//! and with them the cost of each fork, grow with the rank count).
//!
//! A line longer than 64 KiB is cut into several; a last line without a
//! newline gets one. Lines of one read are written together, each whole.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest line written whole.
const MAX_LINE: usize = 64 * 1024;

/// One rank's stdout or stderr.
struct Source {
    fd: OwnedFd,
    prefix: String,
    stderr: bool,
    /// Bytes read that do not end a line yet.
    pending: Vec<u8>,
}

/// What the launcher and the forwarding thread share.
struct Shared {
    epoll: OwnedFd,
    /// Indexed by the epoll token; `None` once the pipe reached end-of-file
    /// (or while the thread is writing its lines).
    sources: Mutex<Vec<Option<Source>>>,
    /// Pipes not at end-of-file yet.
    open: AtomicUsize,
    stop: AtomicBool,
}

/// The forwarding thread and its pipes.
pub struct Forwarder {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Starts the forwarding thread (it waits for pipes to be added).
    pub fn start() -> io::Result<Forwarder> {
        // SAFETY: epoll_create1 returns a new descriptor or -1.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            // SAFETY: the descriptor was just created and is owned here only.
            epoll: unsafe { OwnedFd::from_raw_fd(epoll) },
            sources: Mutex::new(Vec::new()),
            open: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let thread = std::thread::Builder::new().name("rank-output".into()).spawn({
            let shared = shared.clone();
            move || forward(&shared)
        })?;
        Ok(Forwarder { shared, thread: Some(thread) })
    }

    /// Forwards `pipe` (rank `rank`'s stdout, or its stderr) until it ends.
    pub fn add(&self, pipe: OwnedFd, rank: usize, stderr: bool) -> io::Result<()> {
        let fd = pipe.as_raw_fd();
        // SAFETY: fcntl on a descriptor owned here; only the launcher's end
        // becomes non-blocking (the rank's end is another open file).
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let token = {
            let mut sources = self.shared.sources.lock().unwrap_or_else(|p| p.into_inner());
            sources.push(Some(Source { fd: pipe, prefix: format!("[rank {rank}] "), stderr, pending: Vec::new() }));
            sources.len() - 1
        };
        self.shared.open.fetch_add(1, Ordering::SeqCst);
        let mut event = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token as u64 };
        // SAFETY: epoll_ctl with a live epoll descriptor, a live pipe and a local event.
        if unsafe { libc::epoll_ctl(self.shared.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) } != 0 {
            let e = io::Error::last_os_error();
            self.shared.sources.lock().unwrap_or_else(|p| p.into_inner())[token] = None;
            self.shared.open.fetch_sub(1, Ordering::SeqCst);
            return Err(e);
        }
        Ok(())
    }

    /// Waits (at most `limit`) for every pipe to end, then stops the thread.
    /// A process that left its rank's group may hold a pipe open; it is not
    /// waited for.
    pub fn finish(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.shared.open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        // The thread sees `stop` within one epoll wait; one blocked writing
        // to a stdout nobody reads is left behind.
        let deadline = Instant::now() + Duration::from_millis(500);
        while self.thread.as_ref().is_some_and(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(t) = self.thread.take().filter(JoinHandle::is_finished) {
            let _ = t.join();
        }
    }
}

/// The forwarding thread's loop.
fn forward(shared: &Shared) {
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut chunk = vec![0u8; MAX_LINE];
    let mut lines = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        // SAFETY: epoll_wait fills at most `events.len()` entries of the vector.
        let n = unsafe {
            libc::epoll_wait(shared.epoll.as_raw_fd(), events.as_mut_ptr(), events.len() as libc::c_int, 100)
        };
        for event in events.iter().take(n.max(0) as usize) {
            let token = event.u64 as usize;
            // Taken out while its lines are written, so that adding a pipe
            // never waits behind a blocked stdout.
            let Some(mut source) =
                shared.sources.lock().unwrap_or_else(|p| p.into_inner()).get_mut(token).and_then(Option::take)
            else {
                continue;
            };
            // SAFETY: read into a local buffer from a descriptor owned by `source`.
            let got = unsafe { libc::read(source.fd.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
            let ended = match got {
                0 => true,
                n if n > 0 => {
                    source.pending.extend_from_slice(&chunk[..n as usize]);
                    false
                }
                _ => {
                    !matches!(io::Error::last_os_error().kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted)
                }
            };
            lines.clear();
            split_lines(&mut source.pending, &source.prefix, ended, &mut lines);
            if !lines.is_empty() {
                // A closed launcher stdout (`| head`) is not the rank's problem.
                let _ = if source.stderr {
                    write_all(&mut io::stderr().lock(), &lines)
                } else {
                    write_all(&mut io::stdout().lock(), &lines)
                };
            }
            if ended {
                // Closing the pipe takes it out of the epoll set.
                shared.open.fetch_sub(1, Ordering::SeqCst);
            } else {
                shared.sources.lock().unwrap_or_else(|p| p.into_inner())[token] = Some(source);
            }
        }
    }
}

fn write_all(out: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    out.write_all(bytes)?;
    out.flush()
}

/// Moves the whole lines of `pending` (each cut at [`MAX_LINE`] bytes) to
/// `out`, each prefixed and ending in a newline; at end-of-file the rest too.
fn split_lines(pending: &mut Vec<u8>, prefix: &str, at_end: bool, out: &mut Vec<u8>) {
    let mut start = 0;
    loop {
        let rest = &pending[start..];
        let window = &rest[..rest.len().min(MAX_LINE)];
        let len = match window.iter().position(|&b| b == b'\n') {
            Some(i) => i + 1,
            None if rest.len() >= MAX_LINE => MAX_LINE,
            None if at_end && !rest.is_empty() => rest.len(),
            None => break,
        };
        out.extend_from_slice(prefix.as_bytes());
        out.extend_from_slice(&rest[..len]);
        if !rest[..len].ends_with(b"\n") {
            out.push(b'\n');
        }
        start += len;
    }
    pending.drain(..start);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(input: &[u8], at_end: bool) -> (String, usize) {
        let mut pending = input.to_vec();
        let mut out = Vec::new();
        split_lines(&mut pending, "[rank 3] ", at_end, &mut out);
        (String::from_utf8(out).unwrap(), pending.len())
    }

    #[test]
    fn whole_lines_are_prefixed_and_a_partial_one_waits() {
        assert_eq!(split(b"a\nbc\nde", false), ("[rank 3] a\n[rank 3] bc\n".into(), 2));
        assert_eq!(split(b"a\nde", true), ("[rank 3] a\n[rank 3] de\n".into(), 0));
        assert_eq!(split(b"", true), (String::new(), 0));
    }

    #[test]
    fn long_lines_are_cut_at_64_kib() {
        let mut long = vec![b'x'; MAX_LINE + 10];
        long.push(b'\n');
        let (out, left) = split(&long, false);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(left, 0);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), "[rank 3] ".len() + MAX_LINE);
        assert_eq!(lines[1], format!("[rank 3] {}", "x".repeat(10)));
    }
}
