//! The one validation of a job: which model takes which flag, the sizes'
//! bounds, the FSDP policy against the world, the dtypes and the
//! optimizer's settings. Every command that takes a job calls it, so a
//! combination one refuses, every one refuses.

use chorus_devices::DType;
use chorus_fsdp::Reshard;
use chorus_fsdp_candle::Recompute;
use chorus_train::models::llama::config::{Names, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH};
use chorus_train::text;

use super::{JobArgs, ModelArg, OptimizerArg, RecomputeArg};
use crate::usage;

/// The most layers an MLP is given (a layer count lists names per layer).
const MLP_MAX_LAYERS: usize = 1 << 20;
/// The largest batch per rank: far above any run (`chorus train`'s memory
/// check refuses much less), far below an overflow of batch × sequence.
const MAX_BATCH: usize = 1 << 32;

impl JobArgs {
    /// Sets `--batch` from `--global-batch` over `world` ranks (kept, so a
    /// message names the flag the user gave).
    pub fn resolve_batch(&mut self, world: usize) -> anyhow::Result<()> {
        self.batch = self.batch_over(world).map_err(usage)?;
        Ok(())
    }

    /// The per-rank batch as a message names it: `--batch 2`, or
    /// `the batch per rank, 2 (--global-batch 4 over 2 ranks)`.
    fn batch_named(&self, world: usize) -> String {
        match self.global_batch {
            Some(g) => format!("the batch per rank, {} (--global-batch {g} over {world} ranks)", self.batch),
            None => format!("--batch {}", self.batch),
        }
    }

    /// Every check of the job that needs no file, for `world` ranks (the
    /// sizes an `--init-from` directory gives are checked once read, with
    /// [`JobArgs::check_recompute`]).
    pub fn check(&self, world: usize) -> anyhow::Result<()> {
        let model = self.model();
        if self.batch == 0 || self.batch > MAX_BATCH {
            return Err(usage(format!("{} must be in 1..={MAX_BATCH}", self.batch_named(world))));
        }
        if self.experts.is_some() && model != ModelArg::Moe {
            return Err(usage("--experts is for --model moe"));
        }
        self.check_parallelism(world)?;
        self.check_optimizer()?;
        let llama_only = [
            (self.init_from.is_some(), "--init-from"),
            (self.data.is_some(), "--data"),
            (self.kv_heads.is_some(), "--kv-heads"),
            (self.vocab.is_some(), "--vocab"),
            (self.tokenizer.is_some(), "--tokenizer"),
        ];
        if model != ModelArg::Llama {
            if let Some((_, name)) = llama_only.iter().find(|(given, _)| *given) {
                return Err(usage(format!("{name} is for --model llama")));
            }
        }
        self.check_sizes()?;
        match model {
            ModelArg::Mlp => self.check_mlp(),
            ModelArg::Gpt | ModelArg::Moe => self.check_gpt(world),
            ModelArg::Llama => self.check_llama(world),
        }
    }

    /// HSDP's replication and the reshard world against `world`; the dtypes.
    fn check_parallelism(&self, world: usize) -> anyhow::Result<()> {
        let shard_world = match self.hsdp {
            Some(r) if r == 0 || world % r != 0 => {
                return Err(usage(format!("--hsdp {r} must divide the world size ({world})")));
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
        Ok(())
    }

    /// The optimizer's numbers, and the flags of the other optimizer.
    fn check_optimizer(&self) -> anyhow::Result<()> {
        if let Some(lr) = self.lr.filter(|lr| !(lr.is_finite() && *lr >= 0.0)) {
            return Err(usage(format!("--lr {lr} must be a finite number ≥ 0")));
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
        Ok(())
    }

    /// Every model size a flag gives, bounded before anything is computed
    /// or listed from it (a layer count lists names per layer).
    fn check_sizes(&self) -> anyhow::Result<()> {
        let layers_max = if self.model() == ModelArg::Mlp { MLP_MAX_LAYERS } else { MAX_LAYERS };
        for (value, flag, max) in [
            (self.layers, "--layers", layers_max),
            (self.d_model, "--d-model (--hidden)", MAX_WIDTH),
            (self.d_ff, "--d-ff (--intermediate)", MAX_WIDTH),
            (self.heads, "--heads", MAX_HEADS),
            (self.seq_len, "--seq-len", MAX_POSITIONS),
            (self.kv_heads, "--kv-heads", MAX_HEADS),
            (self.vocab, "--vocab", MAX_VOCAB),
        ] {
            if let Some(v) = value.filter(|v| *v > max) {
                return Err(usage(format!("{flag} {v} is more than chorus trains or plans (at most {max})")));
            }
        }
        Ok(())
    }

    /// The MLP's flags: its sizes, and none of the decoders'.
    fn check_mlp(&self) -> anyhow::Result<()> {
        for (given, name) in [
            (self.d_model.is_some(), "--d-model (--hidden)"),
            (self.d_ff.is_some(), "--d-ff (--intermediate)"),
            (self.heads.is_some(), "--heads"),
            (self.seq_len.is_some(), "--seq-len"),
            (self.micro_batches != 1, "--micro-batches"),
            (self.recompute != RecomputeArg::Groups(Recompute::All), "--recompute"),
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
        Ok(())
    }

    /// What the models candle computes share: none of the MLP's flags, and
    /// micro-batches that divide the batch.
    fn check_candle(&self, world: usize) -> anyhow::Result<()> {
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
            return Err(usage(format!(
                "--micro-batches {} must divide {}",
                self.micro_batches,
                self.batch_named(world)
            )));
        }
        Ok(())
    }

    /// The transformer's (and the mixture of experts') sizes and groups.
    fn check_gpt(&self, world: usize) -> anyhow::Result<()> {
        self.check_candle(world)?;
        let cfg = self.gpt_config();
        cfg.validate().map_err(usage)?;
        let experts = match self.model() {
            ModelArg::Moe => {
                let moe = self.moe_config();
                moe.validate().map_err(usage)?;
                moe.experts
            }
            _ => 0,
        };
        self.check_recompute("blocks.", cfg.layers, experts)
    }

    /// The Llama's sizes from the flags, or none where `--init-from` gives them.
    fn check_llama(&self, world: usize) -> anyhow::Result<()> {
        self.check_candle(world)?;
        if self.init_from.is_some() {
            for (given, name) in [
                (self.layers.is_some(), "--layers"),
                (self.heads.is_some(), "--heads"),
                (self.d_model.is_some(), "--d-model (--hidden)"),
                (self.kv_heads.is_some(), "--kv-heads"),
                (self.d_ff.is_some(), "--d-ff (--intermediate)"),
                (self.vocab.is_some(), "--vocab"),
            ] {
                if given {
                    return Err(usage(format!("{name}: the sizes come from --init-from's config.json")));
                }
            }
            return Ok(());
        }
        let cfg = self.llama_config();
        cfg.validate_as(Names::Flags).map_err(|e| usage(format!("the Llama's sizes: {e}")))?;
        let byte_level = self.data.is_none() && self.tokenizer.is_none();
        if byte_level && cfg.vocab_size < text::vocab_size() {
            return Err(usage(format!(
                "--vocab {} is smaller than the byte-level text's {} tokens",
                cfg.vocab_size,
                text::vocab_size()
            )));
        }
        self.check_recompute("model.layers.", cfg.num_hidden_layers, 0)
    }

    /// `--recompute`'s names are among the model's groups: `root` and
    /// `{layer}{i}` for `i < layers`, and `{layer}{i}.experts.{e}` for
    /// `e < experts` (checked by parsing, so a huge `--layers` lists nothing).
    pub fn check_recompute(&self, layer: &str, layers: usize, experts: usize) -> anyhow::Result<()> {
        let RecomputeArg::Groups(Recompute::Groups(names)) = &self.recompute else { return Ok(()) };
        let index = |s: &str, n: usize| s.parse::<usize>().ok().is_some_and(|i| i < n);
        let known = |n: &str| {
            let Some(rest) = n.strip_prefix(layer) else { return n == "root" };
            match rest.split_once(".experts.") {
                Some((i, e)) => index(i, layers) && index(e, experts),
                None => index(rest, layers),
            }
        };
        match names.iter().find(|n| !known(n)) {
            Some(n) => {
                let experts =
                    if experts > 0 { format!(", {layer}{{i}}.experts.0 .. {}", experts - 1) } else { String::new() };
                Err(usage(format!(
                    "--recompute names `{n}`, which is no group (root, {layer}0 .. {layer}{}{experts})",
                    layers.saturating_sub(1)
                )))
            }
            None => Ok(()),
        }
    }
}
