//! `--resume DIR` checked against the run before anything is written (the
//! checks `gpt.rs` and `llama.rs` share): the checkpoint is there, of this
//! model (`--model`) and configuration, which it must record, data and
//! optimizer (other optimizer settings only with `--allow-optimizer-change`),
//! and leaves steps to train.
//!
//! `--resume auto` ([`resolve_auto`]) is a job that continues itself when it
//! is started again (by `chorus launch --max-restarts`, or by hand) into the
//! same directories: it resumes from the newest complete checkpoint of its
//! own checkpoint directory (the one `latest` names), checked as any
//! `--resume` is, and starts fresh where there is none. What the restart
//! cost goes into the summary (`restart`): the launcher's earlier attempts
//! (which rank or node failed, and why), the step resumed from, and the
//! steps and seconds the previous attempt did past that checkpoint
//! (`progress.json`, which rank 0 keeps beside the checkpoints).

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

/// `--resume`'s value that resumes from the job's own newest checkpoint, if any.
pub(crate) const AUTO: &str = "auto";

/// What the launcher says of the attempts before this one
/// ([`HISTORY_VAR`](crate::launch::HISTORY_VAR)), and this attempt's number
/// and budget (torchrun's variables); nothing outside a launcher. A value
/// that is not what `chorus launch` gives is a usage error naming it.
fn launch_attempts() -> anyhow::Result<Option<serde_json::Value>> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let number = |name: &str| -> anyhow::Result<Option<u64>> {
        var(name)
            .map(|v| v.trim().parse::<u64>().map_err(|_| usage(format!("{name}={v:?} is not a whole number"))))
            .transpose()
    };
    let restart_count = number("TORCHELASTIC_RESTART_COUNT")?;
    let max_restarts = number("TORCHELASTIC_MAX_RESTARTS")?;
    let history_var = crate::launch::HISTORY_VAR;
    let history = match var(history_var) {
        None => None,
        Some(text) => {
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| usage(format!("{history_var}: not JSON ({e}): {text:?}")))?;
            let well_formed = value.as_array().is_some_and(|a| {
                a.iter().all(|e| e["attempt"].is_u64() && e["seconds"].is_number() && e["failure"].is_string())
            });
            if !well_formed {
                return Err(usage(format!(
                    "{history_var}: not a list of {{\"attempt\", \"seconds\", \"failure\"}} as chorus launch gives: {text}"
                )));
            }
            Some(value)
        }
    };
    if restart_count.is_none() && history.is_none() {
        return Ok(None);
    }
    Ok(Some(serde_json::json!({
        "restart_count": restart_count.unwrap_or(0),
        "max_restarts": max_restarts,
        "earlier_attempts": history.unwrap_or_else(|| serde_json::json!([])),
    })))
}

/// `--resume auto` made concrete: `resume` becomes the step directory that
/// the checkpoint directory's `latest` names, or nothing (a fresh start)
/// where it has none; `restart` records what the summary says of this
/// attempt. Other values of `--resume` are left as they are. Every rank
/// resolves it alike: under a launcher, the previous attempt's ranks have
/// all ended before this one's start.
pub(super) fn resolve_auto(mut args: TrainArgs) -> anyhow::Result<TrainArgs> {
    let mut restart = launch_attempts()?;
    if args.resume.as_deref() != Some(Path::new(AUTO)) {
        args.restart = restart;
        return Ok(args);
    }
    if args.save_every.is_none() && args.checkpoint_dir.is_none() {
        return Err(usage(
            "--resume auto continues the job from its own checkpoints: give --save-every N (and --checkpoint-dir, \
             else <out-dir>-checkpoints); a directory named auto is ./auto",
        ));
    }
    let dir = args.checkpoint_dir();
    let from = match std::fs::symlink_metadata(dir.join("latest")) {
        Err(_) => None,
        Ok(_) => Some(checkpoint::resolve(&dir).map_err(|e| usage(format!("--resume auto: {e}")))?),
    };
    let says = super::ranks::writes_outputs(args.backend);
    let mut resumed = serde_json::Value::Null;
    let mut previous = serde_json::Value::Null;
    if let Some(at) = &from {
        let saved = checkpoint::inspect(at).map_err(|e| usage(format!("--resume auto: {e}")))?;
        let step = saved.state.step;
        if step >= args.steps() {
            return Err(usage(format!(
                "--resume auto: {} is at step {step}, and --steps {} leaves nothing to train: the job has trained \
                 every step (`chorus consolidate {}` makes a model of it)",
                at.display(),
                args.steps(),
                at.display()
            )));
        }
        resumed = serde_json::json!({"checkpoint": at.display().to_string(), "step": step});
        previous = lost_work(&dir, step, &saved.state);
        if says {
            eprintln!("--resume auto: resuming from {} (step {step})", at.display());
        }
    } else if says {
        eprintln!("--resume auto: no checkpoint in {}: starting at step 0", dir.display());
    }
    let entry = restart.get_or_insert_with(|| serde_json::json!({}));
    entry["resume"] = AUTO.into();
    entry["resumed_from"] = resumed;
    entry["previous_attempt"] = previous;
    args.resume = from;
    args.restart = restart;
    Ok(args)
}

/// The work the run that left `dir`'s record did past the checkpoint of
/// `step` this run resumes from: its last step, the steps and seconds past
/// the checkpoint, and the time from its last step to now. Null without a
/// record of this job (the checkpoint's data and model) that reached `step`.
fn lost_work(dir: &Path, step: u64, state: &checkpoint::TrainingState) -> serde_json::Value {
    use chorus_train::decoder::progress;
    let Some(p) = progress::read(dir) else { return serde_json::Value::Null };
    // A record one step behind the checkpoint: of an earlier chorus, which recorded a step after its save.
    if p.data_seed != state.data_seed || p.model != state.model || p.step + 1 < step {
        return serde_json::Value::Null;
    }
    let reached = p.step.max(step);
    let seconds = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e6;
    let lost_seconds = if reached > step { seconds(p.saved_at_us, p.at_us) } else { 0.0 };
    serde_json::json!({
        "reached_step": reached,
        "lost_steps": reached - step,
        "lost_seconds": lost_seconds,
        "seconds_from_its_last_step_to_this_start": seconds(p.at_us, progress::now_us()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn state(step: u64) -> checkpoint::TrainingState {
        checkpoint::TrainingState { step, data_seed: 3, losses: vec![], model: serde_json::json!({"d_model": 8}) }
    }

    #[test]
    fn the_work_lost_is_the_steps_past_the_checkpoint() {
        let dir: PathBuf = std::env::temp_dir().join(format!("chorus-lost-work-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(lost_work(&dir, 4, &state(4)).is_null(), "no record");
        let record = |step: u64, saved_step: u64, data_seed: u64| {
            let p = chorus_train::decoder::progress::Progress {
                step,
                at_us: 9_000_000,
                saved_step,
                saved_at_us: 6_500_000,
                data_seed,
                model: serde_json::json!({"d_model": 8}),
            };
            std::fs::write(dir.join("progress.json"), serde_json::to_vec(&p).unwrap()).unwrap();
        };
        record(7, 4, 3);
        let lost = lost_work(&dir, 4, &state(4));
        assert_eq!(lost["reached_step"], 7);
        assert_eq!(lost["lost_steps"], 3);
        assert_eq!(lost["lost_seconds"], 2.5);
        assert!(lost["seconds_from_its_last_step_to_this_start"].as_f64().unwrap() > 1e9, "now is long after 9 s");
        record(4, 4, 3);
        assert_eq!(lost_work(&dir, 4, &state(4))["lost_seconds"], 0.0, "nothing past the checkpoint");
        record(7, 4, 99);
        assert!(lost_work(&dir, 4, &state(4)).is_null(), "another job's record");
        record(3, 2, 3);
        let lost = lost_work(&dir, 4, &state(4));
        assert_eq!(
            (lost["reached_step"].as_u64(), lost["lost_steps"].as_u64()),
            (Some(4), Some(0)),
            "stopped before its record"
        );
        record(2, 2, 3);
        assert!(lost_work(&dir, 4, &state(4)).is_null(), "a record behind the checkpoint is not its run's");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
