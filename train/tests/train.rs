//! The training loop on simulated ranks: what `chorus train` relies on.

use crate::common;

use std::sync::Arc;

use chorus_fsdp::{FsdpConfig, FsdpError, OptimizerKind};
use chorus_train::mlp::init_layers;
use chorus_train::train::{train, Dataset, RankReport, TrainSpec};
use common::on_sim_ranks;

fn spec(dims: &[usize], ranks: usize, replicate: Option<usize>) -> TrainSpec {
    TrainSpec {
        layers: init_layers(dims, 5),
        data: Arc::new(Dataset::random(dims[0], dims[dims.len() - 1], 4 * ranks, 2, 5)),
        batch: 4,
        steps: 12,
        optimizer: OptimizerKind::sgd(0.1, 0.9),
        fsdp: FsdpConfig::default(),
        replicate,
        max_grad_norm: None,
        stop_on_nonfinite: true,
        output: None,
        collect_params: true,
    }
}

fn run(ranks: usize, spec: TrainSpec) -> Vec<Result<RankReport, FsdpError>> {
    let spec = Arc::new(spec);
    on_sim_ranks(ranks, move |comm| train(comm, &spec, &mut |_, _| {}))
}

#[test]
fn every_rank_reports_the_same_falling_losses_and_parameters() {
    for (ranks, replicate) in [(2, None), (4, Some(2))] {
        let dims = [6, 12, 3];
        let reports: Vec<RankReport> =
            run(ranks, spec(&dims, ranks, replicate)).into_iter().map(|r| r.unwrap()).collect();
        let first = &reports[0];
        assert_eq!(first.losses.len(), 12);
        assert!(first.losses[11] < first.losses[0], "{ranks} ranks: the loss did not fall: {:?}", first.losses);
        assert_eq!(first.groups, 3, "one group per layer and the root");
        let names: Vec<&str> = first.params.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]);
        assert_eq!(first.params[0].1.len(), 12 * 6, "full, unpadded parameters");
        for r in &reports[1..] {
            assert_eq!(r.losses, first.losses, "ranks disagree on the global mean loss");
            assert_eq!(r.params, first.params, "ranks disagree on the trained parameters");
        }
        assert!(reports.iter().all(|r| r.peak_memory_bytes >= r.final_memory_bytes));
    }
}

#[test]
fn data_that_does_not_fit_the_model_or_the_world_is_refused() {
    let mut wrong_width = spec(&[6, 12, 3], 2, None);
    wrong_width.data = Arc::new(Dataset::random(5, 3, 8, 1, 0));
    let too_few_rows = TrainSpec { batch: 5, ..spec(&[6, 12, 3], 2, None) };
    for (bad, why) in [(wrong_width, "the model maps 6"), (too_few_rows, "needs 10 rows per step")] {
        for r in run(2, bad) {
            match r {
                Err(FsdpError::InvalidArgument(m)) => assert!(m.contains(why), "{m}"),
                other => panic!("expected an invalid argument ({why}), got {:?}", other.map(|r| r.losses)),
            }
        }
    }
}

/// `Fsdp::gather_param` hands each parameter over whole, row-major, in
/// pieces of the size asked (across rank boundaries and padding), sharded on
/// dim 0 or 1 or replicated, at 1 to 4 ranks; values checked against the
/// initial ones, computed here.
#[test]
fn gather_param_gives_each_parameter_whole_in_pieces() {
    use chorus_fsdp::{DataParallel, Fsdp, ParamInit};
    for ranks in 1..=4 {
        let results = on_sim_ranks(ranks, move |comm| {
            // "cols" is sharded on its last dim; parameters below 6 elements are replicated.
            let placement: chorus_fsdp::ShardPlacement =
                Arc::new(|name: &str, _: &[usize]| if name == "cols" { 1 } else { 0 });
            let config = FsdpConfig { shard_placement: Some(placement), replicate_below: 6, ..FsdpConfig::default() };
            let mut fsdp = Fsdp::new(DataParallel::fsdp(comm), config).unwrap();
            let params: Vec<ParamInit> = [("rows", vec![5, 3]), ("cols", vec![4, 7]), ("tiny", vec![5])]
                .into_iter()
                .enumerate()
                .map(|(k, (name, shape))| {
                    let n: usize = shape.iter().product();
                    ParamInit { name: name.into(), shape, values: (0..n).map(|i| (k * 100 + i) as f32).collect() }
                })
                .collect();
            let want: Vec<Vec<f32>> = params.iter().map(|p| p.values.clone()).collect();
            fsdp.add_group("g", params, false).unwrap();
            let mut out = Vec::new();
            for piece in [1, 4, 1000] {
                for (i, want) in want.iter().enumerate() {
                    let (mut got, mut sizes) = (Vec::new(), Vec::new());
                    fsdp.gather_param(0, i, piece, &mut |p| {
                        sizes.push(p.len());
                        got.extend_from_slice(p);
                        Ok(())
                    })
                    .unwrap();
                    out.push((got == *want, sizes.iter().all(|s| *s <= piece && *s > 0)));
                }
            }
            assert_eq!(fsdp.find_param("cols"), Some((0, 1)));
            assert_eq!(fsdp.find_param("nothing"), None);
            out
        });
        for (rank, checks) in results.iter().enumerate() {
            for (k, (values, pieces)) in checks.iter().enumerate() {
                assert!(values, "{ranks} ranks, rank {rank}, check {k}: wrong values");
                assert!(pieces, "{ranks} ranks, rank {rank}, check {k}: a piece over the size asked");
            }
        }
    }
}
