//! `chorus plan`: predicts per-rank memory, step time and every rank's
//! collective sequence for a training job at N GPUs by running chorus's
//! FSDP on a virtual device and communicator (`chorus_plan`) — the first
//! and the last rank, every other mirroring them, or every rank where
//! their groups sit unlike on the nodes — before anyone rents the GPUs.
//!
//! The model and FSDP flags are `chorus train`'s; the groups are the ones
//! `chorus train` registers (`chorus_train::models::{gpt, llama}::groups`).
//! Outputs: a report on stdout, and with `--out-dir` `plan.json` and
//! `timeline.svg`, staged and put in place whole (`crate::outdir`).

mod report;
mod timeline;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision, OffloadPolicy, OptimizerKind, Reshard};
use chorus_plan::cost::CostModel;
use chorus_plan::decoder_cost::Framework;
use chorus_plan::kernel_rates::KernelRates;
use chorus_plan::rated_gpu::RatedGpuModel;
use chorus_plan::run::{run, GroupSpec, ModelSpec, PlanError, Ranks, RunSpec, MAX_THREADED_RANKS};
use chorus_plan::workload::{DecoderKind, DecoderShape, RecomputeMode, StageWork};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::{gpt, llama, DecoderGroups};

use crate::outdir::OutDir;
use crate::{Outcome, UsageError};

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
/// The largest `config.json` read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Any one size flag's bound: far above any model, far below an overflow.
const MAX_SIZE: usize = 1 << 24;
/// Steps run; the last is measured (the first allocates the optimizer's state).
const STEPS: usize = 2;

/// Models `chorus plan` plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanModel {
    /// chorus's transformer (`chorus train --model gpt`).
    Gpt,
    /// A Hugging Face Llama (`chorus train --model llama`).
    Llama,
}

/// torchtitan's activation checkpointing modes, and `chorus train`'s
/// `true` and `false` for every group (full) and none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RecomputeArg {
    /// Keep every activation.
    #[value(alias = "false")]
    None,
    /// Keep each layer's input; recompute the layer in backward.
    #[value(alias = "true")]
    Full,
    /// torchtitan's op-level selective checkpointing.
    Selective,
}

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

/// Optimizers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanOptimizer {
    /// SGD with --momentum.
    Sgd,
    /// AdamW.
    Adamw,
}

/// Arguments of `chorus plan`.
#[derive(Clone, Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct PlanArgs {
    /// The model.
    #[arg(long, value_enum, default_value = "llama")]
    pub model: PlanModel,
    /// llama: the model's config.json (Hugging Face's).
    #[arg(long, conflicts_with = "init_from")]
    pub config: Option<PathBuf>,
    /// llama: a Hugging Face model directory whose config.json is read (the weights are not).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Decoder layers (without --config; default 2).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Width of the residual stream (without --config; default 64); `chorus train`'s Llama calls it --hidden.
    #[arg(long, visible_alias = "hidden")]
    pub d_model: Option<usize>,
    /// Attention heads (without --config; default 4).
    #[arg(long)]
    pub heads: Option<usize>,
    /// llama: key/value heads (without --config; default min(2, heads)).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Width of the MLP (without --config; default 4 × d-model for gpt, 2 × for llama, as `chorus train`);
    /// `chorus train`'s Llama calls it --intermediate.
    #[arg(long, visible_alias = "intermediate")]
    pub d_ff: Option<usize>,
    /// Vocabulary (without --config; default 256).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Sequences per GPU per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 32)]
    pub seq_len: usize,
    /// Micro-batches per step (they divide --batch).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// GPUs (ranks).
    #[arg(long)]
    pub gpus: usize,
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
    /// HSDP: replicate over this many groups (it must divide --gpus).
    #[arg(long)]
    pub hsdp: Option<usize>,
    /// true, false, or a smaller world size that divides the shard world.
    #[arg(long, default_value = "true")]
    pub reshard_after_forward: Reshard,
    /// Activation checkpointing: none, full or selective (`chorus train`'s false and true are none and full).
    #[arg(long, value_enum, default_value = "full")]
    pub recompute: RecomputeArg,
    /// Dtype of all-gathers and compute: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = parse_float_dtype)]
    pub param_dtype: DType,
    /// Dtype of gradient reduction (default: the param dtype).
    #[arg(long, value_parser = parse_float_dtype)]
    pub reduce_dtype: Option<DType>,
    /// The optimizer.
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: PlanOptimizer,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// Clip the global gradient norm to this.
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Dtype parameters travel in on the all-gather: float8 (e4m3, quantized per group with an amax
    /// all-reduce, dequantized after the gather) or the param dtype (the default), as `chorus train`'s.
    #[arg(long, value_parser = crate::train::parse_all_gather_dtype)]
    pub all_gather_dtype: Option<DType>,
    /// CPU offload (FSDP2's CPUOffloadPolicy): sharded parameters, gradients and optimizer state in host
    /// memory; on a GPU the optimizer steps on the host.
    #[arg(long)]
    pub offload: bool,
    /// Parameters with fewer elements than this are replicated, not sharded (their gradients all-reduced).
    #[arg(long, default_value_t = 0)]
    pub replicate_below: usize,
    /// Write plan.json and timeline.svg here (a directory of its own; an earlier plan's is replaced).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// --gpu cpu: a calibration's rates (the file `ci/cpu-plan-check.sh` writes: a regular file, at most 64 KiB) instead of the frozen ones.
    #[arg(long)]
    pub cpu_rates: Option<PathBuf>,
}

fn parse_float_dtype(s: &str) -> Result<DType, String> {
    match s.parse::<DType>() {
        Ok(d @ (DType::F32 | DType::BF16 | DType::F16)) => Ok(d),
        _ => Err(format!("`{s}` is not a training dtype: f32, bf16 or f16")),
    }
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(msg.into()))
}

/// The model's groups and shapes.
pub struct Model {
    /// The groups `chorus train` registers.
    pub groups: DecoderGroups,
    /// The shapes the workload is computed from.
    pub shape: DecoderShape,
}

/// Checks every flag and reads the model's configuration.
pub fn model(args: &PlanArgs) -> anyhow::Result<Model> {
    let checks = [
        (args.gpus, "--gpus", MAX_GPUS),
        (args.gpus_per_node, "--gpus-per-node", MAX_GPUS),
        (args.batch, "--batch", MAX_SIZE),
        (args.seq_len, "--seq-len", MAX_SIZE),
        (args.micro_batches, "--micro-batches", MAX_SIZE),
    ];
    for (v, flag, max) in checks {
        if v == 0 || v > max {
            return Err(usage(format!("{flag} {v}: must be in 1..={max}")));
        }
    }
    for (v, flag) in [(args.layers, "--layers"), (args.d_model, "--d-model (--hidden)"), (args.heads, "--heads")]
        .into_iter()
        .chain([(args.kv_heads, "--kv-heads"), (args.d_ff, "--d-ff (--intermediate)"), (args.vocab, "--vocab")])
    {
        if let Some(v) = v.filter(|v| *v == 0 || *v > MAX_SIZE) {
            return Err(usage(format!("{flag} {v}: must be in 1..={MAX_SIZE}")));
        }
    }
    if args.batch % args.micro_batches != 0 {
        return Err(usage(format!("--micro-batches {} does not divide --batch {}", args.micro_batches, args.batch)));
    }
    if let Some(r) = args.hsdp {
        if r == 0 || args.gpus % r != 0 {
            return Err(usage(format!("--hsdp {r} does not divide --gpus {}", args.gpus)));
        }
    }
    if let Some(m) = args.max_grad_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
        return Err(usage(format!("--max-grad-norm {m}: must be a positive number")));
    }
    if !(args.momentum.is_finite() && args.momentum >= 0.0) {
        return Err(usage(format!("--momentum {}: must be a non-negative number", args.momentum)));
    }
    if let Some(d) = args.all_gather_dtype.filter(|d| *d != DType::F8E4M3 && *d != args.param_dtype) {
        return Err(usage(format!("--all-gather-dtype {d}: must be float8 or the param dtype ({})", args.param_dtype)));
    }
    let layers = args.layers.unwrap_or(2);
    let d = args.d_model.unwrap_or(64);
    let heads = args.heads.unwrap_or(4);
    let vocab = args.vocab.unwrap_or(256);
    match args.model {
        PlanModel::Gpt => {
            if args.config.is_some() || args.init_from.is_some() || args.kv_heads.is_some() {
                return Err(usage("--config, --init-from and --kv-heads are the Llama's (--model llama)"));
            }
            let cfg = gpt::GptConfig {
                vocab,
                d_model: d,
                layers,
                heads,
                d_ff: args.d_ff.unwrap_or(4 * d),
                seq_len: args.seq_len,
            };
            cfg.validate().map_err(|e| usage(format!("the transformer's sizes: {e}")))?;
            check_runs(args, layers)?;
            let shape = DecoderShape {
                kind: DecoderKind::Gpt,
                layers,
                d_model: d,
                heads,
                kv_heads: heads,
                ffn_hidden: cfg.d_ff,
                vocab,
                tied_embeddings: false,
            };
            let groups = gpt::groups(&cfg)?;
            check_shards(args, &groups)?;
            Ok(Model { groups, shape })
        }
        PlanModel::Llama => {
            let cfg = match (&args.config, &args.init_from) {
                (Some(file), _) => read_config_file(file)?,
                (None, Some(dir)) => {
                    chorus_train::models::llama::hf::read_config(dir).map_err(|e| usage(format!("--init-from: {e}")))?
                }
                (None, None) => LlamaConfig::new(
                    vocab,
                    d,
                    args.d_ff.unwrap_or(2 * d),
                    layers,
                    heads,
                    args.kv_heads.unwrap_or(2.min(heads)),
                ),
            };
            let from_file = args.config.is_some() || args.init_from.is_some();
            let flags = [args.layers, args.d_model, args.heads, args.kv_heads, args.d_ff, args.vocab];
            if from_file && flags.iter().any(Option::is_some) {
                return Err(usage("the sizes come from the config.json: leave out --layers, --d-model (--hidden), --heads, --kv-heads, --d-ff (--intermediate) and --vocab"));
            }
            cfg.validate().map_err(|e| usage(format!("the Llama's configuration: {e}")))?;
            check_runs(args, cfg.num_hidden_layers)?;
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
            let groups = llama::groups(&cfg)?;
            check_shards(args, &groups)?;
            Ok(Model { groups, shape })
        }
    }
}

/// The planner's bounds on its own work: [`MAX_LAYERS`] layers and
/// [`MAX_STAGE_RUNS`] stage runs per step, checked before the groups are built.
fn check_runs(args: &PlanArgs, layers: usize) -> anyhow::Result<()> {
    if layers > MAX_LAYERS {
        return Err(usage(format!(
            "{layers} layers: a plan runs FSDP on every layer's group, at most {MAX_LAYERS} layers"
        )));
    }
    let runs = args.micro_batches.saturating_mul(layers + 2);
    if runs > MAX_STAGE_RUNS {
        return Err(usage(format!(
            "--micro-batches {} × {} stages ({layers} layers, the embedding and the head) = {runs} stage runs per step: a plan runs at most {MAX_STAGE_RUNS}",
            args.micro_batches,
            layers + 2
        )));
    }
    Ok(())
}

/// Every parameter's shard within `chorus_plan::run::MAX_SHARD_BYTES`:
/// the planner registers each shard as zeros in host memory.
fn check_shards(args: &PlanArgs, groups: &DecoderGroups) -> anyhow::Result<()> {
    let max = chorus_plan::run::MAX_SHARD_BYTES as u128;
    let shard_world = (args.gpus / args.hsdp.unwrap_or(1).max(1)).max(1) as u128;
    for (name, shape) in groups.groups.iter().flat_map(|g| &g.params) {
        let numel: u128 = shape.iter().map(|d| *d as u128).product();
        // Sharded on dim 0 (padded), or whole below --replicate-below.
        let bytes = match shape.first() {
            Some(&rows) if numel >= args.replicate_below as u128 => {
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

/// A config.json given by path: a regular file of at most [`MAX_CONFIG_BYTES`].
fn read_config_file(path: &Path) -> anyhow::Result<LlamaConfig> {
    let meta = std::fs::metadata(path).map_err(|e| usage(format!("--config {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(usage(format!("--config {}: not a regular file", path.display())));
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(usage(format!(
            "--config {}: {} bytes, more than a config.json's {MAX_CONFIG_BYTES}",
            path.display(),
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("--config {}", path.display()))?;
    LlamaConfig::from_json(&text).map_err(|e| usage(format!("--config {}: {e}", path.display())))
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

/// The workload's recompute mode of `--recompute`.
pub fn recompute_mode(r: RecomputeArg) -> RecomputeMode {
    match r {
        RecomputeArg::None => RecomputeMode::None,
        RecomputeArg::Full => RecomputeMode::Full,
        RecomputeArg::Selective => RecomputeMode::Selective,
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

/// `--kernels`' name of `f`.
pub fn kernels_name(f: Framework) -> &'static str {
    match f {
        Framework::TorchEager => "torch",
        Framework::Candle => "candle",
        Framework::Chorus => "chorus",
    }
}

/// The two answers of the cost models: the times of `--gpu` (the GPU
/// tables and NCCL's algorithms; chorus's trainer on a GPU from its kernel
/// rates, host included; or the cpu device's calibration shared by
/// `--gpus` sim ranks) and the model's work per stage, with the kernels of
/// what runs there.
fn cost_inputs(args: &PlanArgs, shape: &DecoderShape) -> anyhow::Result<Priced> {
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
            Arc::new(chorus_plan::cpu_model::CpuModel::from_rates(&rates, args.gpus))
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
    let micro = args.batch / args.micro_batches;
    let work = chorus_plan::decoder_cost::decoder_work_for(
        framework,
        shape,
        micro,
        args.seq_len,
        args.param_dtype.size(),
        recompute_mode(args.recompute),
    );
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
    let optimizer = match args.optimizer {
        PlanOptimizer::Adamw => OptimizerKind::adamw(1e-3, 0.01),
        PlanOptimizer::Sgd => OptimizerKind::sgd(1e-2, args.momentum),
    };
    let fsdp = FsdpConfig {
        reshard_after_forward: args.reshard_after_forward,
        mixed_precision: MixedPrecision {
            param_dtype: Some(args.param_dtype),
            reduce_dtype: args.reduce_dtype,
            output_dtype: None,
            all_gather_dtype: args.all_gather_dtype,
        },
        replicate_below: args.replicate_below,
        offload: args.offload.then(OffloadPolicy::default),
        ..FsdpConfig::default()
    };
    let mut run_spec = RunSpec {
        world: args.gpus,
        ranks: Ranks::Symmetric,
        replicate: args.hsdp,
        fsdp,
        forward_prefetch: true,
        optimizer,
        max_grad_norm: args.max_grad_norm,
        micro_batches: args.micro_batches,
        steps: STEPS,
        kernels_reach_host: args.gpu == "cpu",
        trace_rank: Some(0),
        timeout: Duration::from_secs(600),
    };
    let peak = cost.peak_flops();
    // Every rank of a decoder runs alike unless its groups sit differently on the nodes.
    let result = match run(&spec, &run_spec, cost.clone()) {
        Err(PlanError::Asymmetric(_)) if args.gpus <= MAX_THREADED_RANKS => {
            run_spec.ranks = Ranks::Every;
            run(&spec, &run_spec, cost)?
        }
        Err(PlanError::Asymmetric(why)) => {
            return Err(usage(format!(
                "{why}; such a plan runs every rank, a thread each, at most {MAX_THREADED_RANKS} (--gpus {}): place the groups alike (--gpus-per-node, --hsdp, --reshard-after-forward) or plan fewer GPUs",
                args.gpus
            )))
        }
        r => r?,
    };
    report::Plan::new(args, &work, peak, rates.as_ref(), result)
}

/// `chorus plan`.
pub fn run_cli(args: &PlanArgs) -> anyhow::Result<Outcome> {
    let model = model(args)?;
    let priced = cost_inputs(args, &model.shape)?;
    let out = match &args.out_dir {
        Some(dir) => Some(OutDir::acquire(dir, "plan", &[])?),
        None => None,
    };
    let plan = execute(args, &model, priced)?;
    print!("{}", plan.text());
    if let Some(out) = out {
        plan.write(out.stage())?;
        out.commit()?;
    }
    // A plan that does not fit, or whose ranks diverge, is a failed plan (exit status 1).
    Ok(if plan.divergence.is_some() || plan.fits == Some(false) { Outcome::Failed } else { Outcome::Passed })
}
