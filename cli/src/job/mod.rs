//! A training job, defined once: the model and its sizes, the data's shape,
//! the FSDP policy, the optimizer and the dtypes. `chorus train` runs it
//! (and `--bench` measures it), `chorus plan` predicts it: the same flags,
//! names, values and defaults ([`JobArgs`]), one validation
//! ([`JobArgs::check`], in `check.rs`), and one job file (`file.rs`:
//! `--config` reads the `config.toml` every `chorus train` writes).
//!
//! What only a command has stays with it: the backend, the steps, the
//! checkpoints and the outputs with `chorus train`; the GPUs and their cost
//! models with `chorus plan`.

mod check;
pub(crate) mod file;

use std::path::PathBuf;

use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision, OffloadPolicy, OptimizerKind, Reshard};
use chorus_fsdp_candle::Recompute;
use chorus_train::models::gpt::GptConfig;
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::moe::MoeConfig;
use chorus_train::text;

/// The models a job trains.
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

/// The optimizers a job steps with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerArg {
    /// SGD (PyTorch semantics; --momentum).
    Sgd,
    /// AdamW (PyTorch semantics; --weight-decay).
    Adamw,
}

/// `--recompute`: which groups recompute their blocks in backward
/// (activation checkpointing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecomputeArg {
    /// Whole groups, as `chorus train` runs them: every group (`true`, or
    /// `full`), none (`false`, or `none`), or the groups named.
    Groups(Recompute),
    /// torchtitan's op-level selective checkpointing (`selective`): a
    /// policy `chorus plan` prices for PyTorch's kernels; `chorus train`
    /// recomputes whole groups and refuses it.
    Selective,
}

impl std::str::FromStr for RecomputeArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "selective" => Ok(RecomputeArg::Selective),
            "full" => Ok(RecomputeArg::Groups(Recompute::All)),
            "none" => Ok(RecomputeArg::Groups(Recompute::Nothing)),
            groups => groups.parse().map(RecomputeArg::Groups),
        }
    }
}

impl std::fmt::Display for RecomputeArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecomputeArg::Groups(r) => r.fmt(f),
            RecomputeArg::Selective => f.write_str("selective"),
        }
    }
}

/// The flags that define a training job, with their defaults (several
/// depend on the model; the methods below give them).
#[derive(Clone, Debug, clap::Args)]
pub struct JobArgs {
    /// The model (default gpt; `chorus train --bench` measures the mlp by default).
    #[arg(long, value_enum)]
    pub model: Option<ModelArg>,
    /// Number of ranks (default: under a launcher with ucx, nccl or rccl, the launcher's WORLD_SIZE; otherwise 4).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// HSDP: replicate over this many groups (it must divide the world size).
    #[arg(long)]
    pub hsdp: Option<usize>,

    /// Rows (mlp) or sequences (gpt, llama) per rank per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Sequences per step over all ranks, instead of --batch (per rank): --batch = G / world size.
    #[arg(long, conflicts_with = "batch")]
    pub global_batch: Option<usize>,
    /// gpt, llama: micro-batches per step (gradient accumulation; they divide --batch).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// gpt, llama: context length (default 32; with --data the file's rows give it).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// llama: token ids as .npy [N, seq_len + 1] (uint16, uint32, int32 or int64; `chorus tokenize` writes them); at step s the global batch is
    /// rows (s·W·B + k) mod N, rank r taking rows [r·B, (r+1)·B) of it.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// llama: a Hugging Face tokenizer.json: --text is tokenized with it in memory (at most 256 MiB; documents
    /// separated by blank lines and joined with its end-of-text token, as `chorus tokenize` does), and the model
    /// directory written carries it (tokenizer.json, tokenizer_config.json, generation_config.json).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,

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
    /// mlp: directory with layers.{i}.weight.npy / layers.{i}.bias.npy and x.npy / y.npy (float32).
    #[arg(long)]
    pub init_dir: Option<PathBuf>,
    /// gpt, llama: width of the residual stream (default 64; the Llama's hidden_size).
    #[arg(long, visible_alias = "hidden")]
    pub d_model: Option<usize>,
    /// gpt: attention heads (they divide --d-model); llama without --init-from: query heads (default 4).
    #[arg(long)]
    pub heads: Option<usize>,
    /// llama without --init-from: key/value heads (they divide --heads; default 2, at most --heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// gpt, llama: width of the MLP's hidden layer (default 4 × --d-model for gpt, 2 × for llama; the Llama's
    /// intermediate_size).
    #[arg(long, visible_alias = "intermediate")]
    pub d_ff: Option<usize>,
    /// llama without --init-from: vocabulary size (default: the --tokenizer's; else 256 with --data, else the
    /// byte-level text's; gpt's is always the byte-level text's).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// moe: experts per layer (default 4, at most 256; --d-ff is each expert's hidden width).
    #[arg(long)]
    pub experts: Option<usize>,
    /// llama: start from this Hugging Face model directory (config.json and model.safetensors, or
    /// model-0000i-of-0000N.safetensors with model.safetensors.index.json; f32, bf16 or f16), each rank
    /// reading only its shards; the sizes come from its config.json.
    #[arg(long)]
    pub init_from: Option<PathBuf>,

    /// true, false, or a smaller world size that divides the shard world.
    #[arg(long, default_value = "true")]
    pub reshard_after_forward: Reshard,
    /// gpt and llama: which groups recompute their blocks in backward (activation checkpointing): true (or full),
    /// false (or none), or a comma-separated list of the groups that do (gpt: root, blocks.0, ...; llama: root,
    /// model.layers.0, ...); the others keep their forward graphs (a forward less per group and step, their
    /// activations and parameters held until backward). `selective` is torchtitan's op-level policy, which only
    /// chorus plan prices.
    #[arg(long, default_value = "true")]
    pub recompute: RecomputeArg,
    /// CPU offload (FSDP2's CPUOffloadPolicy): sharded parameters, gradients
    /// and optimizer state in host memory (pinned where the device has it).
    #[arg(long)]
    pub offload: bool,
    /// mlp: parameters with fewer elements than this are replicated, not sharded.
    #[arg(long, default_value_t = 0)]
    pub replicate_below: usize,

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

    /// The optimizer (default adamw for gpt, moe and llama, sgd for mlp).
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerArg>,
    /// Learning rate (default 0.05 for SGD; AdamW 3e-3 for gpt and moe, 1e-3 for llama and mlp).
    #[arg(long)]
    pub lr: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// Weight decay (default 0.01 for AdamW, 0 for SGD).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm to this.
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
}

/// A compute dtype: f32, bf16 or f16.
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

/// An all-gather dtype: float8 (e4m3) or a compute dtype.
fn parse_all_gather_dtype(s: &str) -> Result<DType, String> {
    match s {
        _ if is_float8_name(s) => Ok(DType::F8E4M3),
        _ => parse_float_dtype(s).map_err(|_| format!("`{s}` is not an all-gather dtype: float8, f32, bf16 or f16")),
    }
}

impl JobArgs {
    /// `--model`, or the transformer.
    pub fn model(&self) -> ModelArg {
        self.model.unwrap_or(ModelArg::Gpt)
    }

    /// `--world-size`, or 4.
    pub fn world(&self) -> usize {
        self.world_size.unwrap_or(4)
    }

    /// The per-rank batch `--global-batch` gives over `world` ranks (every
    /// rank is a data-parallel rank, under HSDP too), else `--batch`.
    pub fn batch_over(&self, world: usize) -> Result<usize, String> {
        match self.global_batch {
            Some(g) if g == 0 || world == 0 || g % world != 0 => {
                Err(format!("--global-batch {g} must be a positive multiple of the world size {world}"))
            }
            Some(g) => Ok(g / world),
            None => Ok(self.batch),
        }
    }

    /// The context length: `--seq-len`, or 32.
    pub fn seq_len(&self) -> usize {
        self.seq_len.unwrap_or(32)
    }

    /// Attention heads: `--heads`, or 4.
    fn heads(&self) -> usize {
        self.heads.unwrap_or(4)
    }

    /// `--optimizer`, or the model's default.
    pub fn optimizer_arg(&self) -> OptimizerArg {
        self.optimizer.unwrap_or(match self.model() {
            ModelArg::Gpt | ModelArg::Llama | ModelArg::Moe => OptimizerArg::Adamw,
            ModelArg::Mlp => OptimizerArg::Sgd,
        })
    }

    /// The optimizer and its settings, the defaults filled in.
    pub fn optimizer(&self) -> OptimizerKind {
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

    /// FSDP's configuration: resharding, the dtypes, replication, offload.
    pub fn fsdp_config(&self) -> FsdpConfig {
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

    /// The groups that recompute, as `chorus train` runs them (`None` for
    /// `selective`, which it does not).
    pub fn recompute_groups(&self) -> Option<&Recompute> {
        match &self.recompute {
            RecomputeArg::Groups(r) => Some(r),
            RecomputeArg::Selective => None,
        }
    }

    /// The MLP's layer widths.
    pub fn dims(&self) -> Vec<usize> {
        match (&self.dims, self.layers, self.width) {
            (Some(d), _, _) => d.clone(),
            (None, Some(l), Some(w)) => vec![w; l + 1],
            _ => vec![16, 64, 64, 4],
        }
    }

    /// The transformer's sizes (its vocabulary the byte-level text's).
    pub fn gpt_config(&self) -> GptConfig {
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

    /// The mixture-of-experts transformer's sizes.
    pub fn moe_config(&self) -> MoeConfig {
        MoeConfig { base: self.gpt_config(), experts: self.experts.unwrap_or(4) }
    }

    /// The Llama's sizes from the flags (without `--init-from`; a
    /// `--tokenizer`'s vocabulary is set where it is read).
    pub fn llama_config(&self) -> LlamaConfig {
        let vocab = self.vocab.unwrap_or(if self.data.is_some() { 256 } else { text::vocab_size() });
        let hidden = self.d_model.unwrap_or(64);
        LlamaConfig::new(
            vocab,
            hidden,
            self.d_ff.unwrap_or(hidden.saturating_mul(2)),
            self.layers.unwrap_or(2),
            self.heads(),
            self.kv_heads.unwrap_or(2.min(self.heads())),
        )
    }
}
