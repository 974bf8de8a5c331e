//! The arguments of the decoder models' training loop (`--model gpt` and
//! `llama`) beyond the job ([`crate::job`]): the lr schedule, validation and
//! the closing sample; and their checks.

use std::path::PathBuf;

use chorus_train::schedule::{Decay, Schedule};

use crate::job::ModelArg;
use crate::usage;

/// The rows `--val-batches` gives when it is left out (or fewer, where the
/// validation data holds fewer global batches).
pub(super) const DEFAULT_VAL_BATCHES: usize = 4;

/// Arguments of the decoder models' training loop.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct LoopArgs {
    /// gpt, llama: steps of linear warmup (the lr of step s is lr·(s+1)/(W+1)), as torchtitan's schedule.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// gpt, llama: after the warmup, the lr falls to --min-lr over the remaining steps: none, linear or cosine.
    #[arg(long, default_value = "none", value_parser = parse_decay)]
    pub lr_decay: Decay,
    /// gpt, llama: the lr --lr-decay ends at (absolute, at most --lr).
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// llama: validation token ids as .npy, the format of --data.
    #[arg(long, conflicts_with = "val_fraction")]
    pub val_data: Option<PathBuf>,
    /// llama: hold out this fraction of --data's rows (the last ones, never trained on) to validate on.
    #[arg(long)]
    pub val_fraction: Option<f64>,
    /// llama: evaluate the validation loss every N steps (and after the last step; 0: only then).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// llama: global batches of validation rows evaluated each time (default 4, or as many as the data holds).
    #[arg(long)]
    pub val_batches: Option<usize>,
    /// gpt, llama: the prompt of the greedy sample printed at the end (default for gpt: "the cat "; the llama
    /// samples only when given).
    #[arg(long)]
    pub sample_prompt: Option<String>,
}

fn parse_decay(s: &str) -> Result<Decay, String> {
    s.parse()
}

impl LoopArgs {
    /// The lr schedule the flags give.
    pub(super) fn schedule(&self) -> Schedule {
        Schedule { warmup_steps: self.warmup_steps, decay: self.lr_decay, min_lr: self.min_lr }
    }

    /// Whether the run validates.
    pub(super) fn validates(&self) -> bool {
        self.val_data.is_some() || self.val_fraction.is_some()
    }

    /// The checks that need no file: which model takes which flag, the
    /// schedule against the run's `steps` and base `lr`, the validation's
    /// combinations.
    pub(super) fn usage(&self, model: ModelArg, steps: u64, lr: f64, has_data: bool) -> anyhow::Result<()> {
        let schedule_given = self.warmup_steps != 0 || self.lr_decay != Decay::None || self.min_lr != 0.0;
        let decoder_only = [
            (schedule_given, "--warmup-steps, --lr-decay and --min-lr are"),
            (self.sample_prompt.is_some(), "--sample-prompt is"),
        ];
        let llama_only = [
            (self.val_data.is_some(), "--val-data"),
            (self.val_fraction.is_some(), "--val-fraction"),
            (self.eval_every != 0, "--eval-every"),
            (self.val_batches.is_some(), "--val-batches"),
        ];
        if model == ModelArg::Mlp {
            if let Some((_, name)) = decoder_only.iter().find(|(given, _)| *given) {
                return Err(usage(format!("{name} for --model gpt and llama")));
            }
        }
        if model != ModelArg::Llama {
            if let Some((_, name)) = llama_only.iter().find(|(given, _)| *given) {
                return Err(usage(format!("{name} is for --model llama")));
            }
        }
        // Without a decay the lr never falls to it: a --min-lr alone would do nothing.
        if self.min_lr != 0.0 && self.lr_decay == Decay::None {
            return Err(usage(format!(
                "--min-lr {} is where --lr-decay ends; give --lr-decay linear or cosine",
                self.min_lr
            )));
        }
        self.schedule().validate(steps, lr).map_err(usage)?;
        if self.val_fraction.is_some() && !has_data {
            return Err(usage("--val-fraction holds out rows of --data; give --data"));
        }
        if let Some(f) = self.val_fraction.filter(|f| !(*f > 0.0 && *f < 1.0)) {
            return Err(usage(format!("--val-fraction {f} must be between 0 and 1 (exclusive)")));
        }
        if !self.validates() && (self.eval_every != 0 || self.val_batches.is_some()) {
            return Err(usage("--eval-every and --val-batches go with --val-data or --val-fraction"));
        }
        if self.val_batches == Some(0) {
            return Err(usage("--val-batches must be at least 1"));
        }
        Ok(())
    }
}
