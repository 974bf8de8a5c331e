//! `chorus train --model moe`: the transformer whose MLPs are mixtures of
//! `--experts` experts with top-1 routing, each expert a param group routed
//! to its block's (`chorus_train::models::moe`), so ranks that route their
//! tokens differently never wait on each other. The run is `gpt.rs`'s.

use chorus_train::models::moe::{init_params, MoeModel};
use serde_json::json;

use super::args::TrainArgs;
use super::gpt::CliDecoder;
use super::throughput::Throughput;
use crate::job::ModelArg;

impl CliDecoder for MoeModel {
    const FLAG: (ModelArg, &'static str) = (ModelArg::Moe, "moe");
    fn from_args(args: &TrainArgs) -> anyhow::Result<Self> {
        let cfg = args.job.moe_config();
        Ok(MoeModel { config: cfg, init: init_params(&cfg, args.seed)? })
    }
    fn seq_len(&self) -> usize {
        self.config.base.seq_len
    }
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.config.param_shapes()
    }
    fn sizes(&self) -> serde_json::Value {
        json!(self.config)
    }
    fn throughput(&self, args: &TrainArgs) -> Throughput {
        Throughput::moe(&self.config, args)
    }
}
