//! The guardian: a small child of the launcher that kills every rank's
//! process group when the launcher dies, however it dies (SIGKILL
//! included).
//!
//! `PR_SET_PDEATHSIG` kills a rank when the launcher dies, but not what the
//! rank started. The guardian holds the read end of a pipe whose write end
//! only the launcher holds (close-on-exec, so ranks never inherit it). The
//! launcher sends each rank's process group id as the rank starts, and
//! withdraws it when it reaps the rank (after killing what the rank left in
//! its group, while the exited leader still holds the id). When the
//! launcher dies, its end of the pipe closes, the guardian's read returns
//! end-of-file, and the guardian sends SIGKILL to every group still
//! recorded and exits. A launcher that ends normally has withdrawn every
//! group, so the guardian then kills nothing.
//!
//! The launcher has threads when the guardian is forked, so the guardian
//! runs only async-signal-safe calls (`read`, `kill`, `_exit` and a few set-up
//! calls) on memory allocated before the fork.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// One message: the rank's slot (its local rank) and its process group id,
/// 0 to withdraw it. Eight bytes, under `PIPE_BUF`: a write is all or nothing.
const MESSAGE: usize = 8;

/// The launcher's side of the guardian.
pub struct Guardian {
    pid: libc::pid_t,
    write: OwnedFd,
    /// Set once a message could not be sent; reported once.
    broken: bool,
}

impl Guardian {
    /// Forks the guardian, with room for `slots` process groups.
    pub fn start(slots: usize) -> io::Result<Guardian> {
        let mut fds: [RawFd; 2] = [-1; 2];
        // SAFETY: pipe2 writes two descriptors into the array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned here only.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // The launcher never blocks on the guardian: a pipe holds 64 KiB, the
        // two messages of each of 4096 ranks (a job has at most 1023 per
        // node), and a guardian that stops reading makes a write fail, which
        // is reported, rather than wait.
        // SAFETY: fcntl on a descriptor owned here.
        unsafe {
            let flags = libc::fcntl(write.as_raw_fd(), libc::F_GETFL);
            if flags < 0 || libc::fcntl(write.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // Everything the child uses is allocated before the fork.
        let mut table: Vec<libc::pid_t> = vec![0; slots];
        let mut open_files = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit fills the struct.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut open_files) };
        let last_fd = open_files.rlim_cur.min(1 << 20) as libc::c_int;
        // SAFETY: fork; the child runs only `guardian_main`, which is
        // async-signal-safe and never returns.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => guardian_main(read.as_raw_fd(), write.as_raw_fd(), &mut table, last_fd),
            pid => {
                drop(read);
                Ok(Guardian { pid, write, broken: false })
            }
        }
    }

    /// The guardian's pid (a child of the launcher, reaped like the ranks).
    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Records the process group of the rank in `slot`.
    pub fn record(&mut self, slot: usize, pgid: libc::pid_t) {
        self.send(slot, pgid);
    }

    /// Withdraws the process group of the rank in `slot` (it was reaped).
    pub fn withdraw(&mut self, slot: usize) {
        self.send(slot, 0);
    }

    /// Notes that the guardian process has exited (someone killed it).
    pub fn exited(&mut self) {
        self.report_broken("it exited".into());
    }

    fn send(&mut self, slot: usize, pgid: libc::pid_t) {
        if self.broken {
            return;
        }
        let mut message = [0u8; MESSAGE];
        message[..4].copy_from_slice(&(slot as u32).to_ne_bytes());
        message[4..].copy_from_slice(&pgid.to_ne_bytes());
        // SAFETY: write of a local buffer to a descriptor owned here.
        let written = unsafe { libc::write(self.write.as_raw_fd(), message.as_ptr().cast(), MESSAGE) };
        if written != MESSAGE as isize {
            self.report_broken(io::Error::last_os_error().to_string());
        }
    }

    fn report_broken(&mut self, why: String) {
        if !self.broken {
            self.broken = true;
            eprintln!(
                "chorus launch: the guardian (pid {}) that kills the ranks' process groups if the launcher is \
                 killed is gone ({why}); what a rank starts may now outlive a killed launcher",
                self.pid
            );
        }
    }
}

/// The guardian process: reads messages until end-of-file, then kills every
/// recorded group. Only async-signal-safe calls; no allocation, no panic.
fn guardian_main(read_fd: RawFd, write_fd: RawFd, table: &mut [libc::pid_t], last_fd: libc::c_int) -> ! {
    // SAFETY: every call below is async-signal-safe and works on memory
    // owned by this (single-threaded) child.
    unsafe {
        libc::close(write_fd);
        // Out of the launcher's process group and deaf to the terminal's and
        // the job's stop signals: the launcher handles those; the guardian's
        // one job is what happens after the launcher is gone.
        libc::setpgid(0, 0);
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGPIPE] {
            libc::signal(signal, libc::SIG_IGN);
        }
        libc::chdir(c"/".as_ptr());
        // Hold nothing of the launcher's: its stdout (a reader would wait for
        // the guardian's end-of-file), its store's sockets.
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
        }
        let fd = 3;
        if read_fd != fd && libc::dup2(read_fd, fd) != fd {
            libc::_exit(1);
        }
        if libc::syscall(libc::SYS_close_range, 4 as libc::c_uint, libc::c_uint::MAX, 0 as libc::c_uint) != 0 {
            for other in 4..last_fd.max(4) {
                libc::close(other);
            }
        }
        let mut buf = [0u8; 4096];
        let mut have = 0usize;
        loop {
            let n = libc::read(fd, buf.as_mut_ptr().add(have).cast(), buf.len() - have);
            if n == 0 {
                break;
            }
            if n < 0 {
                if *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                break;
            }
            have += n as usize;
            let whole = have - have % MESSAGE;
            let mut at = 0;
            while at < whole {
                let mut slot = [0u8; 4];
                let mut pgid = [0u8; 4];
                std::ptr::copy_nonoverlapping(buf.as_ptr().add(at), slot.as_mut_ptr(), 4);
                std::ptr::copy_nonoverlapping(buf.as_ptr().add(at + 4), pgid.as_mut_ptr(), 4);
                if let Some(entry) = table.get_mut(u32::from_ne_bytes(slot) as usize) {
                    *entry = libc::pid_t::from_ne_bytes(pgid);
                }
                at += MESSAGE;
            }
            std::ptr::copy(buf.as_ptr().add(whole), buf.as_mut_ptr(), have - whole);
            have -= whole;
        }
        for &pgid in table.iter() {
            if pgid > 0 {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
        libc::_exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command};
    use std::time::{Duration, Instant};

    fn sleeper() -> Child {
        Command::new("sleep").arg("1000").process_group(0).spawn().unwrap()
    }

    /// Waits (bounded) for `child` to end; its status.
    fn ended(child: &mut Child) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn when_the_launchers_end_of_the_pipe_closes_every_recorded_group_is_killed() {
        let (mut kept, mut withdrawn) = (sleeper(), sleeper());
        let mut g = Guardian::start(4).unwrap();
        g.record(0, kept.id() as libc::pid_t);
        g.record(3, withdrawn.id() as libc::pid_t);
        g.withdraw(3);
        let pid = g.pid();
        // What the launcher's death does to the pipe.
        drop(g);
        let mut raw = 0;
        // SAFETY: waitpid on the guardian, a child of this process.
        assert_eq!(unsafe { libc::waitpid(pid, &mut raw, 0) }, pid);
        assert_eq!(std::process::ExitStatus::from_raw(raw).code(), Some(0));
        assert_eq!(ended(&mut kept).and_then(|s| s.signal()), Some(libc::SIGKILL));
        // The withdrawn group was left alone.
        assert_eq!(withdrawn.try_wait().unwrap(), None);
        withdrawn.kill().unwrap();
        withdrawn.wait().unwrap();
    }
}
