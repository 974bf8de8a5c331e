//! `chorus plan`: predicts per-rank memory, step time and every rank's
//! collective sequence for a training job at N GPUs by running chorus's
//! FSDP for every rank on a virtual device and communicator
//! (`chorus_plan`), before anyone rents the GPUs.
//!
//! The job is `chorus train`'s ([`crate::job`]): the same flags, defaults
//! and checks, or the `config.toml` a `chorus train` run wrote (`--config`);
//! the groups are the ones `chorus train` registers
//! (`chorus_train::models::{gpt, llama}::groups`). What is the plan's own:
//! the GPUs (`--gpus`, default the job's world size), their kind and cost
//! model, and whose kernels run the model. Outputs: a report on stdout, and
//! with `--out-dir` `plan.json` and `timeline.svg`, staged and put in place
//! whole (`crate::outdir`).

mod report;
mod timeline;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chorus_plan::cost::CostModel;
use chorus_plan::decoder_cost::Framework;
use chorus_plan::run::{run, GroupSpec, ModelSpec, RunSpec};
use chorus_plan::workload::{DecoderKind, DecoderShape, RecomputeMode, StageWork};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::{gpt, llama, DecoderGroups};

use crate::job::{JobArgs, ModelArg, RecomputeArg};
use crate::outdir::OutDir;
use crate::{usage, Outcome};

pub use report::Plan;

#[cfg(test)]
mod tests;

/// The most ranks a plan runs (one thread each).
const MAX_GPUS: usize = 8192;
/// Steps run; the last is measured (the first allocates the optimizer's state).
const STEPS: usize = 2;

/// Whose kernels run the model (`--kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelsArg {
    /// Eager PyTorch with flash attention.
    Torch,
    /// candle, as `chorus train` runs on the cpu device and on candle-CUDA.
    Candle,
}

/// Arguments of `chorus plan`.
#[derive(Clone, Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct PlanArgs {
    /// A job file (TOML): the `config.toml` a `chorus train` run wrote, or any file setting the job's flags by
    /// their long names; the run's own settings in it (steps, out_dir, ...) are passed over, and the command line
    /// wins.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub job: JobArgs,
    /// GPUs (ranks) to plan for (default: the job's --world-size).
    #[arg(long)]
    pub gpus: Option<usize>,
    /// GPUs per node (NVLink inside a node, the network across).
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// The GPU kind (h100-sxm, h200, a100, ...; cpu for the cpu device the sim runs on).
    #[arg(long, default_value = "h100-sxm")]
    pub gpu: String,
    /// Whose kernels run the model: torch (eager PyTorch with flash
    /// attention, what published GPU numbers ran) or candle (`chorus
    /// train`'s models: attention scores materialized). Default: torch on a
    /// GPU, candle on the cpu device.
    #[arg(long, value_enum)]
    pub kernels: Option<KernelsArg>,
    /// Write plan.json and timeline.svg here (a directory of its own; an earlier plan's is replaced).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// --gpu cpu: a calibration's rates (the file `ci/cpu-plan-check.sh` writes: a regular file, at most 64 KiB) instead of the frozen ones.
    #[arg(long)]
    pub cpu_rates: Option<PathBuf>,
}

impl PlanArgs {
    /// The ranks planned: `--gpus`, else the job's world size.
    pub fn world(&self) -> usize {
        self.gpus.unwrap_or_else(|| self.job.world())
    }
}

/// The job's model: its groups and shapes, and the job with its per-rank
/// batch resolved.
pub struct Model {
    /// The job (`--global-batch` turned into the per-rank batch).
    pub job: JobArgs,
    /// The groups `chorus train` registers.
    pub groups: DecoderGroups,
    /// The shapes the workload is computed from.
    pub shape: DecoderShape,
    /// The sequence length (`--seq-len`, or what `--data`'s rows give).
    pub seq_len: usize,
}

/// Checks every flag (the job's as `chorus train` does) and reads the
/// model's configuration.
pub fn model(args: &PlanArgs) -> anyhow::Result<Model> {
    let world = args.world();
    let world_flag = if args.gpus.is_some() { "--gpus" } else { "--world-size" };
    for (v, flag) in [(world, world_flag), (args.gpus_per_node, "--gpus-per-node")] {
        if v == 0 || v > MAX_GPUS {
            return Err(usage(format!("{flag} {v}: must be in 1..={MAX_GPUS}")));
        }
    }
    let mut job = args.job.clone();
    job.resolve_batch(world)?;
    job.check(world)?;
    let model = job.model();
    let seq_len = match &job.data {
        Some(path) => data_seq_len(&job, path)?,
        None => job.seq_len(),
    };
    let (groups, shape) = match model {
        ModelArg::Gpt => {
            let cfg = job.gpt_config();
            let shape = DecoderShape {
                kind: DecoderKind::Gpt,
                layers: cfg.layers,
                d_model: cfg.d_model,
                heads: cfg.heads,
                kv_heads: cfg.heads,
                ffn_hidden: cfg.d_ff,
                vocab: cfg.vocab,
                tied_embeddings: false,
            };
            (gpt::groups(&cfg)?, shape)
        }
        ModelArg::Llama => {
            let cfg = llama_config(&job)?;
            let shape = DecoderShape {
                kind: DecoderKind::Llama,
                layers: cfg.num_hidden_layers,
                d_model: cfg.hidden_size,
                heads: cfg.num_attention_heads,
                kv_heads: cfg.num_key_value_heads,
                ffn_hidden: cfg.intermediate_size,
                vocab: cfg.vocab_size,
                tied_embeddings: cfg.tie_word_embeddings,
            };
            (llama::groups(&cfg)?, shape)
        }
        ModelArg::Mlp | ModelArg::Moe => {
            return Err(usage(format!(
                "chorus plan predicts --model gpt and llama, not {}",
                format!("{model:?}").to_lowercase()
            )))
        }
    };
    Ok(Model { job, groups, shape, seq_len })
}

/// The Llama's configuration: `--init-from`'s config.json (checked, with
/// `--recompute`'s groups against its layers), or the flags' sizes with a
/// `--tokenizer`'s vocabulary, as `chorus train` makes it.
fn llama_config(job: &JobArgs) -> anyhow::Result<LlamaConfig> {
    let cfg = match (&job.init_from, &job.tokenizer) {
        (Some(dir), _) => {
            chorus_train::models::llama::hf::read_config(dir).map_err(|e| usage(format!("--init-from: {e}")))?
        }
        (None, Some(path)) => {
            let mut cfg = job.llama_config();
            if job.vocab.is_none() {
                let tok = chorus_train::tokenizer::HfTokenizer::from_file(path)
                    .map_err(|e| usage(format!("--tokenizer {e}")))?;
                cfg.vocab_size = tok.vocab_size();
            }
            cfg
        }
        (None, None) => job.llama_config(),
    };
    cfg.validate().map_err(|e| usage(format!("the Llama's configuration: {e}")))?;
    job.check_recompute("model.layers.", cfg.num_hidden_layers, 0)?;
    Ok(cfg)
}

/// The sequence length `--data`'s rows give (a `--seq-len` that disagrees
/// is refused, as `chorus train` refuses it).
fn data_seq_len(job: &JobArgs, path: &Path) -> anyhow::Result<usize> {
    let cols = chorus_train::npy::token_columns(path).map_err(|e| usage(format!("--data: {e}")))?;
    let seq = cols.saturating_sub(1);
    match job.seq_len {
        Some(s) if s != seq => Err(usage(format!(
            "--seq-len {s}: --data {} has rows of {cols} tokens, i.e. sequences of {seq} (give that, or leave --seq-len out)",
            path.display()
        ))),
        _ => Ok(seq),
    }
}

/// The largest `--cpu-rates` file read.
const MAX_RATES_BYTES: u64 = 64 << 10;

/// A `--cpu-rates` file: a regular file of at most [`MAX_RATES_BYTES`] whose rates pass [`CpuRates::check`](chorus_plan::cpu_model::CpuRates::check).
fn read_cpu_rates(path: &Path) -> anyhow::Result<chorus_plan::cpu_model::CpuRates> {
    let name = || path.display();
    use std::io::Read as _;
    let io = |e: std::io::Error| usage(format!("--cpu-rates {}: {e}", name()));
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(usage(format!("--cpu-rates {}: not a regular file", name())));
    }
    // Read at most one byte past the bound, so a file that grows after the check is refused too.
    let mut text = String::new();
    std::fs::File::open(path).map_err(io)?.take(MAX_RATES_BYTES + 1).read_to_string(&mut text).map_err(io)?;
    if text.len() as u64 > MAX_RATES_BYTES {
        return Err(usage(format!("--cpu-rates {}: more than {MAX_RATES_BYTES} bytes", name())));
    }
    chorus_plan::cpu_model::CpuRates::from_json(&text).map_err(|e| usage(format!("--cpu-rates {}: {e}", name())))
}

/// The workload of `--recompute`: a mode for every stage, or per group
/// (the embedding and head stages are the root group's; stage `i + 1` is
/// layer `i`'s).
fn stage_work(
    recompute: &RecomputeArg,
    layer_group: &str,
    work: impl Fn(RecomputeMode) -> Vec<StageWork>,
) -> Vec<StageWork> {
    use chorus_fsdp_candle::Recompute;
    match recompute {
        RecomputeArg::Selective => work(RecomputeMode::Selective),
        RecomputeArg::Groups(Recompute::All) => work(RecomputeMode::Full),
        RecomputeArg::Groups(Recompute::Nothing) => work(RecomputeMode::None),
        RecomputeArg::Groups(groups) => {
            let (full, none) = (work(RecomputeMode::Full), work(RecomputeMode::None));
            let last = full.len().saturating_sub(1);
            let group = |stage: usize| match stage {
                0 => "root".to_string(),
                s if s == last => "root".to_string(),
                s => format!("{layer_group}{}", s - 1),
            };
            full.into_iter()
                .zip(none)
                .enumerate()
                .map(|(stage, (f, n))| if groups.applies_to(&group(stage)) { f } else { n })
                .collect()
        }
    }
}

/// The two answers of the cost models: the times of `--gpu` (the GPU
/// tables and NCCL's algorithms, or the cpu device's calibration shared by
/// the sim ranks) and the model's work per stage, with the kernels of what
/// runs there (PyTorch with flash attention on a GPU, candle on the cpu).
fn cost_inputs(args: &PlanArgs, model: &Model) -> anyhow::Result<(Arc<dyn CostModel>, Vec<StageWork>)> {
    let cost: Arc<dyn CostModel> = match args.gpu.as_str() {
        "cpu" => {
            let rates = match &args.cpu_rates {
                Some(file) => read_cpu_rates(file)?,
                None => chorus_plan::cpu_model::CpuRates::frozen(),
            };
            Arc::new(chorus_plan::cpu_model::CpuModel::from_rates(&rates, args.world()))
        }
        _ if args.cpu_rates.is_some() => return Err(usage("--cpu-rates describes the cpu device: it needs --gpu cpu")),
        gpu => chorus_plan::gpu::cost_model(gpu, args.gpus_per_node).map_err(usage)?,
    };
    let job = &model.job;
    let micro = job.batch / job.micro_batches;
    let framework = match args.kernels {
        Some(KernelsArg::Torch) => Framework::TorchEager,
        Some(KernelsArg::Candle) => Framework::Candle,
        None => chorus_plan::gpu::framework(&args.gpu),
    };
    let layer_group = if model.shape.kind == DecoderKind::Llama { "model.layers." } else { "blocks." };
    let work = stage_work(&job.recompute, layer_group, |mode| {
        chorus_plan::decoder_cost::decoder_work_for(
            framework,
            &model.shape,
            micro,
            model.seq_len,
            job.param_dtype.size(),
            mode,
        )
    });
    Ok((cost, work))
}

/// Plans what `args` describe with `cost`'s times and `work` per stage.
pub fn execute(args: &PlanArgs, model: &Model, cost: Arc<dyn CostModel>, work: Vec<StageWork>) -> anyhow::Result<Plan> {
    let g = &model.groups;
    let groups = g.groups.iter().map(|g| GroupSpec { name: g.name.clone(), params: g.params.clone(), root: g.root });
    let spec = ModelSpec::decoder(groups.collect(), g.embed, g.head, work.clone())?;
    let job = &model.job;
    let run_spec = RunSpec {
        world: args.world(),
        replicate: job.hsdp,
        fsdp: job.fsdp_config(),
        forward_prefetch: true,
        optimizer: job.optimizer(),
        max_grad_norm: job.max_grad_norm,
        micro_batches: job.micro_batches,
        steps: STEPS,
        kernels_reach_host: args.gpu == "cpu",
        trace_rank: Some(0),
        timeout: Duration::from_secs(600),
    };
    let planned = report::Planned {
        model: format!("{:?}", job.model()).to_lowercase(),
        gpus: args.world(),
        gpu: args.gpu.clone(),
        recompute: job.recompute.to_string(),
        tokens_per_gpu_step: (job.batch * model.seq_len) as f64,
        micro_batches: job.micro_batches,
    };
    let peak = cost.peak_flops();
    let result = run(&spec, &run_spec, cost)?;
    report::Plan::new(&planned, &work, peak, result)
}

/// `chorus plan`, its arguments read from this process's command line with
/// `--config`'s job file (the job's flags taken from it, `chorus train`'s
/// run settings passed over).
pub fn run_cli() -> anyhow::Result<Outcome> {
    let args = resolve_process()?;
    let model = model(&args)?;
    let (cost, work) = cost_inputs(&args, &model)?;
    let out = match &args.out_dir {
        Some(dir) => Some(OutDir::acquire(dir, "plan", &[])?),
        None => None,
    };
    let plan = execute(&args, &model, cost, work)?;
    print!("{}", plan.text());
    if let Some(out) = out {
        plan.write(out.stage())?;
        out.commit()?;
    }
    Ok(if plan.divergence.is_some() { Outcome::Failed } else { Outcome::Passed })
}

/// Which keys of a job file a plan takes: the job's; `chorus train`'s
/// other flags (its run settings) are passed over.
fn file_scope() -> crate::job::file::Scope {
    use clap::Args;
    crate::job::file::Scope {
        takes: Some(JobArgs::augment_args(clap::Command::new("job"))),
        passes_over: Some(crate::train::TrainArgs::augment_args(clap::Command::new("train"))),
    }
}

/// This process's `chorus plan` arguments, with `--config`'s file read.
fn resolve_process() -> anyhow::Result<PlanArgs> {
    Ok(crate::job::file::resolve_process::<PlanArgs>("plan", file_scope())?.args)
}
