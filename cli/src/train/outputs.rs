//! What the candle models' runs (`--model gpt`, `--model llama`) write and
//! say alike: the locked out-dir and checkpoint directory (with the run's
//! `config.toml`), the run on the ranks to its end, the summary's common
//! part, a failed run's summary and curve, and the closing line.

use std::path::{Path, PathBuf};

use anyhow::Context;
use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::decoder::{NonFinite, TrainReport, TrainSpec};
use chorus_train::models::DecoderModel;
use serde_json::{json, Map, Value};

use super::args::TrainArgs;
use super::ranks::{run_with_progress, writes_outputs, DecoderJob};
use super::report::{median, span, summarize, LossSummary};
use super::throughput::Throughput;
use crate::outdir::{write_file, CheckpointDir, OutDir};
use crate::Outcome;

/// Locks the out-dir (refusing the `inside` paths that are given within
/// it) and `checkpoint_dir`, before any work; nothing where this process
/// writes no outputs (a rank other than 0 under a launcher).
pub(super) fn acquire(
    args: &TrainArgs,
    inside: &[(&str, Option<&Path>)],
    checkpoint_dir: Option<&Path>,
) -> anyhow::Result<(Option<OutDir>, Option<CheckpointDir>)> {
    if !writes_outputs(args.backend) {
        return Ok((None, None));
    }
    let inside: Vec<(&str, &Path)> = inside.iter().filter_map(|(flag, p)| p.map(|p| (*flag, p))).collect();
    let out = OutDir::acquire(&args.out_dir(), "train", &inside)?;
    write_config(args, &out)?;
    let checkpoints = checkpoint_dir
        .map(|dir| CheckpointDir::acquire(dir, args.resume.as_deref(), args.overwrite_checkpoints))
        .transpose()?;
    Ok((Some(out), checkpoints))
}

/// Stages the run's effective configuration as `config.toml` (from
/// [`crate::job::file`]), so the out-dir alone repeats (and plans) the run.
pub(super) fn write_config(args: &TrainArgs, out: &OutDir) -> anyhow::Result<()> {
    match &args.effective {
        Some(text) => write_file(&out.stage().join("config.toml"), text.as_bytes()),
        None => Ok(()),
    }
}

/// Runs a decoder's `spec` on the ranks behind the progress bar, to its
/// end: where this process writes the outputs (into `out`), a run stopped
/// by a non-finite loss writes its failed summary and returns the error;
/// a completed one hands `end` the finished run, the out-dir and the
/// summary's common part (with `config(start_step)`), for the model's own
/// keys and files, the commit and the closing lines.
pub(super) fn run_to_end<M: DecoderModel + Clone + 'static>(
    args: &TrainArgs,
    spec: &TrainSpec<M>,
    out: Option<OutDir>,
    model: &str,
    throughput: &Throughput,
    config: impl FnOnce(u64) -> Value,
    end: impl FnOnce(&Finished<'_>, OutDir, Map<String, Value>) -> anyhow::Result<()>,
) -> anyhow::Result<Outcome> {
    let reports =
        run_with_progress(args.backend, args.world(), DecoderJob(spec.clone()), args.steps(), Some(throughput))?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else {
        return match reports.first().and_then(|r| r.stopped) {
            Some(stop) => Err(stop.error().into()),
            None => Ok(Outcome::Passed),
        };
    };
    let run = Finished::of(&reports)?;
    let config = config(run.first().start_step);
    if let Some(stop) = run.first().stopped {
        return run.fail(out, model, stop, config);
    }
    let mut summary = run.summary(model, config, throughput);
    if let Some(restart) = &args.restart {
        summary.insert("restart".into(), restart.clone());
    }
    // How long each save held the step (rank 0's), asynchronous or blocking.
    summary.insert("saves".into(), serde_json::to_value(&run.first().saves).unwrap_or_default());
    end(&run, out, summary)?;
    Ok(Outcome::Passed)
}

/// The run's configuration as a decoder's summary records it: what every
/// decoder's run has; the caller adds its model's keys.
pub(super) fn config_json<M>(
    args: &TrainArgs,
    spec: &TrainSpec<M>,
    start_step: u64,
    optimizer_changes: &[String],
) -> Map<String, Value> {
    let job = &args.job;
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let config = json!({
        "model": format!("{:?}", job.model()).to_lowercase(),
        "backend": args.backend.name(),
        "world_size": args.world(),
        "hsdp": job.hsdp,
        "steps": spec.steps,
        "batch": job.batch,
        "micro_batches": job.micro_batches,
        "lr_schedule": spec.schedule,
        "optimizer": optimizer_json(spec.optimizer),
        "optimizer_changes": optimizer_changes,
        "param_dtype": job.param_dtype.name(),
        "reduce_dtype": job.reduce_dtype.unwrap_or(job.param_dtype).name(),
        "reshard_after_forward": job.reshard_after_forward.to_string(),
        "recompute": job.recompute.to_string(),
        "max_grad_norm": job.max_grad_norm,
        "seed": args.seed,
        "text": path(&args.text),
        "resume": path(&args.resume),
        "start_step": start_step,
        "save_every": args.save_every,
        "keep_last": args.keep_last,
        "checkpoint_dir": path(&spec.checkpoint_dir),
    });
    match config {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// The summary's `val_losses` (`[step, loss]` pairs) for the loss curve's
/// second line; none where the run did not evaluate.
fn val_losses(summary: &serde_json::Map<String, serde_json::Value>) -> Vec<(u64, f64)> {
    let pairs = summary.get("val_losses").and_then(|v| v.as_array()).map(Vec::as_slice).unwrap_or_default();
    pairs
        .iter()
        .filter_map(|p| match p.as_array().map(Vec::as_slice) {
            Some([step, loss]) => Some((step.as_u64()?, loss.as_f64().unwrap_or(f64::NAN))),
            _ => None,
        })
        .collect()
}

/// A finished run as rank 0 reported it, with every rank's report.
pub(super) struct Finished<'a> {
    reports: &'a [TrainReport],
    first: &'a TrainReport,
    /// The losses of the whole run, a resumed run's earlier steps included.
    all_losses: Vec<f64>,
    summary: LossSummary,
    /// The step `all_losses` starts at.
    first_step: u64,
}

impl<'a> Finished<'a> {
    pub(super) fn of(reports: &'a [TrainReport]) -> anyhow::Result<Finished<'a>> {
        let first = reports.first().context("no ranks")?;
        let all_losses: Vec<f64> = first.earlier_losses.iter().chain(&first.losses).copied().collect();
        let summary = summarize(&all_losses);
        let first_step = first.start_step - first.earlier_losses.len() as u64;
        Ok(Finished { reports, first, all_losses, summary, first_step })
    }

    /// Rank 0's report.
    pub(super) fn first(&self) -> &TrainReport {
        self.first
    }

    fn checkpoints(&self) -> Vec<String> {
        self.first.saved.iter().map(|p| p.display().to_string()).collect()
    }

    /// Where the run stopped on a non-finite loss: the losses until the
    /// divergence are kept (the summary, marked failed, and the curve with
    /// the non-finite steps marked; no model), and the error says where.
    pub(super) fn fail(
        &self,
        out: OutDir,
        model: &str,
        stop: NonFinite,
        config: serde_json::Value,
    ) -> anyhow::Result<Outcome> {
        let summary = json!({
            "model": model,
            "status": "failed",
            "error": stop.error().to_string(),
            "stopped_at_step": stop.step,
            "first_step": self.first_step,
            "losses": self.all_losses,
            "loss_window": self.summary.window,
            "step_times_s": self.first.step_times_s,
            "checkpoints": self.checkpoints(),
            "config": config,
        });
        write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
        let title = format!("chorus train --model {model}: stopped, loss {} at step {}", stop.loss, stop.step);
        crate::plot::loss_curve(
            &out.stage().join("loss.svg"),
            &title,
            self.first_step,
            &self.all_losses,
            self.summary.window,
        )?;
        let dest = out.dest().to_path_buf();
        out.commit()?;
        Err(anyhow::Error::from(stop.error())
            .context(format!("the run failed; its summary (marked failed) and loss curve are in {}", dest.display())))
    }

    /// The summary of a completed run: what both models report; the caller
    /// adds its own keys before [`Finished::commit`].
    pub(super) fn summary(
        &self,
        model: &str,
        config: serde_json::Value,
        throughput: &Throughput,
    ) -> serde_json::Map<String, serde_json::Value> {
        let ran = self.first.losses.len().max(1) as f64;
        let summary = json!({
            "model": model,
            "status": "completed",
            "first_step": self.first_step,
            "losses": self.all_losses,
            "lrs": self.first.lrs,
            "val_losses": self.first.val_losses,
            "loss_window": self.summary.window,
            "loss_start_mean": self.summary.start,
            "loss_end_mean": self.summary.end,
            "loss_smoothed": crate::plot::smooth(&self.all_losses, self.summary.window),
            "step_times_s": self.first.step_times_s,
            "median_step_time_s": median(&self.first.step_times_s),
            "peak_memory_bytes": self.reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
            "peak_host_memory_bytes": self.reports.iter().map(|r| r.peak_host_memory_bytes).collect::<Vec<_>>(),
            // The whole process as the kernel counts it (VmHWM), beside FSDP's per-rank counts above.
            "process_peak_resident_bytes": chorus_train::decoder::memory::peak_resident_bytes(),
            "fsdp_host_overhead_per_group_per_step_s":
                self.first.overhead.total.as_secs_f64() / (self.first.groups.max(1) as f64 * ran),
            "adapter_transfer_per_step_s": self.first.adapter.transfer.as_secs_f64() / ran,
            "candle_compute_per_step_s": self.first.adapter.compute.as_secs_f64() / ran,
            "op_times": super::op_times::summary(&self.first.op_times),
            "checkpoints": self.checkpoints(),
            "config": config,
        });
        let mut map = match summary {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        map.extend(throughput.summary(&self.first.step_times_s));
        map
    }

    /// Writes `summary` and the loss curve (with the summary's `val_losses`
    /// as a second line) into `out`'s staging directory
    /// (beside what the caller wrote there) and puts the out-dir in place;
    /// where it now is.
    pub(super) fn commit(
        &self,
        out: OutDir,
        model: &str,
        summary: serde_json::Map<String, serde_json::Value>,
    ) -> anyhow::Result<PathBuf> {
        let val = val_losses(&summary);
        let summary = serde_json::Value::Object(summary);
        write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
        let title = format!("chorus train --model {model}");
        crate::plot::loss_curves(
            &out.stage().join("loss.svg"),
            &title,
            self.first_step,
            &self.all_losses,
            self.summary.window,
            &val,
        )?;
        let dest = out.dest().to_path_buf();
        out.commit()?;
        Ok(dest)
    }

    /// The closing line's account of this run's steps (a resumed run's
    /// earlier ones are in the summary): `trained the {what} ({n}
    /// parameters) on {world} ranks, steps ...: loss ... -> ..., median
    /// step, tokens/s (and MFU), peak FSDP memory, wrote {dest}`, losses to
    /// `decimals` places.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn closing(
        &self,
        what: &str,
        parameters: usize,
        world: usize,
        steps: u64,
        decimals: usize,
        dest: &Path,
        throughput: &Throughput,
    ) -> String {
        let first = self.first;
        let peak = self.reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
        let this = summarize(&first.losses);
        let last_start = first.start_step + (first.losses.len() - this.window) as u64;
        let rate = throughput.summary(&first.step_times_s);
        let number = |key: &str| rate.get(key).and_then(|v| v.as_f64());
        let mut speed = format!("{:.0} tokens/s", number("tokens_per_s").unwrap_or(0.0));
        if let Some(mfu) = number("mfu") {
            speed.push_str(&format!(" (MFU {mfu:.1}%)"));
        }
        format!(
            "trained the {what} ({parameters} parameters) on {world} ranks, steps {}..{steps}: loss {:.decimals$} (mean of {}) -> {:.decimals$} (mean of {}), median step {:.1} ms, {speed}, peak FSDP memory {:.1} KiB/rank, wrote {}",
            first.start_step,
            this.start,
            span(first.start_step, this.window),
            this.end,
            span(last_start, this.window),
            median(&first.step_times_s) * 1e3,
            peak as f64 / 1024.0,
            dest.display(),
        )
    }

    /// The line after the closing one where the run timed its fused ops (`--op-times`).
    pub(super) fn op_times_line(&self) -> Option<String> {
        super::op_times::line(&self.first.op_times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn val_losses_are_read_from_the_summary_as_step_loss_pairs() {
        let summary = |v: serde_json::Value| match json!({ "losses": [1.0], "val_losses": v }) {
            serde_json::Value::Object(map) => map,
            _ => unreachable!(),
        };
        assert_eq!(val_losses(&summary(json!([[0, 2.5], [5, 2.0]]))), [(0, 2.5), (5, 2.0)]);
        // A NaN is written as null: kept as NaN (the plot leaves it out); malformed entries are skipped.
        let odd = val_losses(&summary(json!([[3, null], [1], "x", [4, 1.5]])));
        assert_eq!(odd.len(), 2);
        assert!(odd[0].0 == 3 && odd[0].1.is_nan() && odd[1] == (4, 1.5));
        assert!(val_losses(&serde_json::Map::new()).is_empty());
    }
}
