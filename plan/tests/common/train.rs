//! `chorus train`'s loop on simulated ranks, for the exact-count tests: the
//! models it trains, its settings as the planner's [`RunSpec`], and what each
//! rank measured (its FSDP peaks and the flight recorder's record).

#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chorus_collectives::recorder::{CommRecord, RankDump, RecorderOptions};
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::Communicator;
use chorus_fsdp::OptimizerKind;
use chorus_plan::run::{run, GroupSpec, ModelSpec, RankPlan, RunSpec};
use chorus_plan::virt::comm::CollectiveRecord;
use chorus_train::decoder::{train_sharded, Data, TokenRows, TrainSpec};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::LlamaModel;
use chorus_train::models::{gpt, llama, DecoderGroups, DecoderModel};
use chorus_train::npy::Tokens;

pub const VOCAB: usize = 40;
pub const SEQ: usize = 8;

fn data(global: usize) -> Arc<Data> {
    let rows = 2 * global;
    let ids = (0..rows * (SEQ + 1)).map(|i| ((i * 7919 + i / 3) % VOCAB) as u32).collect();
    Arc::new(Data::Tokens(TokenRows::new(Tokens::from_ids(rows, SEQ + 1, ids).unwrap(), VOCAB, global).unwrap()))
}

/// What one rank of the real run measured.
#[derive(Clone, Debug)]
pub struct Real {
    /// `peak_memory_bytes` (device, FSDP-managed).
    pub peak: usize,
    /// `peak_host_memory_bytes`.
    pub host_peak: usize,
    /// Its collectives, per communicator in the flight recorder's order of
    /// communicators (the root first), each in launch order.
    pub calls: Vec<CollectiveRecord>,
    /// Each call's reduce operator (`max`, `sum`, ...), which the planner's
    /// record leaves out (its rendezvous checks that the ranks agree on it).
    pub reduce_ops: Vec<Option<String>>,
}

fn calls_of(record: &CommRecord) -> Vec<(CollectiveRecord, Option<String>)> {
    assert_eq!(record.launches as usize, record.entries.len(), "{}: the ring dropped launches", record.id);
    record
        .entries
        .iter()
        .flat_map(|e| e.calls.iter())
        .map(|c| {
            let call = CollectiveRecord {
                group: record.id.clone(),
                seq: c.seq.expect("a collective"),
                op: c.op.clone(),
                dtype: c.dtype.clone(),
                count: c.count,
                bytes: c.bytes,
            };
            (call, c.reduce.clone())
        })
        .collect()
}

/// Runs `spec` on `ranks` sim ranks. Without `dump_dir` each rank's calls
/// are the world communicator's; with it, every communicator's (the mesh's
/// splits are gone when the loop returns: the recorder keeps their records
/// for the dump it writes into `dump_dir`, which the caller owns).
pub fn real<M: DecoderModel + 'static>(ranks: usize, spec: TrainSpec<M>, dump_dir: Option<&Path>) -> Vec<Real> {
    let world = SimWorld::new(ranks, SimConfig { timeout: Duration::from_secs(60), ..SimConfig::default() }).unwrap();
    let spec = Arc::new(spec);
    // The ring is set here, not from the environment, and holds every launch of these short runs.
    let options = RecorderOptions { entries: 1 << 16, dump_dir: dump_dir.map(Path::to_path_buf), track_starts: false };
    let handles: Vec<_> = (0..ranks)
        .map(|r| {
            let comm = Communicator::with_recorder(world.communicator(r).unwrap().into_backend(), &options);
            let (spec, dumps) = (spec.clone(), dump_dir.is_some());
            std::thread::spawn(move || {
                let comm = Arc::new(comm);
                let report = train_sharded(comm.clone(), &spec, &mut |_, _| {}).unwrap();
                let calls: Vec<(CollectiveRecord, Option<String>)> = if dumps {
                    let file = comm.dump_flight_record("exact counts").unwrap().expect("a dump directory");
                    let dump: RankDump = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
                    dump.communicators.iter().flat_map(calls_of).collect()
                } else {
                    calls_of(&comm.flight_record().expect("the recorder is on"))
                };
                let (calls, reduce_ops) = calls.into_iter().unzip();
                Real { peak: report.peak_memory_bytes, host_peak: report.peak_host_memory_bytes, calls, reduce_ops }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

pub fn groups_of(g: &DecoderGroups) -> Vec<GroupSpec> {
    g.groups.iter().map(|g| GroupSpec { name: g.name.clone(), params: g.params.clone(), root: g.root }).collect()
}

/// The planner's settings for `t` on the cpu device the sim runs on.
pub fn run_spec<M>(ranks: usize, t: &TrainSpec<M>) -> RunSpec {
    RunSpec {
        world: ranks,
        // Every rank runs: each is compared with the real run's rank.
        ranks: chorus_plan::run::Ranks::Every,
        replicate: t.replicate,
        fsdp: t.fsdp.clone(),
        forward_prefetch: t.forward_prefetch,
        optimizer: t.optimizer,
        max_grad_norm: t.max_grad_norm,
        micro_batches: t.micro_batches,
        steps: t.steps as usize,
        kernels_reach_host: true,
        trace_rank: None,
        timeout: Duration::from_secs(60),
    }
}

pub fn gpt_spec(ranks: usize) -> (DecoderGroups, usize, TrainSpec<gpt::GptModel>) {
    let cfg = gpt::GptConfig { vocab: VOCAB, d_model: 16, layers: 2, heads: 2, d_ff: 24, seq_len: SEQ };
    let model = gpt::GptModel { config: cfg, init: gpt::init_params(&cfg, 3).unwrap() };
    let spec = TrainSpec::new(model, data(2 * ranks), 2, 2, OptimizerKind::adamw(1e-3, 0.01));
    (gpt::groups(&cfg).unwrap(), cfg.layers, spec)
}

pub fn llama_spec(ranks: usize, tied: bool) -> (DecoderGroups, usize, TrainSpec<LlamaModel>) {
    let cfg = LlamaConfig { head_dim: 6, tie_word_embeddings: tied, ..LlamaConfig::new(VOCAB, 16, 24, 2, 4, 2) };
    let cfg = Arc::new(cfg);
    let model = LlamaModel { config: cfg.clone(), init: llama::init_params(&cfg, 5) };
    let spec = TrainSpec::new(model, data(2 * ranks), 2, 2, OptimizerKind::adamw(1e-3, 0.01));
    (llama::groups(&cfg).unwrap(), cfg.num_hidden_layers, spec)
}

/// Each communicator's calls in order, by its name.
fn per_communicator(calls: &[CollectiveRecord]) -> std::collections::BTreeMap<&str, Vec<&CollectiveRecord>> {
    let mut by = std::collections::BTreeMap::<&str, Vec<&CollectiveRecord>>::new();
    for c in calls {
        by.entry(c.group.as_str()).or_default().push(c);
    }
    by
}

/// Plans `t` and checks it against the real run, rank by rank: the FSDP
/// device and host peaks, and the collectives of the world communicator
/// (with `dump_dir`: of every communicator, the mesh's splits included).
/// Returns the planner's ranks and the real run's.
pub fn check<M: DecoderModel + 'static>(
    ranks: usize,
    groups: &DecoderGroups,
    layers: usize,
    t: TrainSpec<M>,
    dump_dir: Option<&Path>,
) -> (Vec<RankPlan>, Vec<Real>) {
    let model = ModelSpec::decoder(
        groups_of(groups),
        groups.embed,
        groups.head,
        crate::common::decoder_work(layers, 1e6, 1 << 20),
    )
    .unwrap();
    let hsdp = t.replicate.is_some_and(|r| r > 1);
    let plan = run(&model, &run_spec(ranks, &t), crate::common::cost()).unwrap();
    assert_eq!(plan.divergence, None);
    let real = real(ranks, t, dump_dir);
    let plans: Vec<RankPlan> = plan.ranks.into_iter().map(Result::unwrap).collect();
    for (rank, (p, r)) in plans.iter().zip(&real).enumerate() {
        assert_eq!(p.fsdp_peak_bytes, r.peak, "rank {rank} of {ranks}: FSDP peak");
        assert_eq!(p.host_peak_bytes, r.host_peak, "rank {rank} of {ranks}: host peak");
        // The activations are counted apart: the total holds them on top.
        assert!(p.peak_bytes > p.fsdp_peak_bytes, "rank {rank}: {p:?}");
        let (mut planned, recorded) = (per_communicator(&p.collectives), per_communicator(&r.calls));
        if dump_dir.is_none() {
            planned.retain(|id, _| *id == "root");
        }
        // Every communicator of either side, so that one missing on a side fails.
        let ids: std::collections::BTreeSet<&str> = planned.keys().chain(recorded.keys()).copied().collect();
        for id in ids {
            assert_eq!(planned.get(id), recorded.get(id), "rank {rank} of {ranks}: collectives on {id}");
        }
        // Under HSDP every collective is on the mesh's communicators, none on the world's.
        assert_eq!(!r.calls.iter().any(|c| c.group == "root"), hsdp, "rank {rank}");
        if hsdp {
            assert!(p.collectives.iter().any(|c| c.group.contains("/split")), "rank {rank}: {:?}", p.collectives);
        }
    }
    (plans, real)
}
