//! `chorus plan`: predicts per-rank memory, step time and every rank's
//! collective sequence for a training job at N GPUs by running chorus's
//! FSDP on a virtual device and communicator (`chorus_plan`) — the first
//! and the last rank, every other mirroring them, or every rank where
//! their groups sit unlike on the nodes — before anyone rents the GPUs.
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
use chorus_plan::kernel_rates::KernelRates;
use chorus_plan::rated_gpu::RatedGpuModel;
use chorus_plan::run::{run, GroupSpec, ModelSpec, PlanError, Ranks, RunSpec, MAX_THREADED_RANKS};
use chorus_plan::workload::{DecoderKind, DecoderShape, RecomputeMode, StageWork};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::{gpt, llama, DecoderGroups};

use crate::job::{JobArgs, ModelArg, RecomputeArg};
use crate::outdir::OutDir;
use crate::{usage, Outcome};

pub use report::Plan;

#[cfg(test)]
mod tests;

/// The most ranks a plan plans (two of them run, the others mirror them:
/// `chorus_plan::run::Ranks::Symmetric`).
const MAX_GPUS: usize = 8192;
/// The most decoder layers: a plan runs FSDP's hooks on every layer's
/// group, and grouping a model's parameters takes time quadratic in its
/// layers (`chorus_train::models::llama::groups`): 4,096 layers plan in
/// about 10 s and 240 MB on a 2-core VM (`docs/plan.md`, "Scale").
const MAX_LAYERS: usize = 4096;
/// The most stage runs per step (micro-batches × (layers + 2)): a plan's
/// time and its trace grow with them (64 micro-batches of 512 layers: 15 s).
const MAX_STAGE_RUNS: usize = 32 << 10;
/// The most bytes of activations one stage may keep or use: far beyond
/// any GPU, far below what the planner's byte counters hold.
const MAX_STAGE_BYTES: f64 = (1u64 << 56) as f64;
/// Steps run; the last is measured (the first allocates the optimizer's state).
const STEPS: usize = 2;

/// Whose kernels run the model (`--kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelsArg {
    /// Eager PyTorch with flash attention.
    Torch,
    /// candle, as `chorus train` runs on the cpu device and on candle-CUDA.
    Candle,
    /// chorus's own fused kernels (`chorus-kernels`) under candle, on a GPU.
    Chorus,
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
    /// attention, what published GPU numbers ran), candle (`chorus train`'s
    /// models: attention scores materialized) or chorus (`chorus train` on
    /// chorus's fused kernels). On a GPU candle and chorus are priced from
    /// kernel rates (--kernel-rates) with the host's time per operation.
    /// Default: torch on a GPU, candle on the cpu device.
    #[arg(long, value_enum)]
    pub kernels: Option<KernelsArg>,
    /// --kernels candle|chorus on a GPU: a kernel-rates file measured on that GPU (JSON, at most 64 KiB;
    /// docs/plan-costs.md) instead of the one chorus ships for h100-sxm and h200.
    #[arg(long)]
    pub kernel_rates: Option<PathBuf>,
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
            check_runs(&job, cfg.layers)?;
            (gpt::groups(&cfg)?, DecoderShape::from(&cfg))
        }
        ModelArg::Llama => {
            let cfg = llama_config(&job)?;
            check_runs(&job, cfg.num_hidden_layers)?;
            (llama::groups(&cfg)?, DecoderShape::from(&cfg))
        }
        ModelArg::Mlp | ModelArg::Moe => {
            return Err(usage(format!(
                "chorus plan predicts --model gpt and llama, not {}",
                format!("{model:?}").to_lowercase()
            )))
        }
    };
    check_shards(&job, world, &groups)?;
    Ok(Model { job, groups, shape, seq_len })
}

/// The planner's bounds on its own work: [`MAX_LAYERS`] layers and
/// [`MAX_STAGE_RUNS`] stage runs per step, checked before the groups are built.
fn check_runs(job: &JobArgs, layers: usize) -> anyhow::Result<()> {
    if layers > MAX_LAYERS {
        // In the words of the job's own limit (`JobArgs::check`), and naming it, so the two read as one rule.
        let what = if job.init_from.is_some() {
            format!("--init-from's {layers} layers")
        } else {
            format!("--layers {layers}")
        };
        return Err(usage(format!(
            "{what} is more than chorus plans (at most {MAX_LAYERS} layers: a plan runs FSDP on every layer's group; \
             chorus train trains at most {})",
            chorus_train::models::llama::config::MAX_LAYERS
        )));
    }
    let runs = job.micro_batches.saturating_mul(layers + 2);
    if runs > MAX_STAGE_RUNS {
        return Err(usage(format!(
            "--micro-batches {} × {} stages ({layers} layers, the embedding and the head) = {runs} stage runs per step: a plan runs at most {MAX_STAGE_RUNS}",
            job.micro_batches,
            layers + 2
        )));
    }
    Ok(())
}

/// Every parameter's shard at `world` ranks within
/// `chorus_plan::run::MAX_SHARD_BYTES`: the planner registers each shard as
/// zeros in host memory.
fn check_shards(job: &JobArgs, world: usize, groups: &DecoderGroups) -> anyhow::Result<()> {
    let max = chorus_plan::run::MAX_SHARD_BYTES as u128;
    let shard_world = (world / job.hsdp.unwrap_or(1).max(1)).max(1) as u128;
    for (name, shape) in groups.groups.iter().flat_map(|g| &g.params) {
        let numel: u128 = shape.iter().map(|d| *d as u128).product();
        // Sharded on dim 0 (padded), or whole below --replicate-below.
        let bytes = match shape.first() {
            Some(&rows) if numel >= job.replicate_below as u128 => {
                (rows as u128).div_ceil(shard_world) * (numel / (rows as u128).max(1)) * 4
            }
            _ => numel * 4,
        };
        if bytes > max {
            return Err(usage(format!(
                "{name} {shape:?}: its f32 shard is {:.2} GiB per rank at {shard_world} ranks per shard group, and a plan registers each shard as zeros in host memory, at most {} GiB: plan more GPUs per shard group, or a smaller model",
                bytes as f64 / (1u64 << 30) as f64,
                max >> 30
            )));
        }
    }
    Ok(())
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

/// A rates file's text: a regular file of at most `max` bytes (`flag` names it in errors).
fn read_small_file(flag: &str, path: &Path, max: u64) -> anyhow::Result<String> {
    use std::io::Read as _;
    let name = || path.display();
    let io = |e: std::io::Error| usage(format!("{flag} {}: {e}", name()));
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(usage(format!("{flag} {}: not a regular file", name())));
    }
    // Read at most one byte past the bound, so a file that grows after the check is refused too.
    let mut text = String::new();
    std::fs::File::open(path).map_err(io)?.take(max + 1).read_to_string(&mut text).map_err(io)?;
    if text.len() as u64 > max {
        return Err(usage(format!("{flag} {}: more than {max} bytes", name())));
    }
    Ok(text)
}

/// A `--cpu-rates` file: a regular file of at most [`MAX_RATES_BYTES`] whose rates pass [`CpuRates::check`](chorus_plan::cpu_model::CpuRates::check).
fn read_cpu_rates(path: &Path) -> anyhow::Result<chorus_plan::cpu_model::CpuRates> {
    let text = read_small_file("--cpu-rates", path, MAX_RATES_BYTES)?;
    chorus_plan::cpu_model::CpuRates::from_json(&text)
        .map_err(|e| usage(format!("--cpu-rates {}: {e}", path.display())))
}

/// A `--kernel-rates` file: a regular file of at most
/// [`MAX_FILE_BYTES`](chorus_plan::kernel_rates::MAX_FILE_BYTES) whose
/// rates pass [`KernelRates::check`].
fn read_kernel_rates(path: &Path) -> anyhow::Result<KernelRates> {
    let text = read_small_file("--kernel-rates", path, chorus_plan::kernel_rates::MAX_FILE_BYTES)?;
    KernelRates::from_json(&text).map_err(|e| usage(format!("--kernel-rates {}: {e}", path.display())))
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

/// Whose kernels `args` plan: `--kernels`, or PyTorch's on a GPU and candle's on the cpu device.
fn framework(args: &PlanArgs) -> Framework {
    match args.kernels {
        Some(KernelsArg::Torch) => Framework::TorchEager,
        Some(KernelsArg::Candle) => Framework::Candle,
        Some(KernelsArg::Chorus) => Framework::Chorus,
        None => chorus_plan::gpu::framework(&args.gpu),
    }
}

/// The two answers of the cost models: the times of `--gpu` (the GPU
/// tables and NCCL's algorithms; chorus's trainer on a GPU from its kernel
/// rates, host included; or the cpu device's calibration shared by
/// the sim ranks) and the model's work per stage, with the kernels of
/// what runs there.
fn cost_inputs(args: &PlanArgs, model: &Model) -> anyhow::Result<Priced> {
    let framework = framework(args);
    let mut rates_used = None;
    if args.kernel_rates.is_some() && (args.gpu == "cpu" || framework == Framework::TorchEager) {
        return Err(usage(
            "--kernel-rates prices chorus's trainer on a GPU: --kernels candle or chorus, and a GPU --gpu",
        ));
    }
    let cost: Arc<dyn CostModel> = match args.gpu.as_str() {
        "cpu" if framework == Framework::Chorus => {
            return Err(usage(
                "--kernels chorus --gpu cpu: the cpu device's model is calibrated on candle's kernels only",
            ))
        }
        "cpu" => {
            let rates = match &args.cpu_rates {
                Some(file) => read_cpu_rates(file)?,
                None => chorus_plan::cpu_model::CpuRates::frozen(),
            };
            Arc::new(chorus_plan::cpu_model::CpuModel::from_rates(&rates, args.world()))
        }
        _ if args.cpu_rates.is_some() => return Err(usage("--cpu-rates describes the cpu device: it needs --gpu cpu")),
        gpu if framework != Framework::TorchEager => {
            let rates = match &args.kernel_rates {
                Some(file) => read_kernel_rates(file)?,
                None => KernelRates::default_for(gpu).ok_or_else(|| {
                    usage(format!(
                        "--kernels {} --gpu {gpu}: chorus ships kernel rates for h100-sxm and h200 only; give --kernel-rates FILE measured on this GPU (docs/plan-costs.md)",
                        if framework == Framework::Chorus { "chorus" } else { "candle" }
                    ))
                })?,
            };
            let spec = chorus_plan::gpu::gpu_spec(gpu).ok_or_else(|| {
                usage(format!("unknown --gpu `{gpu}`; known: {}", chorus_plan::gpu::GPU_KINDS.join(", ")))
            })?;
            if args.gpus_per_node == 0 {
                return Err(usage("--gpus-per-node must be at least 1"));
            }
            rates_used = Some(rates.clone());
            Arc::new(RatedGpuModel::new(rates, spec, args.gpus_per_node))
        }
        gpu => chorus_plan::gpu::cost_model(gpu, args.gpus_per_node).map_err(usage)?,
    };
    let job = &model.job;
    let micro = job.batch / job.micro_batches;
    let layer_group = if model.shape.kind == DecoderKind::Llama { "model.layers." } else { "blocks." };
    let work = stage_work(&job.recompute, layer_group, |mode| {
        framework.decoder_work(&model.shape, micro, model.seq_len, job.param_dtype.size(), mode)
    });
    let kept: f64 = work.iter().map(|s| s.saved_bytes as f64).sum();
    if let Some(s) = work.iter().find(|s| s.transient_bytes as f64 >= MAX_STAGE_BYTES) {
        return Err(usage(format!(
            "stage {} uses {} bytes of activations: beyond any GPU and the planner's counters",
            s.name, s.transient_bytes
        )));
    }
    if kept >= MAX_STAGE_BYTES {
        return Err(usage(format!(
            "the stages keep {kept:.3e} bytes of activations: beyond any GPU and the planner's counters"
        )));
    }
    Ok(Priced { cost, work, rates: rates_used })
}

/// What a plan is priced with: the cost model, one micro-batch's work per
/// stage, and the kernel-rates file behind the cost model, if one is.
pub struct Priced {
    /// How long everything takes.
    pub cost: Arc<dyn CostModel>,
    /// One micro-batch's stages.
    pub work: Vec<StageWork>,
    /// The kernel rates (chorus's trainer on a GPU).
    pub rates: Option<KernelRates>,
}

/// Plans what `args` describe with `cost`'s times and `work` per stage.
pub fn execute(args: &PlanArgs, model: &Model, priced: Priced) -> anyhow::Result<Plan> {
    let Priced { cost, work, rates } = priced;
    let g = &model.groups;
    let groups = g.groups.iter().map(|g| GroupSpec { name: g.name.clone(), params: g.params.clone(), root: g.root });
    let spec = ModelSpec::decoder(groups.collect(), g.embed, g.head, work.clone())?;
    let job = &model.job;
    let mut run_spec = RunSpec {
        world: args.world(),
        ranks: Ranks::Symmetric,
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
        framework: framework(args),
        recompute: job.recompute.to_string(),
        tokens_per_gpu_step: (job.batch * model.seq_len) as f64,
        micro_batches: job.micro_batches,
    };
    let peak = cost.peak_flops();
    // Every rank of a decoder runs alike unless its groups sit differently on the nodes.
    let result = match run(&spec, &run_spec, cost.clone()) {
        Err(PlanError::Asymmetric(_)) if args.world() <= MAX_THREADED_RANKS => {
            run_spec.ranks = Ranks::Every;
            run(&spec, &run_spec, cost)?
        }
        Err(PlanError::Asymmetric(why)) => {
            return Err(usage(format!(
                "{why}; such a plan runs every rank, a thread each, at most {MAX_THREADED_RANKS} ({} GPUs planned): place the groups alike (--gpus-per-node, --hsdp, --reshard-after-forward) or plan fewer GPUs",
                args.world()
            )))
        }
        r => r?,
    };
    report::Plan::new(&planned, &work, peak, rates.as_ref(), result)
}

/// `chorus plan`, its arguments read from this process's command line with
/// `--config`'s job file (the job's flags taken from it, `chorus train`'s
/// run settings passed over).
pub fn run_cli() -> anyhow::Result<Outcome> {
    run_plan(&resolve_process()?)
}

/// Plans `args`: the report on stdout, the outputs in `--out-dir`.
fn run_plan(args: &PlanArgs) -> anyhow::Result<Outcome> {
    let model = model(args)?;
    let priced = cost_inputs(args, &model)?;
    let out = match &args.out_dir {
        Some(dir) => Some(OutDir::acquire(dir, "plan", &[])?),
        None => None,
    };
    let plan = execute(args, &model, priced)?;
    // The outputs first: a closed stdout (`chorus plan ... | head`) then loses only the report's lines.
    if let Some(out) = out {
        plan.write(out.stage())?;
        out.commit()?;
    }
    crate::print_out(format_args!("{}", plan.text()))?;
    // A plan that does not fit, or whose ranks diverge, is a failed plan (exit status 1).
    Ok(if plan.divergence.is_some() || plan.fits == Some(false) { Outcome::Failed } else { Outcome::Passed })
}

/// Which keys of a job file a plan takes: the job's and the plan's own
/// (`gpus`, `gpu`, `kernels`, ...); `chorus train`'s other flags (its run
/// settings) are passed over. `out_dir` is both a plan's and a run's: in a
/// file it is the run's (a `config.toml` names the run's out-dir), so it is
/// passed over, and a plan's out-dir is given on the command line. (Import
/// circle, allowed: train's scope names a plan's own flags, for the same file.)
fn file_scope() -> crate::job::file::Scope {
    use clap::Args;
    // A hidden flag is no key of a job file.
    let plan = PlanArgs::augment_args(clap::Command::new("plan")).mut_arg("out_dir", |a| a.hide(true));
    crate::job::file::Scope {
        takes: Some(plan),
        passes_over: Some(crate::train::TrainArgs::augment_args(clap::Command::new("train"))),
    }
}

/// The plan's own flags (`gpus`, `gpu`, `kernels`, ...), which `chorus
/// train` passes over in a job file as a plan passes over the run's: one
/// job file trains and plans a job.
pub(crate) fn own_flags() -> clap::Command {
    use clap::Args;
    let mut plan = PlanArgs::augment_args(clap::Command::new("plan"));
    for id in JobArgs::augment_args(clap::Command::new("job")).get_arguments().map(|a| a.get_id().clone()) {
        plan = plan.mut_arg(id, |a| a.hide(true));
    }
    plan.mut_arg("out_dir", |a| a.hide(true))
}

/// This process's `chorus plan` arguments, with `--config`'s file read.
fn resolve_process() -> anyhow::Result<PlanArgs> {
    Ok(crate::job::file::resolve_process::<PlanArgs>("plan", file_scope())?.args)
}
