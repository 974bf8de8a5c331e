//! `chorus train`: a model under FSDP on simulated ranks (or a GPU backend):
//! the transformer through the candle adapter (`--model gpt`, the default),
//! or the reference MLP (`--model mlp`, with PyTorch-compatible `.npy` input
//! and output, and `--bench` for FSDP's step time and host overhead).
//!
//! Nothing is written before the arguments are checked (bad ones exit 2,
//! the memory a run needs included); the out-dir is locked against another
//! run and replaced whole when the run has written everything
//! ([`crate::outdir`]); a loss that stops being finite stops the run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::{ComputeBackend, DType};
use chorus_fsdp::{Fsdp, FsdpConfig, MixedPrecision, OptimizerKind, ParamInit, Reshard};
use chorus_train::gpt::{init_params, GptConfig};
use chorus_train::gpt_train::{train_gpt, GptReport, GptSpec};
use chorus_train::mlp::init_layers;
use chorus_train::npy;
use chorus_train::text::{self, TextData};
use chorus_train::train::{train, Dataset, RankReport, TrainSpec};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::backends::Backend;
use crate::outdir::{write_file, OutDir};
use crate::{Outcome, UsageError};

/// Optimizers `chorus train` offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerArg {
    /// SGD (PyTorch semantics; --momentum).
    Sgd,
    /// AdamW (PyTorch semantics; --weight-decay).
    Adamw,
}

/// Models `chorus train` trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelArg {
    /// A decoder-only transformer (candle-nn) on generated text, through the candle adapter.
    Gpt,
    /// The reference MLP (device kernels), `.npy` in and out.
    Mlp,
}

/// Arguments of `chorus train`.
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// The model (default gpt; --bench measures the mlp).
    #[arg(long, value_enum)]
    pub model: Option<ModelArg>,
    /// The communication backend: sim, simnccl, or nccl/rccl (one rank per GPU, in builds with those features).
    #[arg(long, default_value = "sim", value_parser = crate::backends::parse_backend)]
    pub backend: Backend,
    /// Number of ranks (default 4).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// HSDP: replicate over this many groups (it must divide the world size).
    #[arg(long)]
    pub hsdp: Option<usize>,
    /// Training steps (default 300 for gpt, 20 for the gpt bench, 50 for mlp); with --resume, the step to stop before.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Rows (mlp) or sequences (gpt) per rank per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// The optimizer (default adamw for gpt, sgd for mlp).
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerArg>,
    /// Learning rate (default 0.05 for SGD; AdamW 3e-3 for gpt, 1e-3 for mlp).
    #[arg(long)]
    pub lr: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// Weight decay (default 0.01 for AdamW, 0 for SGD).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Dtype of all-gathers and compute.
    #[arg(long, default_value = "f32", value_parser = parse_float_dtype)]
    pub param_dtype: DType,
    /// Dtype of gradient reduction (default: the param dtype).
    #[arg(long, value_parser = parse_float_dtype)]
    pub reduce_dtype: Option<DType>,
    /// true, false, or a smaller world size that divides the shard world.
    #[arg(long, default_value = "true")]
    pub reshard_after_forward: Reshard,
    /// mlp: layer widths, e.g. 37,64,33,5 (instead of --layers/--width; default 16,64,64,4).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["layers", "width"])]
    pub dims: Option<Vec<usize>>,
    /// mlp: number of Linear layers (with --width); gpt: transformer blocks (default 2).
    #[arg(long)]
    pub layers: Option<usize>,
    /// mlp: width of every layer (with --layers).
    #[arg(long)]
    pub width: Option<usize>,
    /// gpt: width of the residual stream.
    #[arg(long, default_value_t = 64)]
    pub d_model: usize,
    /// gpt: attention heads (they divide --d-model).
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// gpt: width of the MLP's hidden layer (default 4 × --d-model).
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// gpt: context length.
    #[arg(long, default_value_t = 32)]
    pub seq_len: usize,
    /// gpt: train on this text file (ASCII; other characters become spaces) instead of generated text.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// gpt: micro-batches per step (gradient accumulation; they divide --batch).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// gpt: save a sharded checkpoint every N steps (and at the end).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// gpt: where checkpoints go (default <out-dir>-checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// gpt: resume from a checkpoint directory (a step-* directory, or one with a `latest` file).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Keep training when the loss is NaN or infinite (default: stop with an error).
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// mlp: parameters with fewer elements than this are replicated, not sharded.
    #[arg(long, default_value_t = 0)]
    pub replicate_below: usize,
    /// Clip the global gradient norm to this.
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Seed of the weights and data (mlp: when there is no --init-dir).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// mlp: directory with layers.{i}.weight.npy / layers.{i}.bias.npy and x.npy / y.npy (float32).
    #[arg(long)]
    pub init_dir: Option<PathBuf>,
    /// Where the results go (default out/train): replaced whole when the run succeeds.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Benchmark instead of training: the mlp (default) at world sizes 1, 2, 4, 8 (step time, FSDP host
    /// overhead per group per step, peak memory), or with --model gpt the transformer through the candle
    /// adapter at --world-size ranks against plain single-process candle on the same global batch.
    #[arg(long)]
    pub bench: bool,
    /// With --bench: print one JSON object per row.
    #[arg(long)]
    pub json: bool,
    /// With --bench --model gpt: run one side of the comparison in this process and print its JSON (internal).
    #[arg(long, value_enum, hide = true)]
    pub bench_part: Option<BenchPart>,
}

/// One side of `chorus train --bench --model gpt`, each run in a process of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchPart {
    /// Plain single-process candle on the global batch.
    Plain,
    /// FSDP through the candle adapter on simulated ranks.
    Fsdp,
}

fn parse_float_dtype(s: &str) -> Result<DType, String> {
    match s.parse::<DType>()? {
        d @ (DType::F32 | DType::BF16 | DType::F16) => Ok(d),
        d => Err(format!("{d} is not a training dtype (f32, bf16 or f16)")),
    }
}

/// Ranks the simulated backend runs (each rank is a handful of threads).
const MAX_SIM_WORLD: usize = 512;

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// A byte or element count for the memory check: saturating arithmetic, so
/// no size a user gives overflows (the result is then "more than any machine").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sat(u128);

impl Sat {
    fn of<T: TryInto<u128>>(n: T) -> Sat {
        Sat(n.try_into().unwrap_or(u128::MAX))
    }
}

impl std::ops::Add for Sat {
    type Output = Sat;
    fn add(self, o: Sat) -> Sat {
        Sat(self.0.saturating_add(o.0))
    }
}

impl std::ops::Mul for Sat {
    type Output = Sat;
    fn mul(self, o: Sat) -> Sat {
        Sat(self.0.saturating_mul(o.0))
    }
}

impl std::ops::Div for Sat {
    type Output = Sat;
    fn div(self, o: Sat) -> Sat {
        Sat(self.0.checked_div(o.0).unwrap_or(u128::MAX))
    }
}

impl TrainArgs {
    fn model(&self) -> ModelArg {
        self.model.unwrap_or(if self.bench { ModelArg::Mlp } else { ModelArg::Gpt })
    }
    fn world(&self) -> usize {
        self.world_size.unwrap_or(4)
    }
    fn steps(&self) -> u64 {
        self.steps.unwrap_or(match self.model() {
            ModelArg::Gpt if self.bench => 20,
            ModelArg::Gpt => 300,
            ModelArg::Mlp => 50,
        })
    }
    fn out_dir(&self) -> PathBuf {
        self.out_dir.clone().unwrap_or_else(|| PathBuf::from("out/train"))
    }
    fn optimizer_arg(&self) -> OptimizerArg {
        self.optimizer.unwrap_or(match self.model() {
            ModelArg::Gpt => OptimizerArg::Adamw,
            ModelArg::Mlp => OptimizerArg::Sgd,
        })
    }

    /// Every check that needs no file: ranges, combinations, the memory the run needs.
    fn usage(&self) -> anyhow::Result<()> {
        let model = self.model();
        let world = self.world();
        if world == 0 || self.batch == 0 {
            return Err(usage("--world-size and --batch must be at least 1"));
        }
        if self.steps() == 0 {
            return Err(usage("--steps must be at least 1"));
        }
        if matches!(self.backend.name(), "sim" | "simnccl") && world > MAX_SIM_WORLD {
            return Err(usage(format!(
                "--world-size {world}: the {} backend runs every rank as threads of this process; at most {MAX_SIM_WORLD}",
                self.backend
            )));
        }
        if self.bench {
            let mlp = model == ModelArg::Mlp;
            for (given, name) in [
                (mlp && self.world_size.is_some(), "--world-size with the mlp (it measures 1, 2, 4 and 8 ranks)"),
                (self.init_dir.is_some(), "--init-dir"),
                (self.out_dir.is_some(), "--out-dir (it writes nothing)"),
                (mlp && self.hsdp.is_some(), "--hsdp with the mlp"),
                (self.resume.is_some(), "--resume"),
                (self.save_every.is_some(), "--save-every"),
                (self.checkpoint_dir.is_some(), "--checkpoint-dir"),
                (!mlp && self.param_dtype != DType::F32, "--param-dtype with --model gpt (plain candle trains in f32)"),
                (!mlp && self.max_grad_norm.is_some(), "--max-grad-norm with --model gpt"),
            ] {
                if given {
                    return Err(usage(format!("--bench does not use {name}")));
                }
            }
        } else if self.json {
            return Err(usage("--json goes with --bench"));
        }
        let shard_world = match self.hsdp {
            Some(r) if r == 0 || world % r != 0 => {
                return Err(usage(format!("--hsdp {r} must divide --world-size {world}")));
            }
            Some(r) => world / r,
            None => world,
        };
        if let Reshard::To(k) = self.reshard_after_forward {
            if k > shard_world || shard_world % k != 0 {
                return Err(usage(format!(
                    "--reshard-after-forward {k} must divide the shard world of {shard_world} ranks"
                )));
            }
        }
        let lr_ok = self.lr.is_none_or(|lr| lr.is_finite() && lr >= 0.0);
        if !lr_ok {
            return Err(usage(format!("--lr {} must be a finite number ≥ 0", self.lr.unwrap_or_default())));
        }
        if !(self.momentum.is_finite() && self.momentum >= 0.0) {
            return Err(usage(format!("--momentum {} must be a finite number ≥ 0", self.momentum)));
        }
        if let Some(w) = self.weight_decay.filter(|w| !(w.is_finite() && *w >= 0.0)) {
            return Err(usage(format!("--weight-decay {w} must be a finite number ≥ 0")));
        }
        if let Some(m) = self.max_grad_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
            return Err(usage(format!("--max-grad-norm {m} must be a finite number > 0")));
        }
        if self.momentum != 0.0 && self.optimizer_arg() == OptimizerArg::Adamw {
            return Err(usage("--momentum is for --optimizer sgd"));
        }
        match model {
            ModelArg::Mlp => self.usage_mlp(world),
            ModelArg::Gpt => self.usage_gpt(world),
        }
    }

    fn usage_mlp(&self, world: usize) -> anyhow::Result<()> {
        for (given, name) in [
            (self.text.is_some(), "--text"),
            (self.d_ff.is_some(), "--d-ff"),
            (self.save_every.is_some(), "--save-every"),
            (self.checkpoint_dir.is_some(), "--checkpoint-dir"),
            (self.resume.is_some(), "--resume"),
            (self.micro_batches != 1, "--micro-batches"),
        ] {
            if given {
                return Err(usage(format!("{name} is for --model gpt")));
            }
        }
        if self.layers.is_some() != self.width.is_some() {
            return Err(usage("--layers and --width go together"));
        }
        if let Some(d) = &self.dims {
            if d.len() < 2 || d.contains(&0) {
                return Err(usage("--dims needs at least two positive widths"));
            }
        }
        if let (Some(0), _) | (_, Some(0)) = (self.layers, self.width) {
            return Err(usage("--layers and --width must be positive"));
        }
        if self.init_dir.is_some() && (self.dims.is_some() || self.layers.is_some()) {
            return Err(usage("--init-dir gives the model; --dims/--layers/--width do not apply"));
        }
        // The memory the run needs, saturating so no size overflows (the
        // init dir's sizes are checked again once its headers are read).
        let dims: Vec<Sat> = match (&self.dims, self.layers, self.width) {
            (Some(d), _, _) => d.iter().map(|v| Sat::of(*v)).collect(),
            (None, Some(l), Some(w)) => {
                if l as u128 > 1 << 20 {
                    return Err(usage(format!("--layers {l} is more than this tool trains (at most {})", 1 << 20)));
                }
                vec![Sat::of(w); l + 1]
            }
            _ if self.init_dir.is_some() => return Ok(()),
            _ => [16, 64, 64, 4].map(Sat::of).to_vec(),
        };
        let params = dims.windows(2).fold(Sat(0), |acc, w| acc + w[0] * w[1] + w[1]);
        let widest = dims.iter().map(|d| d.0).max().map_or(Sat(0), Sat);
        let (world_, batch, steps) = (Sat::of(world), Sat::of(self.batch), Sat::of(self.steps()));
        let batches = Sat::of(self.steps().clamp(1, 16));
        let data = batches * world_ * batch * (dims[0] + dims[dims.len() - 1]) * Sat(4);
        let width_sum = dims.iter().fold(Sat(0), |a, d| a + *d);
        let per_rank = Sat(4) * (Sat(4) * params / world_ + Sat(3) * params + Sat(4) * batch * width_sum)
            + Sat(16) * steps
            + Sat(8) * widest;
        self.check_memory((data + world_ * per_rank + Sat(8) * params).0)
    }

    fn gpt_config(&self) -> GptConfig {
        GptConfig {
            vocab: text::vocab_size(),
            d_model: self.d_model,
            layers: self.layers.unwrap_or(2),
            heads: self.heads,
            d_ff: self.d_ff.unwrap_or(self.d_model.saturating_mul(4)),
            seq_len: self.seq_len,
        }
    }

    fn usage_gpt(&self, world: usize) -> anyhow::Result<()> {
        if matches!(self.backend.name(), "nccl" | "rccl") {
            return Err(usage(format!(
                "--model gpt computes with candle on the CPU, so it runs on backends whose device holds host memory (sim, simnccl, ucx), not {}; use --model mlp (the candle-CUDA path is designed in docs/fsdp.md, not built)",
                self.backend
            )));
        }
        for (given, name) in [
            (self.dims.is_some(), "--dims"),
            (self.width.is_some(), "--width"),
            (self.init_dir.is_some(), "--init-dir"),
            (self.replicate_below != 0, "--replicate-below"),
        ] {
            if given {
                return Err(usage(format!("{name} is for --model mlp")));
            }
        }
        let cfg = self.gpt_config();
        cfg.validate().map_err(usage)?;
        if self.micro_batches == 0 || self.batch % self.micro_batches != 0 {
            return Err(usage(format!("--micro-batches {} must divide --batch {}", self.micro_batches, self.batch)));
        }
        if self.save_every == Some(0) {
            return Err(usage("--save-every must be at least 1"));
        }
        let (v, d, l, f, t) =
            (Sat::of(cfg.vocab), Sat::of(cfg.d_model), Sat::of(cfg.layers), Sat::of(cfg.d_ff), Sat::of(cfg.seq_len));
        let params = Sat(2) * v * d + d + l * (Sat(4) * d * d + Sat(2) * d * f + Sat(2) * d);
        let tokens = Sat::of(self.batch) * t;
        let heads = Sat::of(cfg.heads);
        let activations = Sat(4) * tokens * (l + Sat(2)) * (Sat(8) * d + Sat(2) * f + Sat(3) * heads * t + Sat(3) * v);
        let per_rank = Sat(4) * (Sat(4) * params / Sat::of(world) + Sat(4) * params)
            + activations
            + Sat(16) * Sat::of(self.steps());
        self.check_memory((Sat::of(world) * per_rank + Sat(4 << 20)).0)
    }

    fn check_memory(&self, needed: u128) -> anyhow::Result<()> {
        crate::size::check_memory(needed, "this run", "make the model, batch, world or --steps smaller").map_err(usage)
    }

    fn optimizer(&self) -> OptimizerKind {
        match self.optimizer_arg() {
            OptimizerArg::Sgd => OptimizerKind::Sgd {
                lr: self.lr.unwrap_or(0.05),
                momentum: self.momentum,
                dampening: 0.0,
                weight_decay: self.weight_decay.unwrap_or(0.0),
                nesterov: false,
            },
            OptimizerArg::Adamw => {
                let default_lr = if self.model() == ModelArg::Gpt { 3e-3 } else { 1e-3 };
                OptimizerKind::adamw(self.lr.unwrap_or(default_lr), self.weight_decay.unwrap_or(0.01))
            }
        }
    }

    fn fsdp_config(&self) -> FsdpConfig {
        FsdpConfig {
            reshard_after_forward: self.reshard_after_forward,
            mixed_precision: MixedPrecision {
                param_dtype: Some(self.param_dtype),
                reduce_dtype: self.reduce_dtype,
                output_dtype: None,
            },
            replicate_below: self.replicate_below,
            ..FsdpConfig::default()
        }
    }

    fn dims(&self) -> Vec<usize> {
        match (&self.dims, self.layers, self.width) {
            (Some(d), _, _) => d.clone(),
            (None, Some(l), Some(w)) => vec![w; l + 1],
            _ => vec![16, 64, 64, 4],
        }
    }

    fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir.clone().unwrap_or_else(|| {
            let out = self.out_dir();
            let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "train".into());
            out.with_file_name(format!("{name}-checkpoints"))
        })
    }
}

/// The configuration as structured JSON (for `summary.json`).
fn optimizer_json(kind: OptimizerKind) -> serde_json::Value {
    match kind {
        OptimizerKind::Sgd { lr, momentum, dampening, weight_decay, nesterov } => json!({
            "kind": "sgd", "lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov,
        }),
        OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => json!({
            "kind": "adamw", "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        }),
    }
}

// ---------------------------------------------------------------- the MLP's files

/// Loads `layers.{i}.weight.npy`/`layers.{i}.bias.npy` (consecutive from 0) and `x.npy`/`y.npy`.
fn load_init(dir: &Path) -> anyhow::Result<(Vec<Vec<ParamInit>>, Dataset)> {
    if !dir.is_dir() {
        anyhow::bail!("--init-dir {}: not a directory", dir.display());
    }
    let mut layers = Vec::new();
    for i in 0.. {
        let w = dir.join(format!("layers.{i}.weight.npy"));
        if !w.exists() {
            break;
        }
        let b = dir.join(format!("layers.{i}.bias.npy"));
        let (w, b) = (npy::read(&w)?, npy::read(&b)?);
        layers.push(vec![
            ParamInit { name: format!("layers.{i}.weight"), shape: w.shape, values: w.values },
            ParamInit { name: format!("layers.{i}.bias"), shape: b.shape, values: b.values },
        ]);
    }
    if layers.is_empty() {
        anyhow::bail!("{} has no layers.0.weight.npy", dir.display());
    }
    // A layer file past the consecutive ones is a leftover of another model, not part of this one.
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(i) =
            name.strip_prefix("layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok())
        {
            if i >= layers.len() {
                anyhow::bail!(
                    "{}: {name} does not follow layers 0..{} (a file of another model?); remove it or use another --init-dir",
                    dir.display(),
                    layers.len()
                );
            }
        }
    }
    let data = Dataset::from_arrays(npy::read(&dir.join("x.npy"))?, npy::read(&dir.join("y.npy"))?)?;
    Ok((layers, data))
}

fn write_npy(path: &Path, shape: &[usize], values: &[f32]) -> anyhow::Result<()> {
    let bytes = npy::encode(shape, values).map_err(|e| anyhow::anyhow!("encoding {}: {e}", path.display()))?;
    write_file(path, &bytes)
}

fn save_init(dir: &Path, layers: &[Vec<ParamInit>], data: &Dataset) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for p in layers.iter().flatten() {
        write_npy(&dir.join(format!("{}.npy", p.name)), &p.shape, &p.values)?;
    }
    let (x, y) = data.arrays();
    write_npy(&dir.join("x.npy"), &x.shape, &x.values)?;
    write_npy(&dir.join("y.npy"), &y.shape, &y.values)
}

// ---------------------------------------------------------------- running ranks

/// What every rank runs: the MLP or the transformer.
pub(crate) trait RankJob: Send + Sync + 'static {
    type Report: Send + 'static;
    fn run<C: CommBackend + 'static>(
        &self,
        world: Arc<Communicator<C>>,
        on_step: &mut dyn FnMut(u64, f64),
    ) -> anyhow::Result<Self::Report>
    where
        C::B: ComputeBackend,
        Fsdp<C>: Send;
}

struct MlpJob(TrainSpec);

impl RankJob for MlpJob {
    type Report = RankReport;
    fn run<C: CommBackend + 'static>(
        &self,
        world: Arc<Communicator<C>>,
        on_step: &mut dyn FnMut(u64, f64),
    ) -> anyhow::Result<RankReport>
    where
        C::B: ComputeBackend,
        Fsdp<C>: Send,
    {
        Ok(train(world, &self.0, &mut |s, l| on_step(s as u64, l))?)
    }
}

struct GptJob(GptSpec);

impl RankJob for GptJob {
    type Report = GptReport;
    fn run<C: CommBackend + 'static>(
        &self,
        world: Arc<Communicator<C>>,
        on_step: &mut dyn FnMut(u64, f64),
    ) -> anyhow::Result<GptReport>
    where
        C::B: ComputeBackend,
        Fsdp<C>: Send,
    {
        Ok(train_gpt(world, &self.0, on_step)?)
    }
}

/// Limits the threads candle's CPU kernels use to this rank's share of the
/// machine's cores, unless the user set `RAYON_NUM_THREADS`.
///
/// candle's CPU backend takes its thread count from `RAYON_NUM_THREADS`
/// (else the physical cores): its matmul splits each product into that many
/// tasks, and its element-wise kernels run on one process-wide pool of that
/// many threads, sized at its first use, behind one lock, whose workers
/// spin at a barrier. Ranks sharing the cores, each computing with every
/// core's worth of threads, oversubscribe them and queue on that lock
/// (measured: 4 sim ranks on 2 cores step about 2× slower than with one
/// thread each; `docs/benchmarks.md`). Ranks as threads of this process
/// share its cores; ranks as processes share the node's with
/// `LOCAL_WORLD_SIZE - 1` others. Called from the main thread before candle
/// computes anything or any other thread starts (the environment is not
/// written while another thread may read it).
fn limit_candle_threads(backend: Backend, world: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", candle_threads(backend, world).to_string());
    }
}

/// This rank's share of the machine's cores (at least one).
fn candle_threads(backend: Backend, world: usize) -> usize {
    let local = if backend.runs_as_processes() {
        chorus_collectives::bootstrap::LaunchEnv::from_process_env().map_or(1, |env| env.local_world_size)
    } else {
        world
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local.max(1)).max(1)
}

/// Whether this process writes the run's outputs: always when the ranks are
/// its threads; under a launcher (one rank per process), only rank 0.
fn writes_outputs(backend: Backend) -> bool {
    !backend.runs_as_processes()
        || chorus_collectives::bootstrap::LaunchEnv::from_process_env().map_or(true, |env| env.rank == 0)
}

/// Runs `job` on `world` ranks of `backend` and returns every rank's report.
fn run_on<J: RankJob>(
    backend: Backend,
    world: usize,
    job: J,
    bar: Option<ProgressBar>,
) -> anyhow::Result<Vec<J::Report>> {
    // Under a launcher, the GPU backends run one rank per process (as ucx always does).
    let process = if backend.runs_as_processes() { crate::process::RankProcess::detect()? } else { None };
    crate::with_backend!(
        backend,
        sim => run_sim(world, job, bar),
        ucx => crate::process::train_ucx(process, world, &job, bar),
        vendor<L> => match process {
            Some(p) => crate::process::train_vendor::<L, J>(p, world, &job, bar),
            None => run_vendor::<L, J>(world, job, bar),
        }
    )
}

pub(crate) fn progress(rank: usize, bar: &Option<ProgressBar>, loss: f64) {
    if let (0, Some(b)) = (rank, bar) {
        b.set_message(format!("loss {loss:.4}"));
        b.inc(1);
    }
}

/// One rank per device of the NCCL family, as threads of this process,
/// bootstrapped through an in-memory store.
fn run_vendor<L, J: RankJob>(world: usize, job: J, bar: Option<ProgressBar>) -> anyhow::Result<Vec<J::Report>>
where
    L: chorus_collectives::vendor::VendorLib,
    L::B: chorus_conformance::vendor::HarnessDevice + chorus_devices::ComputeBackend,
    Fsdp<chorus_collectives::vendor::VendorComm<L>>: Send,
{
    use chorus_collectives::bootstrap::MemStore;
    use chorus_collectives::vendor::{VendorComm, VendorConfig};
    use chorus_conformance::vendor::HarnessDevice;
    let devices = L::B::count().map_err(anyhow::Error::msg)?;
    if world > devices {
        anyhow::bail!("{world} ranks need as many devices (one rank per device); {devices} visible");
    }
    let store = MemStore::new();
    let results: Vec<anyhow::Result<J::Report>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (store, job, bar) = (store.clone(), &job, bar.clone());
                s.spawn(move || -> anyhow::Result<J::Report> {
                    let device = L::B::make(rank, Duration::from_secs(300))?;
                    let comm = VendorComm::<L>::init(&store, rank, world, device, VendorConfig::default())?;
                    job.run(Arc::new(comm), &mut |_, loss| progress(rank, &bar, loss))
                        .with_context(|| format!("rank {rank}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    results.into_iter().collect()
}

/// Runs `job` on `world` simulated ranks and returns every rank's report.
fn run_sim<J: RankJob>(world: usize, job: J, bar: Option<ProgressBar>) -> anyhow::Result<Vec<J::Report>> {
    let job = Arc::new(job);
    let config = SimConfig {
        timeout: Duration::from_secs(300),
        // SAFETY: FSDP orders every cross-stream access with events, and the
        // conformance suite checks each of those orderings with the sanitizer
        // on (conformance/src/fsdp); the model's own work is on one stream.
        // Training runs without the sanitizer's per-operation bookkeeping.
        device: unsafe { CpuConfig::default().without_sanitizer() },
    };
    let bar = Arc::new(Mutex::new(bar));
    let results = SimWorld::run(world, config, move |comm| {
        let rank = comm.rank();
        let bar = bar.lock().map(|b| b.clone()).unwrap_or(None);
        job.run(Arc::new(comm), &mut |_, loss| progress(rank, &bar, loss))
    })?;
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.map_err(anyhow::Error::from).and_then(|v| v.with_context(|| format!("rank {rank}"))))
        .collect()
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Writes a line to stdout; a closed pipe or a full disk is an error the
/// caller returns (main ends a broken pipe quietly), never a panic.
fn say(line: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(line).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()).context("writing to stdout")
}

/// The honest summary of a loss curve: the mean of the first and of the
/// last `window` steps (a tenth of the run, at least one step).
struct LossSummary {
    window: usize,
    start: f64,
    end: f64,
}

fn summarize(losses: &[f64]) -> LossSummary {
    let window = (losses.len() / 10).max(1);
    LossSummary {
        window,
        start: mean(&losses[..window.min(losses.len())]),
        end: mean(&losses[losses.len().saturating_sub(window)..]),
    }
}

fn progress_bar(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed})")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Runs `chorus train`.
pub fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    args.usage()?;
    if args.bench {
        return bench(args);
    }
    match args.model() {
        ModelArg::Mlp => run_mlp(args),
        ModelArg::Gpt => run_gpt(args),
    }
}

fn run_mlp(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    let steps = args.steps();
    let rows = world * args.batch;
    let (layers, data) = match &args.init_dir {
        Some(dir) => load_init(dir)?,
        None => {
            let dims = args.dims();
            let data = Dataset::random(dims[0], dims[dims.len() - 1], rows, steps.clamp(1, 16) as usize, args.seed);
            (init_layers(&dims, args.seed), data)
        }
    };
    // One rank per process: rank 0 writes the outputs.
    let out = if writes_outputs(args.backend) { Some(OutDir::acquire(&args.out_dir())?) } else { None };
    if let (Some(out), None) = (&out, &args.init_dir) {
        save_init(&out.stage().join("init"), &layers, &data)?;
    }
    let spec = TrainSpec {
        layers,
        data: Arc::new(data),
        batch: args.batch,
        steps: usize::try_from(steps).map_err(|_| usage(format!("--steps {steps} is too large")))?,
        optimizer: args.optimizer(),
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        max_grad_norm: args.max_grad_norm,
        stop_on_nonfinite: !args.allow_nonfinite,
    };
    let bar = progress_bar(steps);
    let reports = run_on(args.backend, world, MlpJob(spec.clone()), Some(bar.clone()));
    bar.finish_and_clear();
    let reports = reports?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else { return Ok(Outcome::Passed) };
    let first = reports.first().context("no ranks")?;
    for (name, values) in &first.params {
        let shape = spec.layers.iter().flatten().find(|p| &p.name == name).map(|p| p.shape.clone()).unwrap_or_default();
        write_npy(&out.stage().join(format!("{name}.npy")), &shape, values)?;
    }
    let median_step = median(&first.step_times_s);
    let overhead_per_group_step = first.overhead.total.as_secs_f64() / (first.groups.max(1) as f64 * steps as f64);
    let s = summarize(&first.losses);
    let dims: Vec<usize> = std::iter::once(spec.layers[0][0].shape.get(1).copied().unwrap_or(0))
        .chain(spec.layers.iter().map(|l| l[0].shape[0]))
        .collect();
    let summary = json!({
        "model": "mlp",
        "losses": first.losses,
        "loss_window": s.window,
        "loss_start_mean": s.start,
        "loss_end_mean": s.end,
        "loss_smoothed": crate::plot::smooth(&first.losses, s.window),
        "step_times_s": first.step_times_s,
        "median_step_time_s": median_step,
        "peak_memory_bytes": reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
        "final_memory_bytes": reports.iter().map(|r| r.final_memory_bytes).collect::<Vec<_>>(),
        "fsdp_host_overhead_per_group_per_step_s": overhead_per_group_step,
        "config": {
            "model": "mlp",
            "backend": args.backend.name(),
            "world_size": world,
            "hsdp": args.hsdp,
            "steps": steps,
            "batch": args.batch,
            "optimizer": optimizer_json(spec.optimizer),
            "param_dtype": args.param_dtype.name(),
            "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
            "reshard_after_forward": args.reshard_after_forward.to_string(),
            "dims": dims,
            "replicate_below": args.replicate_below,
            "max_grad_norm": args.max_grad_norm,
            "seed": args.seed,
            "init_dir": args.init_dir.as_ref().map(|p| p.display().to_string()),
        },
    });
    let path = out.stage().join("summary.json");
    write_file(&path, serde_json::to_string_pretty(&summary)?.as_bytes())?;
    crate::plot::loss_curve(&out.stage().join("loss.svg"), "chorus train --model mlp", 0, &first.losses, s.window)?;
    let dest = out.dest().to_path_buf();
    out.commit()?;
    let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
    say(format_args!(
        "trained the mlp on {world} ranks x {steps} steps: loss {:.6} (mean of the first {w}) -> {:.6} (mean of the last {w}), median step {:.2} ms, peak memory {:.1} KiB/rank, FSDP overhead {:.1} us/group/step, wrote {}",
        s.start,
        s.end,
        median_step * 1e3,
        peak as f64 / 1024.0,
        overhead_per_group_step * 1e6,
        dest.display(),
        w = s.window,
    ))?;
    Ok(Outcome::Passed)
}

fn run_gpt(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    // Before candle computes anything: it sizes its pools once per process.
    limit_candle_threads(args.backend, world);
    let steps = args.steps();
    let cfg = args.gpt_config();
    let corpus = match &args.text {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("--text {}", path.display()))?,
        None => text::generate(200_000, args.seed),
    };
    let data = TextData::new(text::encode(&corpus), cfg.seq_len, args.seed).ok_or_else(|| {
        usage(format!(
            "the text has {} characters; --seq-len {} needs at least {}",
            corpus.len(),
            cfg.seq_len,
            cfg.seq_len + 2
        ))
    })?;
    if let Some(dir) = &args.resume {
        let state = chorus_fsdp_candle::checkpoint::read_training_state(dir)?;
        if state.step >= steps {
            return Err(usage(format!(
                "{} is at step {}; --steps {steps} leaves nothing to train",
                dir.display(),
                state.step
            )));
        }
    }
    let out = if writes_outputs(args.backend) { Some(OutDir::acquire(&args.out_dir())?) } else { None };
    let checkpoint_dir = (args.save_every.is_some() || args.checkpoint_dir.is_some()).then(|| args.checkpoint_dir());
    let spec = GptSpec {
        config: cfg,
        init: init_params(&cfg, args.seed)?,
        data: Arc::new(data),
        batch: args.batch,
        steps,
        optimizer: args.optimizer(),
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        max_grad_norm: args.max_grad_norm,
        forward_prefetch: true,
        micro_batches: args.micro_batches,
        checkpoint_dir: checkpoint_dir.clone(),
        save_every: args.save_every.unwrap_or(0),
        resume: args.resume.clone(),
        allow_nonfinite: args.allow_nonfinite,
    };
    let bar = progress_bar(steps);
    let reports = run_on(args.backend, world, GptJob(spec.clone()), Some(bar.clone()));
    bar.finish_and_clear();
    let reports = reports?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else { return Ok(Outcome::Passed) };
    let first = reports.first().context("no ranks")?;
    let all_losses: Vec<f64> = first.earlier_losses.iter().chain(&first.losses).copied().collect();
    let s = summarize(&all_losses);
    let median_step = median(&first.step_times_s);
    let ran = first.losses.len().max(1) as f64;
    let overhead_per_group_step = first.overhead.total.as_secs_f64() / (first.groups.max(1) as f64 * ran);
    // The trained model, unsharded, as candle and Python load it.
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = first
        .params
        .iter()
        .map(|(name, v)| {
            let shape = cfg
                .param_shapes()
                .into_iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s)
                .unwrap_or_else(|| vec![v.len()]);
            (name.clone(), shape, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect();
    let views = tensors
        .iter()
        .map(|(n, shape, b)| {
            Ok((n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    write_file(&out.stage().join("model.safetensors"), &safetensors::tensor::serialize(views, None)?)?;
    let sample = chorus_train::gpt::sample(&cfg, &first.params, "the cat ", 60)?;
    let summary = json!({
        "model": "gpt",
        "first_step": first.start_step - first.earlier_losses.len() as u64,
        "losses": all_losses,
        "loss_window": s.window,
        "loss_start_mean": s.start,
        "loss_end_mean": s.end,
        "loss_smoothed": crate::plot::smooth(&all_losses, s.window),
        "step_times_s": first.step_times_s,
        "median_step_time_s": median_step,
        "peak_memory_bytes": reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
        "fsdp_host_overhead_per_group_per_step_s": overhead_per_group_step,
        "adapter_transfer_per_step_s": first.adapter.transfer.as_secs_f64() / ran,
        "candle_compute_per_step_s": first.adapter.compute.as_secs_f64() / ran,
        "sample": sample,
        "checkpoints": first.saved.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "config": {
            "model": "gpt",
            "backend": args.backend.name(),
            "world_size": world,
            "hsdp": args.hsdp,
            "steps": steps,
            "batch": args.batch,
            "micro_batches": args.micro_batches,
            "optimizer": optimizer_json(spec.optimizer),
            "param_dtype": args.param_dtype.name(),
            "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
            "reshard_after_forward": args.reshard_after_forward.to_string(),
            "transformer": cfg,
            "parameters": cfg.num_params(),
            "max_grad_norm": args.max_grad_norm,
            "seed": args.seed,
            "text": args.text.as_ref().map(|p| p.display().to_string()),
            "resume": args.resume.as_ref().map(|p| p.display().to_string()),
            "start_step": first.start_step,
            "save_every": args.save_every,
            "checkpoint_dir": checkpoint_dir.as_ref().map(|p| p.display().to_string()),
        },
    });
    write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    let first_step = first.start_step - first.earlier_losses.len() as u64;
    crate::plot::loss_curve(
        &out.stage().join("loss.svg"),
        "chorus train --model gpt",
        first_step,
        &all_losses,
        s.window,
    )?;
    let dest = out.dest().to_path_buf();
    out.commit()?;
    let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
    say(format_args!(
        "trained the transformer ({} parameters) on {world} ranks, steps {}..{steps}: loss {:.3} (mean of the first {w} steps) -> {:.3} (mean of the last {w}), median step {:.1} ms, peak FSDP memory {:.1} KiB/rank, wrote {}",
        cfg.num_params(),
        first.start_step,
        s.start,
        s.end,
        median_step * 1e3,
        peak as f64 / 1024.0,
        dest.display(),
        w = s.window,
    ))?;
    say(format_args!("sample: {sample:?}"))?;
    Ok(Outcome::Passed)
}

/// `chorus train --bench`: the mlp at several world sizes, or the transformer against plain candle.
fn bench(args: &TrainArgs) -> anyhow::Result<Outcome> {
    match args.model() {
        ModelArg::Mlp => bench_mlp(args),
        ModelArg::Gpt => bench_gpt(args),
    }
}

/// `chorus train --bench --model gpt`: the transformer through the candle
/// adapter on `--world-size` simulated ranks against plain single-process
/// candle on the same global batch (`world × batch` sequences): step times
/// (median of the timed steps, after warm-up), FSDP's host overhead per
/// group and step, the adapter's own host time, and the device memory per
/// rank.
///
/// Each side runs in a fresh process of this binary (`--bench-part`), one
/// after the other: candle sizes its thread pools once per process
/// ([`limit_candle_threads`]), so plain candle gets candle's defaults (every
/// core) and the ranks get their share of the cores each.
fn bench_gpt(args: &TrainArgs) -> anyhow::Result<Outcome> {
    if args.backend.name() != "sim" {
        return Err(usage("--bench --model gpt runs on the sim backend (the ranks as threads beside plain candle)"));
    }
    if let Some(part) = args.bench_part {
        let result = bench_gpt_part(args, part)?;
        say(format_args!("{result}"))?;
        return Ok(Outcome::Passed);
    }
    let exe = std::env::current_exe().context("finding this program to run the benchmark's parts")?;
    let forwarded: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let part = |name: &str, threads: Option<String>| -> anyhow::Result<serde_json::Value> {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(&forwarded).args(["--bench-part", name]).stdin(std::process::Stdio::null());
        cmd.stderr(std::process::Stdio::inherit());
        if let Some(t) = threads {
            cmd.env("RAYON_NUM_THREADS", t);
        }
        let out = cmd.output().with_context(|| format!("running the {name} part of the benchmark"))?;
        if !out.status.success() {
            anyhow::bail!("the {name} part of the benchmark failed ({})", out.status);
        }
        serde_json::from_slice(&out.stdout).with_context(|| format!("reading the {name} part's result"))
    };
    let num = |v: &serde_json::Value, key: &str| v[key].as_f64().unwrap_or(f64::NAN);
    // Plain candle at its best: candle's default threads and one thread, the faster (unless the user chose).
    let user_threads = std::env::var("RAYON_NUM_THREADS").ok();
    let mut plains = vec![part("plain", None)?];
    if user_threads.is_none() {
        plains.push(part("plain", Some("1".into()))?);
    }
    let plain = plains
        .iter()
        .min_by(|a, b| num(a, "median_step_time_s").total_cmp(&num(b, "median_step_time_s")))
        .cloned()
        .context("no plain run")?;
    let fsdp =
        part("fsdp", Some(user_threads.unwrap_or_else(|| candle_threads(args.backend, args.world()).to_string())))?;
    let (plain_step, fsdp_step) = (num(&plain, "median_step_time_s"), num(&fsdp, "median_step_time_s"));
    let ratio = fsdp_step / plain_step;
    let cfg = args.gpt_config();
    let world = args.world();
    let params = cfg.num_params();
    let state_per_param = match args.optimizer() {
        OptimizerKind::AdamW { .. } => 16,
        OptimizerKind::Sgd { .. } => 8,
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string())
    });
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    if args.json {
        say(format_args!(
            "{}",
            json!({
                "model": "gpt", "transformer": cfg, "parameters": params, "world_size": world, "hsdp": args.hsdp,
                "batch_per_rank": args.batch, "global_batch": world * args.batch, "micro_batches": args.micro_batches,
                "reshard_after_forward": args.reshard_after_forward.to_string(),
                "optimizer": optimizer_json(args.optimizer()), "warmup_steps": GPT_BENCH_WARMUP, "timed_steps": args.steps(),
                "plain": plain, "plain_runs": plains, "fsdp": fsdp, "ratio": ratio,
                "plain_training_state_bytes": params * state_per_param,
                "machine": { "cores": cores, "cpu": cpu },
            })
        ))?;
        return Ok(Outcome::Passed);
    }
    say(format_args!(
        "# chorus train --bench --model gpt: transformer d_model {} x {} layers ({params} parameters), global batch {} x {} tokens, {} timed steps after {GPT_BENCH_WARMUP}",
        cfg.d_model,
        cfg.layers,
        world * args.batch,
        cfg.seq_len,
        args.steps()
    ))?;
    let runs: Vec<String> = plains
        .iter()
        .map(|p| {
            format!(
                "{} threads {:.2} ms",
                p["candle_threads"].as_str().unwrap_or("?"),
                num(p, "median_step_time_s") * 1e3
            )
        })
        .collect();
    say(format_args!(
        "# each side in its own process; plain candle at its best of [{}]; each FSDP rank {} candle thread(s)",
        runs.join(", "),
        fsdp["candle_threads"].as_str().unwrap_or("?"),
    ))?;
    let row = |label: String, value: String| say(format_args!("{label:<46} {value:>10}"));
    row("plain candle, 1 process: step ms (median)".into(), format!("{:.2}", plain_step * 1e3))?;
    row(format!("FSDP, {world} sim ranks: step ms (median)"), format!("{:.2}", fsdp_step * 1e3))?;
    row("ratio (goal <= 1.5)".into(), format!("{ratio:.2}x"))?;
    row(
        format!("FSDP host overhead, us/group/step ({} groups)", fsdp["groups"]),
        format!("{:.1}", num(&fsdp, "host_overhead_per_group_per_step_s") * 1e6),
    )?;
    row(
        "adapter host copies and waits, ms/step".into(),
        format!("{:.2}", num(&fsdp, "adapter_transfer_per_step_s") * 1e3),
    )?;
    row(
        "candle compute per rank incl. recompute, ms/step".into(),
        format!("{:.2}", num(&fsdp, "candle_compute_per_step_s") * 1e3),
    )?;
    row(
        "FSDP peak device memory, KiB/rank".into(),
        format!("{:.1}", num(&fsdp, "peak_memory_bytes_per_rank") / 1024.0),
    )?;
    row(
        "plain training state (params+grads+optim), KiB".into(),
        format!("{:.1}", (params * state_per_param) as f64 / 1024.0),
    )?;
    Ok(Outcome::Passed)
}

const GPT_BENCH_WARMUP: u64 = 3;

/// One side of [`bench_gpt`], in this process: its numbers as JSON.
fn bench_gpt_part(args: &TrainArgs, part: BenchPart) -> anyhow::Result<serde_json::Value> {
    let world = args.world();
    let cfg = args.gpt_config();
    let steps = args.steps();
    let corpus = match &args.text {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("--text {}", path.display()))?,
        None => text::generate(200_000, args.seed),
    };
    let data = TextData::new(text::encode(&corpus), cfg.seq_len, args.seed)
        .ok_or_else(|| usage(format!("the text is too short for --seq-len {}", cfg.seq_len)))?;
    let spec = GptSpec {
        config: cfg,
        init: init_params(&cfg, args.seed)?,
        data: Arc::new(data),
        batch: args.batch,
        steps: steps + GPT_BENCH_WARMUP,
        optimizer: args.optimizer(),
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        max_grad_norm: None,
        forward_prefetch: true,
        micro_batches: args.micro_batches,
        checkpoint_dir: None,
        save_every: 0,
        resume: None,
        allow_nonfinite: false,
    };
    let timed = |times: &[f64]| median(&times[(GPT_BENCH_WARMUP as usize).min(times.len())..]);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    Ok(match part {
        BenchPart::Plain => {
            let plain = chorus_train::gpt_train::train_plain(&spec, world)?;
            json!({ "median_step_time_s": timed(&plain.step_times_s), "candle_threads": threads })
        }
        BenchPart::Fsdp => {
            let reports = run_sim(world, GptJob(spec), None)?;
            let r = reports.first().context("no ranks")?;
            let all_steps = r.step_times_s.len().max(1) as f64;
            json!({
                "median_step_time_s": timed(&r.step_times_s),
                "groups": r.groups,
                "host_overhead_per_group_per_step_s": r.overhead.total.as_secs_f64() / (r.groups.max(1) as f64 * all_steps),
                "adapter_transfer_per_step_s": r.adapter.transfer.as_secs_f64() / all_steps,
                "candle_compute_per_step_s": r.adapter.compute.as_secs_f64() / all_steps,
                "peak_memory_bytes_per_rank": reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0),
                "candle_threads": threads,
            })
        }
    })
}

/// `chorus train --bench` on the mlp: FSDP step time and host overhead for world sizes 1, 2, 4, 8.
fn bench_mlp(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let dims = match (&args.dims, args.layers, args.width) {
        (None, None, None) => vec![64; 65],
        _ => args.dims(),
    };
    let warmup = 3;
    let steps = usize::try_from(args.steps()).map_err(|_| usage("--steps is too large"))?;
    if !args.json {
        say(format_args!(
            "# chorus train --bench: MLP {} layers (widths {}..), batch {}/rank, {} timed steps after {warmup}, param dtype {}, backend {} (sim: sanitizer off)",
            dims.len() - 1,
            dims[0],
            args.batch,
            steps,
            args.param_dtype,
            args.backend
        ))?;
        say(format_args!("# overhead = host time inside FSDP's hooks (they only enqueue) / (groups x steps)"))?;
        say(format_args!(
            "{:>6} {:>7} {:>14} {:>22} {:>16}",
            "world", "groups", "step ms (med)", "overhead us/group/step", "peak KiB/rank"
        ))?;
    }
    // The GPU backends take one rank per device, so their worlds stop at the device count.
    let max_world = crate::with_backend!(args.backend, sim => usize::MAX, ucx => {
        anyhow::bail!("train --bench runs worlds of 1, 2, 4 and 8 ranks in this process; ucx runs one rank per process (use chorus bench under chorus launch)")
    }, vendor<L> => {
        <<L as chorus_collectives::vendor::VendorLib>::B as chorus_conformance::vendor::HarnessDevice>::count()
            .map_err(anyhow::Error::msg)?
    });
    for world in [1, 2, 4, 8].into_iter().filter(|w| *w <= max_world) {
        let data = Dataset::random(dims[0], dims[dims.len() - 1], world * args.batch, 4, args.seed);
        let spec = TrainSpec {
            layers: init_layers(&dims, args.seed),
            data: Arc::new(data),
            batch: args.batch,
            steps: steps + warmup,
            optimizer: args.optimizer(),
            fsdp: args.fsdp_config(),
            replicate: None,
            max_grad_norm: None,
            stop_on_nonfinite: false,
        };
        let reports = run_on(args.backend, world, MlpJob(spec), None)?;
        let r = reports.first().context("no ranks")?;
        let timed = &r.step_times_s[warmup.min(r.step_times_s.len())..];
        let step = median(timed);
        let overhead = r.overhead.total.as_secs_f64() / (r.groups * (steps + warmup)) as f64;
        let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
        // Where a step's time goes: each stage's median, and each hook's share of the overhead.
        let per_group_step = (r.groups * (steps + warmup)).max(1) as f64;
        let hooks: Vec<(&str, f64)> = chorus_fsdp::Hook::ALL
            .iter()
            .map(|h| (h.name(), r.overhead.hook(*h).total.as_secs_f64() / per_group_step))
            .filter(|(_, t)| *t > 0.0)
            .collect();
        if args.json {
            say(format_args!(
                "{}",
                json!({"world_size": world, "groups": r.groups, "layers": dims.len() - 1, "width": dims[1],
                       "batch": args.batch, "median_step_time_s": step, "host_overhead_per_group_per_step_s": overhead,
                       "peak_memory_bytes": peak,
                       "stage_median_s": r.stage_times_s.iter().map(|(n, t)| (n.to_string(), json!(t))).collect::<serde_json::Map<_, _>>(),
                       "hook_overhead_per_group_per_step_s": hooks.iter().map(|(n, t)| (n.to_string(), json!(t))).collect::<serde_json::Map<_, _>>()})
            ))?;
        } else {
            say(format_args!(
                "{world:>6} {:>7} {:>14.3} {:>22.2} {:>16.1}",
                r.groups,
                step * 1e3,
                overhead * 1e6,
                peak as f64 / 1024.0
            ))?;
            let stages: Vec<String> = r.stage_times_s.iter().map(|(n, t)| format!("{n} {:.3}", t * 1e3)).collect();
            say(format_args!("#   step stages, ms (median): {}", stages.join(", ")))?;
            let hooks: Vec<String> = hooks.iter().map(|(n, t)| format!("{n} {:.2}", t * 1e6)).collect();
            say(format_args!("#   overhead by hook, us/group/step: {}", hooks.join(", ")))?;
        }
    }
    Ok(Outcome::Passed)
}
