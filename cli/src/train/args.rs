//! The arguments of `chorus train` and every check made before anything is
//! written: ranges, combinations, and the memory the run would need.

use std::path::PathBuf;

use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision, OffloadPolicy, OptimizerKind, Reshard};
use chorus_fsdp_candle::Recompute;
use chorus_train::models::gpt::GptConfig;
use chorus_train::text;

use super::loop_args::LoopArgs;
use super::usage;
use crate::backends::Backend;

/// Why `--bench --model moe` is refused (`gpt_bench.rs` compares gpt and llama with plain candle).
pub(super) const NO_MOE_BENCH: &str = "--bench measures --model mlp, gpt and llama, not moe";

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
    /// A Hugging Face Llama (LlamaForCausalLM) through the candle adapter, HF weights in and out.
    Llama,
    /// The transformer with a mixture of experts (top-1 routing, --experts) as each MLP, each expert a routed group.
    Moe,
}

/// Arguments of `chorus train`.
#[derive(Clone, Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// The model (default gpt; --bench measures the mlp).
    #[arg(long, value_enum)]
    pub model: Option<ModelArg>,
    /// The communication backend: sim or simnccl (ranks as threads of this process), ucx (one rank per process
    /// under a launcher), nccl or rccl (one rank per GPU); ucx, nccl and rccl in builds with those features.
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
    /// Rows (mlp) or sequences (gpt, llama) per rank per step.
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
    /// Dtype parameters travel in on the all-gather: `float8` (e4m3, torchao's float8 all-gather of
    /// the matrices with both dims >= 16, dequantized to the param dtype after the gather) or the
    /// param dtype (the default). Compute stays in the param dtype.
    #[arg(long, value_parser = parse_all_gather_dtype)]
    pub all_gather_dtype: Option<DType>,
    /// true, false, or a smaller world size that divides the shard world.
    #[arg(long, default_value = "true")]
    pub reshard_after_forward: Reshard,
    /// mlp: layer widths, e.g. 37,64,33,5 (instead of --layers/--width; default 16,64,64,4).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["layers", "width"])]
    pub dims: Option<Vec<usize>>,
    /// mlp: number of Linear layers (with --width); gpt: transformer blocks; llama without --init-from: decoder
    /// layers (default 2).
    #[arg(long)]
    pub layers: Option<usize>,
    /// mlp: width of every layer (with --layers).
    #[arg(long)]
    pub width: Option<usize>,
    /// gpt: width of the residual stream (default 64).
    #[arg(long)]
    pub d_model: Option<usize>,
    /// gpt: attention heads (they divide --d-model); llama without --init-from: query heads (default 4).
    #[arg(long)]
    pub heads: Option<usize>,
    /// gpt: width of the MLP's hidden layer (default 4 × --d-model).
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// moe: experts per layer (default 4, at most 256; --d-ff is each expert's hidden width).
    #[arg(long)]
    pub experts: Option<usize>,
    /// gpt, llama: context length (default 32; with --data the file's rows give it).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// gpt, llama: train on this text file instead of generated text (UTF-8, or else read as Latin-1; characters
    /// other than a-z, A-Z, space, '.' and newline become spaces).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// gpt and llama: which groups recompute their blocks in backward (activation checkpointing): true, false, or a
    /// comma-separated list of the groups that do (gpt: root, blocks.0, ...; llama: root, model.layers.0, ...); the others keep their forward
    /// graphs (a forward less per group and step, their activations and parameters held until backward).
    #[arg(long, default_value = "true")]
    pub recompute: Recompute,
    /// gpt, llama: micro-batches per step (gradient accumulation; they divide --batch).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// gpt, llama: save a sharded checkpoint every N steps (and at the end).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// gpt, llama: where checkpoints go (default <out-dir>-checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// gpt, llama: keep only the newest N checkpoints (never the one `latest` names nor the one resumed from).
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// gpt, llama: resume from a checkpoint directory (a step-* directory, or one with a `latest` file).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// gpt, llama: start over in a --checkpoint-dir that holds another run's checkpoints, removing them (without
    /// it, a run that does not --resume from there is refused).
    #[arg(long)]
    pub overwrite_checkpoints: bool,
    /// gpt, llama: with --resume, continue with other optimizer settings (--lr, --momentum, --weight-decay) than the checkpoint's; the changes are reported.
    #[arg(long)]
    pub allow_optimizer_change: bool,
    /// Keep training when the loss is NaN or infinite (default: stop with an error).
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// CPU offload (FSDP2's CPUOffloadPolicy): sharded parameters, gradients
    /// and optimizer state in host memory (pinned where the device has it).
    #[arg(long)]
    pub offload: bool,
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
    /// Where the results go (default out/train): what an earlier run wrote there is replaced when the run
    /// succeeds; a directory holding anything else is refused.
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
    /// gpt, llama: one device's peak in TFLOP/s for MFU (default: known for H100, H200 and A100 GPUs; none for
    /// the CPU, whose MFU is then not given).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// gpt, moe, llama: time each kind of fused op (RMSNorm, RoPE, SwiGLU, attention, cross-entropy; forward and
    /// backward) in every step of rank 0: device time on the GPU (CUDA events), wall time on the CPU; into
    /// summary.json (`op_times`) and a line after the closing one. Off by default.
    #[arg(long)]
    pub op_times: bool,
    /// A job file (TOML) setting any of these flags by its long name (`steps = 100`, `world_size = 4`, at the top
    /// level or in tables); the command line wins. Every run writes its flags as config.toml in --out-dir.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The effective configuration (not a flag): set by `job::resolve`.
    #[arg(skip)]
    pub(super) effective: Option<super::job::Effective>,
    #[command(flatten)]
    pub llama: LlamaArgs,
    #[command(flatten)]
    pub decoder: LoopArgs,
}

/// The arguments of `chorus train --model llama` (the shared ones, --layers,
/// --heads, --seq-len, --text, --batch, ..., are [`TrainArgs`]').
#[derive(Clone, Debug, Default, clap::Args)]
pub struct LlamaArgs {
    /// llama: start from this Hugging Face model directory (config.json and model.safetensors, or
    /// model-0000i-of-0000N.safetensors with model.safetensors.index.json; f32, bf16 or f16), each rank
    /// reading only its shards; the sizes come from its config.json.
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// llama: token ids as .npy [N, seq_len + 1] (uint16, uint32, int32 or int64; `chorus tokenize` writes them); at step s the global batch is
    /// rows (s·W·B + k) mod N, rank r taking rows [r·B, (r+1)·B) of it.
    #[arg(long, conflicts_with = "text")]
    pub data: Option<PathBuf>,
    /// llama: dtype of the Hugging Face model written at the end (f32 or bf16).
    #[arg(long, value_enum, default_value = "f32")]
    pub save_dtype: SaveDtypeArg,
    /// llama: start a new safetensors file when one would pass this size (K/M/G = 1024-based, or plain bytes).
    #[arg(long, default_value = "2G", value_parser = crate::size::parse_nonzero_bytes)]
    pub max_file_bytes: u64,
    /// llama without --init-from: width of the residual stream (default 64).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// llama without --init-from: key/value heads (they divide --heads; default 2).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// llama without --init-from: width of the SwiGLU MLP (default 2 × --hidden).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// llama without --init-from: vocabulary size (default: the --tokenizer's; else 256 with --data, else the
    /// byte-level text's).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// llama: a Hugging Face tokenizer.json: --text is tokenized with it in memory (at most 256 MiB; documents
    /// separated by blank lines and joined with its end-of-text token, as `chorus tokenize` does), and the model
    /// directory written carries it (tokenizer.json, tokenizer_config.json, generation_config.json).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// Dtypes `chorus train --model llama` writes the model in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SaveDtypeArg {
    /// float32.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
}

impl SaveDtypeArg {
    pub(crate) fn dtype(self) -> chorus_train::models::llama::hf::SaveDtype {
        match self {
            SaveDtypeArg::F32 => chorus_train::models::llama::hf::SaveDtype::F32,
            SaveDtypeArg::Bf16 => chorus_train::models::llama::hf::SaveDtype::BF16,
        }
    }
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
    match s.parse::<DType>() {
        Ok(d @ (DType::F32 | DType::BF16 | DType::F16)) => Ok(d),
        _ if is_float8_name(s) => Err(format!(
            "`{s}` is not a compute dtype; float8 is --all-gather-dtype float8 (compute stays f32/bf16/f16)"
        )),
        // Only the dtypes training takes: the parser's own list has integer and f64 ones too.
        _ => Err(format!("`{s}` is not a training dtype: f32, bf16 or f16")),
    }
}

/// The names `--all-gather-dtype` takes for float8 e4m3.
fn is_float8_name(s: &str) -> bool {
    matches!(s, "float8" | "f8e4m3")
}

pub(crate) fn parse_all_gather_dtype(s: &str) -> Result<DType, String> {
    match s {
        _ if is_float8_name(s) => Ok(DType::F8E4M3),
        _ => parse_float_dtype(s).map_err(|_| format!("`{s}` is not an all-gather dtype: float8, f32, bf16 or f16")),
    }
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
    /// These arguments with `--global-batch` turned into the `--batch` it
    /// gives (`None` without it: they are as they are).
    pub(super) fn with_global_batch(&self) -> anyhow::Result<Option<TrainArgs>> {
        Ok(self.decoder.batch_of_global(self.world())?.map(|batch| TrainArgs { batch, ..self.clone() }))
    }

    pub(super) fn model(&self) -> ModelArg {
        self.model.unwrap_or(if self.bench { ModelArg::Mlp } else { ModelArg::Gpt })
    }
    pub(super) fn world(&self) -> usize {
        self.world_size.unwrap_or(4)
    }
    pub(super) fn steps(&self) -> u64 {
        self.steps.unwrap_or(match self.model() {
            ModelArg::Gpt | ModelArg::Llama | ModelArg::Moe if self.bench => 20,
            ModelArg::Gpt | ModelArg::Llama | ModelArg::Moe => 300,
            ModelArg::Mlp => 50,
        })
    }
    pub(super) fn out_dir(&self) -> PathBuf {
        self.out_dir.clone().unwrap_or_else(|| PathBuf::from("out/train"))
    }
    pub(super) fn optimizer_arg(&self) -> OptimizerArg {
        self.optimizer.unwrap_or(match self.model() {
            ModelArg::Gpt | ModelArg::Llama | ModelArg::Moe => OptimizerArg::Adamw,
            ModelArg::Mlp => OptimizerArg::Sgd,
        })
    }

    /// Every check that needs no file: ranges, combinations, the memory the run needs.
    pub(super) fn usage(&self) -> anyhow::Result<()> {
        let model = self.model();
        let world = self.world();
        if world == 0 || self.batch == 0 {
            return Err(usage("--world-size and --batch must be at least 1"));
        }
        if self.steps() == 0 {
            return Err(usage("--steps must be at least 1"));
        }
        if !self.backend.runs_as_processes() {
            crate::backends::check_thread_world(self.backend, world).map_err(usage)?;
        }
        crate::backends::check_not_one_of_many(self.backend).map_err(usage)?;
        if self.bench && model == ModelArg::Moe {
            return Err(usage(NO_MOE_BENCH));
        }
        if self.experts.is_some() && model != ModelArg::Moe {
            return Err(usage("--experts is for --model moe"));
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
                (self.keep_last.is_some(), "--keep-last"),
                (self.overwrite_checkpoints, "--overwrite-checkpoints"),
                (self.allow_optimizer_change, "--allow-optimizer-change"),
                (
                    !mlp && self.param_dtype != DType::F32,
                    "--param-dtype with --model gpt|llama (plain candle trains in f32)",
                ),
                (!mlp && self.max_grad_norm.is_some(), "--max-grad-norm with --model gpt|llama"),
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
        if let Some(d) = self.all_gather_dtype.filter(|d| *d != DType::F8E4M3 && *d != self.param_dtype) {
            return Err(usage(format!(
                "--all-gather-dtype {d} must be float8 or the param dtype ({})",
                self.param_dtype
            )));
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
        self.decoder.usage(model, self.steps(), self.optimizer().lr(), self.llama.data.is_some())?;
        let llama_only = [
            (self.llama.hidden.is_some(), "--hidden"),
            (self.llama.init_from.is_some(), "--init-from"),
            (self.llama.data.is_some(), "--data"),
            (self.llama.save_dtype != SaveDtypeArg::F32, "--save-dtype"),
            (self.llama.kv_heads.is_some(), "--kv-heads"),
            (self.llama.intermediate.is_some(), "--intermediate"),
            (self.llama.vocab.is_some(), "--vocab"),
            (self.llama.tokenizer.is_some(), "--tokenizer"),
        ];
        if model != ModelArg::Llama {
            if let Some((_, name)) = llama_only.iter().find(|(given, _)| *given) {
                return Err(usage(format!("{name} is for --model llama")));
            }
        }
        // The other model's sizes would be ignored without a word.
        let gpt_only = [(self.d_model.is_some(), "--d-model"), (self.d_ff.is_some(), "--d-ff")];
        if !matches!(model, ModelArg::Gpt | ModelArg::Moe) {
            if let Some((_, name)) = gpt_only.iter().find(|(given, _)| *given) {
                let instead =
                    if model == ModelArg::Llama { " (the Llama's are --hidden and --intermediate)" } else { "" };
                return Err(usage(format!("{name} is for --model gpt{instead}")));
            }
        }
        self.check_sizes()?;
        match model {
            ModelArg::Mlp => self.usage_mlp(world),
            ModelArg::Gpt | ModelArg::Moe => self.usage_gpt(world),
            ModelArg::Llama => self.usage_llama(world),
        }
    }

    pub(super) fn usage_mlp(&self, world: usize) -> anyhow::Result<()> {
        for (given, name) in [
            (self.text.is_some(), "--text"),
            (self.heads.is_some(), "--heads"),
            (self.seq_len.is_some(), "--seq-len"),
            (self.save_every.is_some(), "--save-every"),
            (self.checkpoint_dir.is_some(), "--checkpoint-dir"),
            (self.resume.is_some(), "--resume"),
            (self.keep_last.is_some(), "--keep-last"),
            (self.overwrite_checkpoints, "--overwrite-checkpoints"),
            (self.allow_optimizer_change, "--allow-optimizer-change"),
            (self.micro_batches != 1, "--micro-batches"),
            (self.recompute != Recompute::All, "--recompute"),
        ] {
            if given {
                return Err(usage(format!("{name} is for --model gpt and llama")));
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

    /// The context length: `--seq-len`, or 32.
    pub(super) fn seq_len(&self) -> usize {
        self.seq_len.unwrap_or(32)
    }

    /// Attention heads: `--heads`, or 4.
    fn heads(&self) -> usize {
        self.heads.unwrap_or(4)
    }

    pub(super) fn gpt_config(&self) -> GptConfig {
        let d_model = self.d_model.unwrap_or(64);
        GptConfig {
            vocab: text::vocab_size(),
            d_model,
            layers: self.layers.unwrap_or(2),
            heads: self.heads(),
            d_ff: self.d_ff.unwrap_or(d_model.saturating_mul(4)),
            seq_len: self.seq_len(),
        }
    }

    /// The mixture-of-experts transformer's sizes from the flags.
    pub(super) fn moe_config(&self) -> chorus_train::models::moe::MoeConfig {
        chorus_train::models::moe::MoeConfig { base: self.gpt_config(), experts: self.experts.unwrap_or(4) }
    }

    /// Every model size a flag gives, bounded before anything is computed
    /// or listed from it (a layer count lists names per layer; the memory
    /// check comes after).
    fn check_sizes(&self) -> anyhow::Result<()> {
        use chorus_train::models::llama::config::{MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH};
        let mlp = self.model() == ModelArg::Mlp;
        let layers_max = if mlp { 1 << 20 } else { MAX_LAYERS };
        for (value, flag, max) in [
            (self.layers, "--layers", layers_max),
            (self.d_model, "--d-model", MAX_WIDTH),
            (self.d_ff, "--d-ff", MAX_WIDTH),
            (self.heads, "--heads", MAX_HEADS),
            (self.seq_len, "--seq-len", MAX_POSITIONS),
            (self.llama.hidden, "--hidden", MAX_WIDTH),
            (self.llama.intermediate, "--intermediate", MAX_WIDTH),
            (self.llama.kv_heads, "--kv-heads", MAX_HEADS),
            (self.llama.vocab, "--vocab", MAX_VOCAB),
        ] {
            if let Some(v) = value.filter(|v| *v > max) {
                return Err(usage(format!("{flag} {v} is more than this tool trains (at most {max})")));
            }
        }
        Ok(())
    }

    /// The Llama's sizes from the flags (without --init-from).
    pub(super) fn llama_config(&self) -> chorus_train::models::llama::config::LlamaConfig {
        let l = &self.llama;
        let vocab = l.vocab.unwrap_or(if l.data.is_some() { 256 } else { text::vocab_size() });
        let hidden = l.hidden.unwrap_or(64);
        chorus_train::models::llama::config::LlamaConfig::new(
            vocab,
            hidden,
            l.intermediate.unwrap_or(hidden.saturating_mul(2)),
            self.layers.unwrap_or(2),
            self.heads(),
            l.kv_heads.unwrap_or(2.min(self.heads())),
        )
    }

    /// The checks of `--model llama` that need no file (the model directory
    /// and the data are checked once read, before anything is written).
    pub(super) fn usage_llama(&self, world: usize) -> anyhow::Result<()> {
        self.usage_candle_model("llama")?;
        if self.llama.init_from.is_none() {
            let cfg = self.llama_config();
            cfg.validate_as(chorus_train::models::llama::config::Names::Flags)
                .map_err(|e| usage(format!("the Llama's sizes: {e}")))?;
            let byte_level = self.llama.data.is_none() && self.llama.tokenizer.is_none();
            if byte_level && cfg.vocab_size < text::vocab_size() {
                return Err(usage(format!(
                    "--vocab {} is smaller than the byte-level text's {} tokens",
                    cfg.vocab_size,
                    text::vocab_size()
                )));
            }
            let seq = if self.llama.data.is_some() { 1 } else { self.seq_len() };
            self.check_llama_memory(&cfg, world, seq)?;
        } else {
            for (given, name) in [
                (self.layers.is_some(), "--layers"),
                (self.heads.is_some(), "--heads"),
                (self.llama.hidden.is_some(), "--hidden"),
                (self.llama.kv_heads.is_some(), "--kv-heads"),
                (self.llama.intermediate.is_some(), "--intermediate"),
                (self.llama.vocab.is_some(), "--vocab"),
            ] {
                if given {
                    return Err(usage(format!("{name}: the sizes come from --init-from's config.json")));
                }
            }
        }
        Ok(())
    }

    /// The memory a Llama run needs (every rank's share of the model, its
    /// optimizer state, the gathered groups and the activations), checked
    /// against the machine's.
    pub(super) fn check_llama_memory(
        &self,
        cfg: &chorus_train::models::llama::config::LlamaConfig,
        world: usize,
        seq_len: usize,
    ) -> anyhow::Result<()> {
        let params = Sat::of(cfg.num_params());
        let (v, h, l, f) = (
            Sat::of(cfg.vocab_size),
            Sat::of(cfg.hidden_size),
            Sat::of(cfg.num_hidden_layers),
            Sat::of(cfg.intermediate_size),
        );
        let tokens = Sat::of(self.batch) * Sat::of(seq_len);
        let heads = Sat::of(cfg.num_attention_heads);
        let t = Sat::of(seq_len);
        let activations = Sat(4) * tokens * (l + Sat(2)) * (Sat(10) * h + Sat(4) * f + Sat(3) * heads * t + Sat(3) * v);
        let per_rank = Sat(4) * (Sat(4) * params / Sat::of(world) + Sat(3) * params)
            + activations
            + Sat(16) * Sat::of(self.steps());
        self.check_memory((Sat::of(world) * per_rank + Sat(4 << 20)).0)
    }

    /// What --model gpt and --model llama (both candle through the adapter) share.
    /// `--recompute`'s names are among the model's groups: `root` and
    /// `{layer}{i}` for `i < layers`, and `{layer}{i}.experts.{e}` for
    /// `e < experts` (checked by parsing, so a huge `--layers` lists nothing).
    pub(super) fn check_recompute(&self, layer: &str, layers: usize, experts: usize) -> anyhow::Result<()> {
        if let Recompute::Groups(names) = &self.recompute {
            let index = |s: &str, n: usize| s.parse::<usize>().ok().is_some_and(|i| i < n);
            let known = |n: &str| {
                let Some(rest) = n.strip_prefix(layer) else { return n == "root" };
                match rest.split_once(".experts.") {
                    Some((i, e)) => index(i, layers) && index(e, experts),
                    None => index(rest, layers),
                }
            };
            if let Some(n) = names.iter().find(|n| !known(n)) {
                let experts =
                    if experts > 0 { format!(", {layer}{{i}}.experts.0 .. {}", experts - 1) } else { String::new() };
                return Err(usage(format!(
                    "--recompute names `{n}`, which is no group (root, {layer}0 .. {layer}{}{experts})",
                    layers.saturating_sub(1)
                )));
            }
        }
        Ok(())
    }

    fn usage_candle_model(&self, model: &str) -> anyhow::Result<()> {
        // On nccl the stages compute on candle's CUDA device (feature
        // `candle-cuda`); without it, or on rccl, candle would compute on the
        // CPU with every group crossing PCIe twice a step.
        let on_gpu = matches!(self.backend.name(), "nccl" | "rccl");
        if on_gpu && !(cfg!(feature = "candle-cuda") && self.backend.name() == "nccl") {
            return Err(usage(format!(
                "--model {model} computes with candle on the CPU in this build, so it runs on backends whose device holds host memory (sim, simnccl, ucx), not {}; use --model mlp, or (nccl) a build with the candle-cuda feature (README, \"candle on CUDA\")",
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
        if self.micro_batches == 0 || self.batch % self.micro_batches != 0 {
            return Err(usage(format!("--micro-batches {} must divide --batch {}", self.micro_batches, self.batch)));
        }
        if self.save_every == Some(0) {
            return Err(usage("--save-every must be at least 1"));
        }
        match self.keep_last {
            Some(0) => return Err(usage("--keep-last must be at least 1")),
            Some(_) if self.save_every.is_none() && self.checkpoint_dir.is_none() => {
                return Err(usage("--keep-last goes with --save-every or --checkpoint-dir"))
            }
            _ => {}
        }
        if self.allow_optimizer_change && self.resume.is_none() {
            return Err(usage("--allow-optimizer-change goes with --resume"));
        }
        Ok(())
    }

    /// The checks of `--model gpt` and `--model moe` (the transformer, its
    /// MLPs a mixture of `--experts` for moe).
    pub(super) fn usage_gpt(&self, world: usize) -> anyhow::Result<()> {
        let moe = self.model() == ModelArg::Moe;
        self.usage_candle_model(if moe { "moe" } else { "gpt" })?;
        let cfg = self.gpt_config();
        cfg.validate().map_err(usage)?;
        let experts = if moe {
            self.moe_config().validate().map_err(usage)?;
            self.moe_config().experts
        } else {
            1
        };
        self.check_recompute("blocks.", cfg.layers, if moe { experts } else { 0 })?;
        let (v, d, l, f, t) =
            (Sat::of(cfg.vocab), Sat::of(cfg.d_model), Sat::of(cfg.layers), Sat::of(cfg.d_ff), Sat::of(cfg.seq_len));
        // moe: the router (experts × d) and each expert's MLP; the front and combine stages' outputs.
        let (e, router) = (Sat::of(experts), if moe { Sat::of(experts) * d } else { Sat(0) });
        let params = Sat(2) * v * d + d + l * (Sat(4) * d * d + e * Sat(2) * d * f + Sat(2) * d + router);
        let tokens = Sat::of(self.batch) * t;
        let heads = Sat::of(cfg.heads);
        let routing = if moe { Sat(6) * d + Sat(2) * e } else { Sat(0) };
        let activations =
            Sat(4) * tokens * (l + Sat(2)) * (Sat(8) * d + Sat(2) * f + Sat(3) * heads * t + Sat(3) * v + routing);
        // Groups that keep their graphs hold candle's copy of their parameters until backward.
        let kept = if self.recompute == Recompute::All { Sat(0) } else { Sat(4) * params };
        let per_rank = Sat(4) * (Sat(4) * params / Sat::of(world) + Sat(4) * params)
            + kept
            + activations
            + Sat(16) * Sat::of(self.steps());
        self.check_memory((Sat::of(world) * per_rank + Sat(4 << 20)).0)
    }

    pub(super) fn check_memory(&self, needed: u128) -> anyhow::Result<()> {
        crate::size::check_memory(needed, "this run", "make the model, batch, world or --steps smaller")
            .map_err(usage)?;
        if self.backend.runs_as_processes() {
            return Ok(());
        }
        super::ranks::check_thread_limits(self.world(), needed).map_err(usage)
    }

    pub(super) fn optimizer(&self) -> OptimizerKind {
        match self.optimizer_arg() {
            OptimizerArg::Sgd => OptimizerKind::Sgd {
                lr: self.lr.unwrap_or(0.05),
                momentum: self.momentum,
                dampening: 0.0,
                weight_decay: self.weight_decay.unwrap_or(0.0),
                nesterov: false,
            },
            OptimizerArg::Adamw => {
                let default_lr = if matches!(self.model(), ModelArg::Gpt | ModelArg::Moe) { 3e-3 } else { 1e-3 };
                OptimizerKind::adamw(self.lr.unwrap_or(default_lr), self.weight_decay.unwrap_or(0.01))
            }
        }
    }

    pub(super) fn fsdp_config(&self) -> FsdpConfig {
        FsdpConfig {
            reshard_after_forward: self.reshard_after_forward,
            mixed_precision: MixedPrecision {
                param_dtype: Some(self.param_dtype),
                reduce_dtype: self.reduce_dtype,
                output_dtype: None,
                all_gather_dtype: self.all_gather_dtype,
            },
            replicate_below: self.replicate_below,
            offload: self.offload.then(OffloadPolicy::default),
            ..FsdpConfig::default()
        }
    }

    pub(super) fn dims(&self) -> Vec<usize> {
        match (&self.dims, self.layers, self.width) {
            (Some(d), _, _) => d.clone(),
            (None, Some(l), Some(w)) => vec![w; l + 1],
            _ => vec![16, 64, 64, 4],
        }
    }

    pub(super) fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir.clone().unwrap_or_else(|| {
            let out = self.out_dir();
            let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "train".into());
            out.with_file_name(format!("{name}-checkpoints"))
        })
    }
}
