//! Host-side polling, written once for every device and vendor library.
//!
//! Host waits on GPUs poll (`cuStreamQuery`, `hipEventQuery`,
//! `ncclCommGetAsyncError`) instead of blocking in the driver, so that every
//! wait has a deadline. How a poll loop pauses decides both its latency and
//! its CPU cost; [`Backoff`] keeps the added latency proportional to the time
//! already waited: it yields the thread for the first
//! [`Backoff::SPIN`], then sleeps an eighth of the time waited so far
//! (at most [`Backoff::MAX_SLEEP`]), so a wait that ends after `t` ends at
//! most about `t / 8` late, and a long wait costs little CPU.

use std::time::{Duration, Instant};

/// The pause between two polls of one wait.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    start: Instant,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new()
    }
}

impl Backoff {
    /// How long a wait only yields the thread between polls.
    pub const SPIN: Duration = Duration::from_micros(200);
    /// The longest single sleep.
    pub const MAX_SLEEP: Duration = Duration::from_millis(1);

    /// A wait starting now.
    pub fn new() -> Backoff {
        Backoff { start: Instant::now() }
    }

    /// Time since the wait started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Whether `timeout` has passed since the wait started.
    pub fn expired(&self, timeout: Duration) -> bool {
        self.elapsed() >= timeout
    }

    /// Pauses before the next poll (see the module documentation).
    pub fn pause(&self) {
        let waited = self.elapsed();
        if waited < Self::SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep((waited / 8).min(Self::MAX_SLEEP));
        }
    }
}

/// Polls `check` until it returns `Ok(true)`, returns an error, or `timeout`
/// passes; then [`DeviceError::Timeout`](crate::DeviceError::Timeout) naming `what`.
pub fn poll_until(timeout: Duration, what: &str, mut check: impl FnMut() -> crate::Result<bool>) -> crate::Result<()> {
    let backoff = Backoff::new();
    loop {
        if check()? {
            return Ok(());
        }
        if backoff.expired(timeout) {
            return Err(crate::DeviceError::Timeout { what: what.to_string(), waited: timeout });
        }
        backoff.pause();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_that_ends_is_not_late_by_more_than_an_eighth() {
        // The condition becomes true after 20 ms; the loop must see it well
        // before a fixed 1 ms-granularity backoff's worst case plus slack.
        let start = Instant::now();
        let ready_at = Duration::from_millis(20);
        poll_until(Duration::from_secs(5), "test", || Ok(start.elapsed() >= ready_at)).unwrap();
        let late = start.elapsed() - ready_at;
        // ready_at / 8 = 2.5 ms, plus the scheduler's own slack.
        assert!(late < Duration::from_millis(20), "late by {late:?}");
    }

    #[test]
    fn a_wait_that_never_ends_times_out_with_its_name() {
        let e = poll_until(Duration::from_millis(5), "the moon", || Ok(false)).unwrap_err();
        assert!(matches!(e, crate::DeviceError::Timeout { ref what, .. } if what == "the moon"), "{e}");
    }

    #[test]
    fn a_failing_check_ends_the_wait_with_its_error() {
        let e = poll_until(Duration::from_secs(5), "x", || Err(crate::DeviceError::invalid("probe", "broken")))
            .unwrap_err();
        assert!(matches!(e, crate::DeviceError::InvalidArgument { op: "probe", .. }), "{e}");
    }
}
