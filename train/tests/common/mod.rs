//! What the tests of the training loops share.

use std::sync::Arc;

use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::Communicator;

/// Runs `body` on `ranks` simulated ranks and returns what each rank
/// returned, in rank order; a rank that panics fails the test.
pub fn on_sim_ranks<T: Send + 'static>(
    ranks: usize,
    body: impl Fn(Arc<Communicator<SimComm>>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    SimWorld::run(ranks, SimConfig::default(), move |comm| body(Arc::new(comm)))
        .expect("sim world")
        .into_iter()
        .map(|r| r.expect("rank finished"))
        .collect()
}
