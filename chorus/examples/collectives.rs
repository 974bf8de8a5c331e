//! Collectives on four ranks, values checked: the first program to run.
//!
//! ```sh
//! cargo run -p chorus --example collectives                 # 4 simulated ranks (threads)
//! chorus launch --nproc-per-node 4 -- target/debug/examples/collectives   # built with --features ucx
//! ```
use chorus::prelude::*;

fn main() -> chorus::Result<()> {
    let results = chorus::run(4, |rank| -> chorus::Result<(Vec<f32>, Vec<f32>)> {
        let r = rank.rank() as f32;
        let sum = rank.all_reduce(&[r, 1.0], ReduceOp::Sum)?;
        let gathered = rank.all_gather(&[r * 10.0, r * 10.0 + 1.0])?;
        Ok((sum, gathered))
    })?;
    for (sum, gathered) in &results {
        let n = gathered.len() / 2;
        let want_sum = [(0..n).sum::<usize>() as f32, n as f32];
        let want_gathered: Vec<f32> = (0..n).flat_map(|r| [r as f32 * 10.0, r as f32 * 10.0 + 1.0]).collect();
        assert_eq!(sum[..], want_sum, "all_reduce");
        assert_eq!(*gathered, want_gathered, "all_gather");
    }
    // With threads, every rank's results are here; under a launcher, this process's rank's.
    let world = results[0].1.len() / 2;
    println!("{} of {world} {} ranks: all_reduce and all_gather as expected", results.len(), chorus::SELECTED_BACKEND);
    Ok(())
}
