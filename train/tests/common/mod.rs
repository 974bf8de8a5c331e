//! What the tests of the training loops share.
#![allow(dead_code)] // each test file uses what it needs

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

/// Each rank's report, in rank order; a rank that failed fails the test, naming it.
pub fn unwrap_ranks<T, E: std::fmt::Display>(results: Vec<Result<T, E>>) -> Vec<T> {
    results.into_iter().enumerate().map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

/// The largest relative difference (`|a - b| / (1 + |b|)`) between two
/// sets of named parameters, which must have the same names and sizes.
pub fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let sorted = |v: &[(String, Vec<f32>)]| {
        let mut v = v.to_vec();
        v.sort_by(|x, y| x.0.cmp(&y.0));
        v
    };
    let (a, b) = (sorted(a), sorted(b));
    assert_eq!(a.iter().map(|p| &p.0).collect::<Vec<_>>(), b.iter().map(|p| &p.0).collect::<Vec<_>>());
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.1.len(), y.1.len());
        for (u, v) in x.1.iter().zip(&y.1) {
            worst = worst.max((u - v).abs() / (1.0 + v.abs()));
        }
    }
    worst
}

/// Makes a FIFO at `path` (what a user might give as a data or weights
/// file by mistake: reading one blocks until a writer comes).
#[cfg(unix)]
pub fn mkfifo(path: &std::path::Path) {
    extern "C" {
        fn mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("a path without NUL");
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}
