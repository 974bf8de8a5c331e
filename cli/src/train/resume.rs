//! `--resume DIR` checked against the run before anything is written (the
//! checks `gpt.rs` and `llama.rs` share): the checkpoint is there, of this
//! model (`--model`) and configuration, which it must record, data and
//! optimizer (other optimizer settings only with `--allow-optimizer-change`),
//! and leaves steps to train.

use std::path::Path;

use anyhow::Context;
use chorus_fsdp::OptimizerKind;
use chorus_fsdp_candle::checkpoint;

use super::args::TrainArgs;
use crate::job::ModelArg;
use crate::usage;

/// The model whose configuration a checkpoint records, by its fields
/// (`chorus train` records the transformer's `GptConfig` or the Llama's
/// `LlamaConfig`).
fn saved_model(config: &serde_json::Value) -> Option<ModelArg> {
    let o = config.as_object()?;
    if o.contains_key("num_hidden_layers") {
        Some(ModelArg::Llama)
    } else if o.contains_key("experts") {
        Some(ModelArg::Moe)
    } else if o.contains_key("d_model") {
        Some(ModelArg::Gpt)
    } else {
        None
    }
}

/// What a run resumes with, as the checkpoint is checked against it.
pub(super) struct Resuming<'a> {
    /// The model, as the error names it ("transformer", "Llama").
    pub(super) model: &'a str,
    /// The model as `--model` names it.
    pub(super) flag: ModelArg,
    /// How the saved model configuration differs from this run's (empty: the same).
    pub(super) config_changes: &'a dyn Fn(&serde_json::Value) -> Vec<String>,
    /// What identifies this run's data (the data seed, or the token file's hash).
    pub(super) data_seed: u64,
    /// How a data mismatch is explained: given the saved and this run's identity.
    pub(super) data_mismatch: &'a dyn Fn(u64, u64) -> String,
    /// This run's optimizer.
    pub(super) optimizer: OptimizerKind,
    /// The step to stop before.
    pub(super) steps: u64,
}

/// Checks `--resume DIR`; returns the optimizer settings that change (reported).
pub(super) fn check_resume(args: &TrainArgs, dir: &Path, run: &Resuming<'_>) -> anyhow::Result<Vec<String>> {
    let saved = match checkpoint::inspect(dir) {
        Ok(saved) => saved,
        Err(e) if crate::consolidate::names_no_checkpoint(&e) => return Err(usage(format!("--resume: {e}"))),
        Err(e) => return Err(e).with_context(|| format!("--resume {}", dir.display())),
    };
    let at = saved.dir.display();
    match saved_model(&saved.state.model) {
        None => {
            return Err(usage(format!(
                "--resume {at}: the checkpoint records no model configuration that chorus train can read (training_state.json's `model` is {}), so it cannot be checked against this run",
                if saved.state.model.is_null() { "missing".to_string() } else { saved.state.model.to_string() }
            )))
        }
        Some(ModelArg::Llama) if run.flag != ModelArg::Llama => {
            return Err(usage(format!("--resume {at}: a Llama checkpoint: use --model llama")))
        }
        Some(ModelArg::Gpt) if run.flag != ModelArg::Gpt => {
            return Err(usage(format!("--resume {at}: a transformer checkpoint: use --model gpt")))
        }
        Some(ModelArg::Moe) if run.flag != ModelArg::Moe => {
            return Err(usage(format!("--resume {at}: a mixture-of-experts checkpoint: use --model moe")))
        }
        Some(_) => {}
    }
    let changes = (run.config_changes)(&saved.state.model);
    if !changes.is_empty() {
        return Err(usage(format!(
            "--resume {at}: saved from another {} ({}); give the sizes it was saved with",
            run.model,
            changes.join(", ")
        )));
    }
    if saved.state.data_seed != run.data_seed {
        return Err(usage(format!("--resume {at}: {}", (run.data_mismatch)(saved.state.data_seed, run.data_seed))));
    }
    let optimizer = checkpoint::optimizer_changes(&saved.optimizer, run.optimizer)
        .map_err(|e| usage(format!("--resume {at}: {e}")))?;
    if !optimizer.is_empty() && !args.allow_optimizer_change {
        return Err(usage(format!(
            "--resume {at}: saved with other optimizer settings ({}); give the same, or --allow-optimizer-change to continue with these",
            optimizer.join(", ")
        )));
    }
    if saved.state.step >= run.steps {
        return Err(usage(format!(
            "{at} is at step {}; --steps {} leaves nothing to train",
            saved.state.step, run.steps
        )));
    }
    Ok(optimizer)
}
