//! The reference MLP: its `.npy` files, `chorus train --model mlp`, and
//! `chorus train --bench` (FSDP's step time and host overhead at world
//! sizes 1, 2, 4 and 8).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use chorus_fsdp::ParamInit;
use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::mlp::init_layers;
use chorus_train::model_out::NpyOutput;
use chorus_train::npy;
use chorus_train::train::{Dataset, TrainSpec};
use serde_json::json;

use super::args::TrainArgs;
use super::ranks::{run_on, run_with_progress, writes_outputs, MlpJob};
use super::report::{median, say, span, summarize};
use crate::outdir::{write_file, OutDir};
use crate::{usage, Outcome};

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

/// `chorus train --model mlp`.
pub(super) fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    let steps = args.steps();
    let rows = world * args.job.batch;
    let (layers, data) = match &args.job.init_dir {
        Some(dir) => load_init(dir)?,
        None => {
            let dims = args.job.dims();
            let data = Dataset::random(dims[0], dims[dims.len() - 1], rows, steps.clamp(1, 16) as usize, args.seed);
            (init_layers(&dims, args.seed), data)
        }
    };
    // One rank per process: rank 0 writes the outputs.
    let out = if writes_outputs(args.backend) {
        let inside: Vec<(&str, &Path)> = args.job.init_dir.iter().map(|p| ("--init-dir", p.as_path())).collect();
        let out = OutDir::acquire(&args.out_dir(), "train", &inside)?;
        super::outputs::write_config(args, &out)?;
        Some(out)
    } else {
        None
    };
    if let (Some(out), None) = (&out, &args.job.init_dir) {
        save_init(&out.stage().join("init"), &layers, &data)?;
    }
    // The trained parameters, one `.npy` per parameter, gathered and written one at a time.
    let tensors = layers.iter().flatten().map(|p| (p.name.clone(), p.shape.clone())).collect();
    let output = NpyOutput { dir: out.as_ref().map(|o| o.stage().to_path_buf()), tensors };
    let spec = TrainSpec {
        output: Some(Arc::new(output)),
        collect_params: false,
        layers,
        data: Arc::new(data),
        batch: args.job.batch,
        steps: usize::try_from(steps).map_err(|_| usage(format!("--steps {steps} is too large")))?,
        optimizer: args.job.optimizer(),
        fsdp: args.job.fsdp_config(),
        replicate: args.job.hsdp,
        max_grad_norm: args.job.max_grad_norm,
        stop_on_nonfinite: !args.allow_nonfinite,
    };
    let reports = run_with_progress(args.backend, world, MlpJob(spec.clone()), steps, None)?;
    let stopped = reports.first().and_then(|r| r.stopped);
    let Some(out) = out.filter(|_| !reports.is_empty()) else {
        return match stopped {
            Some((step, loss)) => Err(nonfinite(step, loss)),
            None => Ok(Outcome::Passed),
        };
    };
    let first = reports.first().context("no ranks")?;
    if let Some((step, loss)) = stopped {
        // The losses until the divergence are kept: the summary, marked
        // failed, and the curve with the non-finite steps marked; no model.
        let summary = json!({
            "model": "mlp",
            "status": "failed",
            "error": nonfinite(step, loss).to_string(),
            "stopped_at_step": step,
            "losses": first.losses,
            "step_times_s": first.step_times_s,
        });
        write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
        let title = format!("chorus train --model mlp: stopped, loss {loss} at step {step}");
        let window = summarize(&first.losses).window;
        crate::plot::loss_curve(&out.stage().join("loss.svg"), &title, 0, &first.losses, window)?;
        let dest = out.dest().to_path_buf();
        out.commit()?;
        return Err(nonfinite(step, loss)
            .context(format!("the run failed; its summary (marked failed) and loss curve are in {}", dest.display())));
    }
    let median_step = median(&first.step_times_s);
    let overhead_per_group_step = first.overhead.total.as_secs_f64() / (first.groups.max(1) as f64 * steps as f64);
    let s = summarize(&first.losses);
    let dims: Vec<usize> = std::iter::once(spec.layers[0][0].shape.get(1).copied().unwrap_or(0))
        .chain(spec.layers.iter().map(|l| l[0].shape[0]))
        .collect();
    let summary = json!({
        "model": "mlp",
        "status": "completed",
        "losses": first.losses,
        "loss_window": s.window,
        "loss_start_mean": s.start,
        "loss_end_mean": s.end,
        "loss_smoothed": crate::plot::smooth(&first.losses, s.window),
        "step_times_s": first.step_times_s,
        "median_step_time_s": median_step,
        "peak_memory_bytes": reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
        "peak_host_memory_bytes": reports.iter().map(|r| r.peak_host_memory_bytes).collect::<Vec<_>>(),
        "final_memory_bytes": reports.iter().map(|r| r.final_memory_bytes).collect::<Vec<_>>(),
        "fsdp_host_overhead_per_group_per_step_s": overhead_per_group_step,
        "config": {
            "model": "mlp",
            "backend": args.backend.name(),
            "world_size": world,
            "hsdp": args.job.hsdp,
            "steps": steps,
            "batch": args.job.batch,
            "optimizer": optimizer_json(spec.optimizer),
            "param_dtype": args.job.param_dtype.name(),
            "reduce_dtype": args.job.reduce_dtype.unwrap_or(args.job.param_dtype).name(),
            "reshard_after_forward": args.job.reshard_after_forward.to_string(),
            "dims": dims,
            "replicate_below": args.job.replicate_below,
            "max_grad_norm": args.job.max_grad_norm,
            "seed": args.seed,
            "init_dir": args.job.init_dir.as_ref().map(|p| p.display().to_string()),
        },
    });
    let path = out.stage().join("summary.json");
    write_file(&path, serde_json::to_string_pretty(&summary)?.as_bytes())?;
    crate::plot::loss_curve(&out.stage().join("loss.svg"), "chorus train --model mlp", 0, &first.losses, s.window)?;
    let dest = out.dest().to_path_buf();
    out.commit()?;
    let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
    say(format_args!(
        "trained the mlp on {world} ranks x {steps} steps: loss {:.6} (mean of {}) -> {:.6} (mean of {}), median step {:.2} ms, peak memory {:.1} KiB/rank, FSDP overhead {:.1} us/group/step, wrote {}",
        s.start,
        span(0, s.window),
        s.end,
        span(steps - s.window as u64, s.window),
        median_step * 1e3,
        peak as f64 / 1024.0,
        overhead_per_group_step * 1e6,
        dest.display(),
    ))?;
    Ok(Outcome::Passed)
}

/// The error of a run stopped by a loss that is not finite.
fn nonfinite(step: usize, loss: f64) -> anyhow::Error {
    chorus_fsdp_candle::Error::NonFinite { step: step as u64, loss }.into()
}

/// `chorus train --bench` on the mlp: FSDP step time and host overhead for world sizes 1, 2, 4, 8.
pub(super) fn bench(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let dims = match (&args.job.dims, args.job.layers, args.job.width) {
        (None, None, None) => vec![64; 65],
        _ => args.job.dims(),
    };
    let warmup = 3;
    let steps = usize::try_from(args.steps()).map_err(|_| usage("--steps is too large"))?;
    if !args.json {
        say(format_args!(
            "# chorus train --bench: MLP {} layers (widths {}..), batch {}/rank, {} timed steps after {warmup}, param dtype {}, backend {} (sim: sanitizer off)",
            dims.len() - 1,
            dims[0],
            args.job.batch,
            steps,
            args.job.param_dtype,
            args.backend
        ))?;
        say(format_args!("# overhead = host time inside FSDP's hooks (they only enqueue) / (groups x steps); of it CPU = the rank thread's own CPU time there, the rest is waiting (blocked, or for a core)"))?;
        say(format_args!(
            "{:>6} {:>7} {:>14} {:>22} {:>12} {:>16}",
            "world", "groups", "step ms (med)", "overhead us/group/step", "of it CPU us", "peak KiB/rank"
        ))?;
    }
    // The GPU backends take one rank per device, so their worlds stop at the device count.
    let max_world = crate::with_backend!(args.backend, sim => usize::MAX, ucx => {
        anyhow::bail!("train --bench runs worlds of 1, 2, 4 and 8 ranks in this process; ucx runs one rank per process (use chorus bench under chorus launch)")
    }, vendor<L> => {
        <<L as chorus_collectives::nccl_family::VendorLib>::B as chorus_conformance::vendor::HarnessDevice>::count()
            .map_err(anyhow::Error::msg)?
    });
    for world in [1, 2, 4, 8].into_iter().filter(|w| *w <= max_world) {
        let data = Dataset::random(dims[0], dims[dims.len() - 1], world * args.job.batch, 4, args.seed);
        let spec = TrainSpec {
            layers: init_layers(&dims, args.seed),
            data: Arc::new(data),
            batch: args.job.batch,
            steps: steps + warmup,
            optimizer: args.job.optimizer(),
            fsdp: args.job.fsdp_config(),
            replicate: None,
            max_grad_norm: None,
            stop_on_nonfinite: false,
            output: None,
            collect_params: false,
        };
        let reports = run_on(args.backend, world, MlpJob(spec), None)?;
        let r = reports.first().context("no ranks")?;
        let timed = &r.step_times_s[warmup.min(r.step_times_s.len())..];
        let step = median(timed);
        let overhead = r.overhead.total.as_secs_f64() / (r.groups * (steps + warmup)) as f64;
        // The same split into the rank thread's own CPU time and the rest (waiting: blocked or descheduled).
        let overhead_cpu = r.overhead.cpu.as_secs_f64() / (r.groups * (steps + warmup)) as f64;
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
                       "batch": args.job.batch, "median_step_time_s": step, "host_overhead_per_group_per_step_s": overhead,
                       "host_overhead_cpu_per_group_per_step_s": overhead_cpu,
                       "host_overhead_waiting_per_group_per_step_s": (overhead - overhead_cpu).max(0.0),
                       "peak_memory_bytes": peak,
                       "stage_median_s": r.stage_times_s.iter().map(|(n, t)| (n.to_string(), json!(t))).collect::<serde_json::Map<_, _>>(),
                       "hook_overhead_per_group_per_step_s": hooks.iter().map(|(n, t)| (n.to_string(), json!(t))).collect::<serde_json::Map<_, _>>()})
            ))?;
        } else {
            say(format_args!(
                "{world:>6} {:>7} {:>14.3} {:>22.2} {:>12.2} {:>16.1}",
                r.groups,
                step * 1e3,
                overhead * 1e6,
                overhead_cpu * 1e6,
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
