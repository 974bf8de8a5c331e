//! Testing your distributed code in `cargo test`: the same function on 2
//! and 4 simulated ranks, each rank's result checked.
//!
//! ```sh
//! cargo test -p chorus --example testing_your_code
//! ```
use chorus::prelude::*;
use chorus::testing::run_ranks;

/// The code under test: the mean of every rank's values, element-wise.
fn global_mean<C: CommBackend>(rank: &Rank<C>, values: &[f64]) -> chorus::Result<Vec<f64>> {
    let sums = rank.all_reduce(values, ReduceOp::Sum)?;
    Ok(sums.iter().map(|s| s / rank.size() as f64).collect())
}

fn main() -> chorus::Result<()> {
    let means = run_ranks(3, |rank| global_mean(&rank, &[rank.rank() as f64]))?;
    println!("the mean of 0, 1 and 2 on each of 3 ranks: {means:?} (run `cargo test` on this example for the tests)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_mean() {
        for n in [2, 4] {
            let means = run_ranks(n, |rank| global_mean(&rank, &[rank.rank() as f64, 1.0])).unwrap();
            let want = (n - 1) as f64 / 2.0;
            assert_eq!(means, vec![vec![want, 1.0]; n], "{n} ranks");
        }
    }

    #[test]
    fn a_failing_rank_is_named_with_its_message() {
        let err = run_ranks(2, |rank| {
            if rank.rank() == 1 {
                return Err(chorus::Error::InvalidArgument("rank 1 has no data".into()));
            }
            global_mean(&rank, &[1.0])
        })
        .unwrap_err();
        assert_eq!(err.rank(), Some(1), "{err}");
        assert!(err.to_string().contains("rank 1 has no data"), "{err}");
    }
}
