//! `chorus bench --backend sim`: a world of rank threads, timed per iteration.
//!
//! Each (operation, size) gets a fresh world whose devices run with the
//! stream sanitizer **off** (it checks every enqueue against vector clocks,
//! which is not what a bandwidth number should include). Every rank fills
//! its input from the pattern, then runs the warm-up and timed iterations of
//! [`timed_loop`](super::timing::timed_loop): enqueue the collective on its stream, synchronize the
//! stream. After the timed iterations each rank reads its output back (in
//! pieces, to bound host memory) and counts the elements that differ from
//! the host-computed expectation.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::with_element;

use super::geometry::{Geometry, Measured};
use super::rank::measure_rank;
use super::timing::{median_window, HostBarrier};

/// Deadline of every rendezvous and device wait: generous, because a large
/// collective on a small machine is slow, and a bench should not time out.
const DEADLINE: Duration = Duration::from_secs(600);

fn config() -> SimConfig {
    // SAFETY: each rank's collectives run on one stream, and the host
    // synchronizes it before touching the buffers again; the ranks' buffers
    // meet only inside the sim's rendezvous, which orders them itself.
    SimConfig { timeout: DEADLINE, device: unsafe { CpuConfig::default().with_timeout(DEADLINE).without_sanitizer() } }
}

/// Measures one collective of geometry `g`.
pub fn measure(g: Geometry, warmup: usize, iters: usize) -> anyhow::Result<Measured> {
    let barrier = Arc::new(HostBarrier::new(g.n, DEADLINE));
    let results = SimWorld::run(g.n, config(), move |comm| {
        let out = with_element!(g.dtype, T => measure_rank::<SimComm, T>(&comm, g, &barrier, warmup, iters));
        if let Err(e) = &out {
            // Peers may wait for this rank at the barrier or in a collective.
            barrier.cancel();
            comm.abort(&format!("{e:#}"));
        }
        out
    })
    .context("could not start the sim world")?;
    let mut spans = Vec::with_capacity(g.n);
    let mut wrong = 0;
    for (r, result) in results.into_iter().enumerate() {
        let (s, w) = result.with_context(|| format!("rank {r}"))?.with_context(|| format!("rank {r}"))?;
        spans.push(s);
        wrong += w;
    }
    Ok(Measured { time: median_window(&spans)?, wrong })
}
