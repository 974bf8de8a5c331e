//! How one timed iteration is measured, for collectives and for the memcpy reference alike.
//!
//! Every thread (a rank, or a memcpy worker) waits at a host barrier, notes
//! when it starts, does its part (enqueue and synchronize, or copy), and
//! notes when it ends. One iteration's time is the window from the earliest
//! start to the latest end over the threads: the barrier's release to the
//! slowest rank's completion. A run's time is the median over its timed
//! iterations (robust against the scheduler on a small machine).

use std::time::{Duration, Instant};

use anyhow::bail;

pub use chorus_conformance::HostBarrier;

/// One thread's start and end of each timed iteration.
pub type Spans = Vec<(Instant, Instant)>;

/// What the ranks wait at before each iteration: a host barrier for rank
/// threads, the communicator's barrier for ranks that are processes.
pub trait IterBarrier {
    /// Blocks until every rank has arrived.
    fn wait(&self) -> anyhow::Result<()>;
    /// Makes the other ranks' waits fail (this rank has failed).
    fn cancel(&self);
}

impl<B: IterBarrier + ?Sized> IterBarrier for std::sync::Arc<B> {
    fn wait(&self) -> anyhow::Result<()> {
        (**self).wait()
    }
    fn cancel(&self) {
        (**self).cancel()
    }
}

impl IterBarrier for HostBarrier {
    fn wait(&self) -> anyhow::Result<()> {
        HostBarrier::wait(self)
    }
    fn cancel(&self) {
        HostBarrier::cancel(self)
    }
}

/// Runs `warmup + iters` iterations of `body` between barrier waits and
/// returns the spans of the timed ones. On error, cancels the barrier.
pub fn timed_loop(
    barrier: &dyn IterBarrier,
    warmup: usize,
    iters: usize,
    mut body: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Spans> {
    let mut spans = Vec::with_capacity(iters);
    let mut go = || -> anyhow::Result<()> {
        for i in 0..warmup + iters {
            barrier.wait()?;
            let start = Instant::now();
            body()?;
            let end = Instant::now();
            if i >= warmup {
                spans.push((start, end));
            }
        }
        Ok(())
    };
    let result = go();
    if result.is_err() {
        barrier.cancel();
    }
    result.map(|()| spans)
}

/// The median over iterations of each iteration's window (earliest start to
/// latest end over the threads).
pub fn median_window(per_thread: &[Spans]) -> anyhow::Result<Duration> {
    let iters = per_thread.first().map_or(0, Vec::len);
    if iters == 0 || per_thread.iter().any(|s| s.len() != iters) {
        bail!("the threads timed different numbers of iterations");
    }
    let mut windows: Vec<Duration> = (0..iters)
        .map(|i| {
            let start = per_thread.iter().map(|s| s[i].0).min();
            let end = per_thread.iter().map(|s| s[i].1).max();
            match (start, end) {
                (Some(s), Some(e)) => e.saturating_duration_since(s),
                _ => Duration::ZERO,
            }
        })
        .collect();
    windows.sort();
    let mid = windows.len() / 2;
    Ok(if windows.len() % 2 == 1 { windows[mid] } else { (windows[mid - 1] + windows[mid]) / 2 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_window_spans_the_earliest_start_to_the_latest_end() {
        let t = Instant::now();
        let ms = |m| t + Duration::from_millis(m);
        let a = vec![(ms(0), ms(10)), (ms(20), ms(25)), (ms(30), ms(31))];
        let b = vec![(ms(2), ms(12)), (ms(21), ms(40)), (ms(30), ms(33))];
        // Windows 12, 20 and 3 ms: the median is 12.
        assert_eq!(median_window(&[a, b]).unwrap(), Duration::from_millis(12));
    }

    #[test]
    fn a_failed_thread_releases_the_others() {
        let barrier = Arc::new(HostBarrier::new(2, Duration::from_secs(30)));
        let b = barrier.clone();
        let waiter = std::thread::spawn(move || timed_loop(&b, 0, 3, || Ok(())));
        let failed = timed_loop(&barrier, 0, 3, || anyhow::bail!("boom"));
        assert!(failed.is_err());
        assert!(waiter.join().unwrap().is_err());
    }
}
