//! CPU offload through the candle adapter: the transformer trained with its
//! sharded state in host memory equals the run without offload bit for bit
//! at 1, 2 and 4 ranks, and the device peak drops while the host space holds
//! the state.

use crate::common;

use std::sync::Arc;

use chorus_fsdp::{OffloadPolicy, OptimizerKind};
use chorus_train::decoder::{train_sharded, Data, TrainReport, TrainSpec};
use chorus_train::models::gpt::{init_params, GptConfig, GptModel};
use chorus_train::text::{encode, generate, vocab_size, TextData};
use common::{on_sim_ranks, unwrap_ranks};

fn spec(offload: bool) -> TrainSpec<GptModel> {
    let cfg = GptConfig { vocab: vocab_size(), d_model: 16, layers: 2, heads: 2, d_ff: 32, seq_len: 12 };
    let data = Arc::new(Data::Text(TextData::new(encode(&generate(4000, 1)), cfg.seq_len, 7).unwrap()));
    let model = GptModel { config: cfg, init: init_params(&cfg, 3).unwrap() };
    let mut s =
        TrainSpec { collect_params: true, ..TrainSpec::new(model, data, 8, 3, OptimizerKind::adamw(3e-3, 0.01)) };
    s.fsdp.offload = offload.then(OffloadPolicy::default);
    s
}

fn run(ranks: usize, spec: TrainSpec<GptModel>) -> Vec<TrainReport> {
    let spec = Arc::new(spec);
    unwrap_ranks(on_sim_ranks(ranks, move |comm| train_sharded(comm, &spec, &mut |_, _| {})))
}

#[test]
fn offload_through_the_adapter_equals_no_offload_bitwise() {
    for ranks in [1, 2, 4] {
        let plain = run(ranks, spec(false));
        let off = run(ranks, spec(true));
        for (a, b) in plain.iter().zip(&off) {
            assert_eq!(a.losses.len(), b.losses.len());
            assert!(a.losses.iter().zip(&b.losses).all(|(x, y)| x.to_bits() == y.to_bits()), "{ranks} ranks: losses");
            for ((n1, x), (n2, y)) in a.params.iter().zip(&b.params) {
                assert_eq!(n1, n2);
                assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "{ranks} ranks: {n1} differs");
            }
            assert_eq!(a.peak_host_memory_bytes, 0, "{ranks} ranks: host space used without offload");
            assert!(b.peak_host_memory_bytes > 0, "{ranks} ranks: no host space used with offload");
            assert!(
                b.peak_memory_bytes < a.peak_memory_bytes,
                "{ranks} ranks: device peak {} with offload, {} without",
                b.peak_memory_bytes,
                a.peak_memory_bytes
            );
        }
    }
}
