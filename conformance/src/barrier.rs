//! A host-side barrier for the threads of a harness or benchmark: it has a
//! deadline and a cancel switch, so one failed thread makes the others return
//! an error instead of waiting for ever.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;

/// A host barrier with a deadline and a cancel switch, so one failed thread
/// makes the others return an error instead of waiting for ever.
pub struct HostBarrier {
    size: usize,
    timeout: Duration,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

#[derive(Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    cancelled: bool,
}

impl HostBarrier {
    /// A barrier for `size` threads; a wait longer than `timeout` is an error.
    pub fn new(size: usize, timeout: Duration) -> HostBarrier {
        HostBarrier { size, timeout, state: Mutex::new(BarrierState::default()), cv: Condvar::new() }
    }

    /// Blocks until all `size` threads have called `wait` (for this round).
    pub fn wait(&self) -> Result<(), crate::Failure> {
        let Ok(mut st) = self.state.lock() else { bail!("host barrier poisoned") };
        if st.cancelled {
            bail!("host barrier cancelled: another thread failed");
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.size {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        while st.generation == generation {
            if st.cancelled {
                bail!("host barrier cancelled: another thread failed");
            }
            let now = Instant::now();
            if now >= deadline {
                bail!("host barrier: not every thread arrived within {:?}", self.timeout);
            }
            st = match self.cv.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(_) => bail!("host barrier poisoned"),
            };
        }
        Ok(())
    }

    /// Makes every current and later `wait` fail.
    pub fn cancel(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.cancelled = true;
        }
        self.cv.notify_all();
    }
}
