//! Testing distributed code inside `cargo test`: a function run on `n`
//! simulated ranks (threads of the test, whatever backend the build
//! selected), each rank's result returned, a failing or panicking rank
//! reported with its message, and a deadline (PyTorch's
//! `MultiThreadedTestCase`).
//!
//! ```
//! use chorus::testing::run_ranks;
//! use chorus::ReduceOp;
//!
//! for n in [2, 4] {
//!     let sums = run_ranks(n, |rank| rank.all_reduce(&[1.0f64], ReduceOp::Sum))?;
//!     assert!(sums.iter().all(|s| s[0] == n as f64));
//! }
//! # Ok::<(), chorus::Error>(())
//! ```
//!
//! The simulated ranks are the strictest backend: stream order is checked
//! on every buffer, and mismatched or missing collectives are errors that
//! name the calls.

use std::time::Duration;

use chorus_collectives::sim::{Fault, SimComm};

use crate::rank::Rank;
use crate::threads::{run_on_threads, sim_maker, sim_world, RankThreads};
use crate::{BoxError, Result};

/// Runs `body` on `n` simulated ranks with [`SimRanks`]'s defaults and
/// returns each rank's result in rank order; the first rank to fail or
/// panic is the error, with its message.
pub fn run_ranks<T, E, F>(n: usize, body: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    E: Into<BoxError> + Send + 'static,
    F: Fn(Rank<SimComm>) -> std::result::Result<T, E> + Send + Sync + 'static,
{
    SimRanks::new(n).run(body)
}

/// A world of simulated ranks for a test: its size, its deadlines, faults to inject.
#[derive(Clone, Debug)]
pub struct SimRanks {
    n: usize,
    timeout: Duration,
    deadline: Duration,
    faults: Vec<Fault>,
    threads_per_rank: Option<usize>,
}

impl SimRanks {
    /// `n` ranks; a collective waits at most 30 s for its peers, and the
    /// whole run at most 120 s.
    pub fn new(n: usize) -> SimRanks {
        SimRanks {
            n,
            timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(120),
            faults: Vec::new(),
            threads_per_rank: None,
        }
    }

    /// How long a collective waits for its peers before every rank fails.
    pub fn timeout(mut self, timeout: Duration) -> SimRanks {
        self.timeout = timeout;
        self
    }

    /// How long the whole run may take before the world is aborted and the
    /// ranks still running are named ([`Error::Deadline`](crate::Error::Deadline)).
    pub fn deadline(mut self, deadline: Duration) -> SimRanks {
        self.deadline = deadline;
        self
    }

    /// Injects a fault into the world's collective sequence (a rank that
    /// fails or never arrives at a given call).
    pub fn fault(mut self, fault: Fault) -> SimRanks {
        self.faults.push(fault);
        self
    }

    /// The threads each rank's candle CPU kernels may use (feature
    /// `candle`; see [`World::threads_per_rank`](crate::World::threads_per_rank)).
    #[cfg(feature = "candle")]
    pub fn threads_per_rank(mut self, threads: usize) -> SimRanks {
        self.threads_per_rank = Some(threads);
        self
    }

    /// Runs `body` on every rank; see [`run_ranks`].
    pub fn run<T, E, F>(self, body: F) -> Result<Vec<T>>
    where
        T: Send + 'static,
        E: Into<BoxError> + Send + 'static,
        F: Fn(Rank<SimComm>) -> std::result::Result<T, E> + Send + Sync + 'static,
    {
        let world = sim_world(self.n, self.timeout)?;
        for f in self.faults {
            world.inject_fault(f)?;
        }
        let how = RankThreads { deadline: Some(self.deadline), pool: self.threads_per_rank };
        run_on_threads(self.n, sim_maker(world), how, body)
    }
}
