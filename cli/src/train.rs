//! `chorus train`: the reference MLP under FSDP on simulated ranks, with
//! PyTorch-compatible `.npy` input and output, and `--bench` for FSDP's step
//! time and host overhead.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision, OptimizerKind, ParamInit, Reshard};
use chorus_train::mlp::init_layers;
use chorus_train::npy;
use chorus_train::train::{train, Dataset, RankReport, TrainSpec};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::backends::Backend;
use crate::{Outcome, UsageError};

/// Optimizers `chorus train` offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerArg {
    /// SGD (PyTorch semantics; --momentum).
    Sgd,
    /// AdamW (PyTorch semantics; --weight-decay).
    Adamw,
}

/// Arguments of `chorus train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The communication backend: sim, simnccl, or nccl/rccl (one rank per GPU, in builds with those features).
    #[arg(long, default_value = "sim", value_parser = crate::backends::parse_backend)]
    pub backend: Backend,
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    pub world_size: usize,
    /// HSDP: replicate over this many groups (it must divide the world size).
    #[arg(long)]
    pub hsdp: Option<usize>,
    /// Training steps.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Rows per rank per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// The optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    pub optimizer: OptimizerArg,
    /// Learning rate (default 0.05 for SGD, 1e-3 for AdamW).
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
    /// Layer widths, e.g. 37,64,33,5 (instead of --layers/--width; default 16,64,64,4).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["layers", "width"])]
    pub dims: Option<Vec<usize>>,
    /// Number of Linear layers (with --width).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Width of every layer (with --layers).
    #[arg(long)]
    pub width: Option<usize>,
    /// Parameters with fewer elements than this are replicated, not sharded.
    #[arg(long, default_value_t = 0)]
    pub replicate_below: usize,
    /// Clip the global gradient norm to this.
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Seed of the weights and data when there is no --init-dir.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory with layers.{i}.weight.npy / layers.{i}.bias.npy and x.npy / y.npy (float32).
    #[arg(long)]
    pub init_dir: Option<PathBuf>,
    /// Where the final parameters (.npy) and summary.json go.
    #[arg(long, default_value = "out/train")]
    pub out_dir: PathBuf,
    /// Benchmark FSDP instead: step time and host overhead per group per step for world sizes 1, 2, 4, 8.
    #[arg(long)]
    pub bench: bool,
    /// With --bench: print one JSON object per row.
    #[arg(long)]
    pub json: bool,
}

fn parse_float_dtype(s: &str) -> Result<DType, String> {
    match s.parse::<DType>()? {
        d @ (DType::F32 | DType::BF16 | DType::F16) => Ok(d),
        d => Err(format!("{d} is not a training dtype (f32, bf16 or f16)")),
    }
}

impl TrainArgs {
    fn usage(&self) -> anyhow::Result<()> {
        if self.world_size == 0 || self.batch == 0 {
            return Err(UsageError("--world-size and --batch must be at least 1".into()).into());
        }
        if let Some(r) = self.hsdp {
            if r == 0 || self.world_size % r != 0 {
                return Err(UsageError(format!("--hsdp {r} must divide --world-size {}", self.world_size)).into());
            }
        }
        if self.layers.is_some() != self.width.is_some() {
            return Err(UsageError("--layers and --width go together".into()).into());
        }
        if let Some(d) = &self.dims {
            if d.len() < 2 || d.contains(&0) {
                return Err(UsageError("--dims needs at least two positive widths".into()).into());
            }
        }
        if let (Some(0), _) | (_, Some(0)) = (self.layers, self.width) {
            return Err(UsageError("--layers and --width must be positive".into()).into());
        }
        Ok(())
    }

    fn optimizer(&self) -> OptimizerKind {
        match self.optimizer {
            OptimizerArg::Sgd => OptimizerKind::Sgd {
                lr: self.lr.unwrap_or(0.05),
                momentum: self.momentum,
                dampening: 0.0,
                weight_decay: self.weight_decay.unwrap_or(0.0),
                nesterov: false,
            },
            OptimizerArg::Adamw => OptimizerKind::adamw(self.lr.unwrap_or(1e-3), self.weight_decay.unwrap_or(0.01)),
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
}

/// Loads `layers.{i}.weight.npy`/`layers.{i}.bias.npy` (as many layers as exist) and `x.npy`/`y.npy`.
fn load_init(dir: &Path) -> anyhow::Result<(Vec<Vec<ParamInit>>, Dataset)> {
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
    let data = Dataset::from_arrays(npy::read(&dir.join("x.npy"))?, npy::read(&dir.join("y.npy"))?)?;
    Ok((layers, data))
}

fn save_init(dir: &Path, layers: &[Vec<ParamInit>], data: &Dataset) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for p in layers.iter().flatten() {
        npy::write(&dir.join(format!("{}.npy", p.name)), &p.shape, &p.values)?;
    }
    let (x, y) = data.arrays();
    npy::write(&dir.join("x.npy"), &x.shape, &x.values)?;
    npy::write(&dir.join("y.npy"), &y.shape, &y.values)?;
    Ok(())
}

/// Runs `spec` on `world` ranks of `backend` and returns every rank's report.
fn run_on(
    backend: Backend,
    world: usize,
    spec: TrainSpec,
    bar: Option<ProgressBar>,
) -> anyhow::Result<Vec<RankReport>> {
    // Under a launcher, the GPU backends run one rank per process (as ucx always does).
    let process = if backend.runs_as_processes() { crate::process::RankProcess::detect()? } else { None };
    crate::with_backend!(
        backend,
        sim => run_sim(world, spec, bar),
        ucx => crate::process::train_ucx(process, world, &spec, bar),
        vendor<L> => match process {
            Some(p) => crate::process::train_vendor::<L>(p, world, &spec, bar),
            None => run_vendor::<L>(world, spec, bar),
        }
    )
}

/// One rank per device of the NCCL family, as threads of this process,
/// bootstrapped through an in-memory store.
fn run_vendor<L>(world: usize, spec: TrainSpec, bar: Option<ProgressBar>) -> anyhow::Result<Vec<RankReport>>
where
    L: chorus_collectives::vendor::VendorLib,
    L::B: chorus_conformance::vendor::HarnessDevice + chorus_devices::ComputeBackend,
{
    use chorus_collectives::bootstrap::MemStore;
    use chorus_collectives::vendor::{VendorComm, VendorConfig};
    use chorus_conformance::vendor::HarnessDevice;
    let devices = L::B::count().map_err(anyhow::Error::msg)?;
    if world > devices {
        anyhow::bail!("{world} ranks need as many devices (one rank per device); {devices} visible");
    }
    let store = MemStore::new();
    let results: Vec<anyhow::Result<RankReport>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (store, spec, bar) = (store.clone(), &spec, bar.clone());
                s.spawn(move || -> anyhow::Result<RankReport> {
                    let device = L::B::make(rank, std::time::Duration::from_secs(300))?;
                    let comm = VendorComm::<L>::init(&store, rank, world, device, VendorConfig::default())?;
                    let mut on_step = |_step: usize, loss: f64| {
                        if let (0, Some(b)) = (rank, &bar) {
                            b.set_message(format!("loss {loss:.5}"));
                            b.inc(1);
                        }
                    };
                    train(Arc::new(comm), spec, &mut on_step).with_context(|| format!("rank {rank}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    results.into_iter().collect()
}

/// Runs `spec` on `world` simulated ranks and returns every rank's report.
fn run_sim(world: usize, spec: TrainSpec, bar: Option<ProgressBar>) -> anyhow::Result<Vec<RankReport>> {
    let spec = Arc::new(spec);
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
        let bar = bar.clone();
        let mut on_step = move |_step: usize, loss: f64| {
            if rank == 0 {
                if let Ok(Some(b)) = bar.lock().as_deref() {
                    b.set_message(format!("loss {loss:.5}"));
                    b.inc(1);
                }
            }
        };
        train(Arc::new(comm), &spec, &mut on_step)
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

/// Runs `chorus train`.
pub fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    args.usage()?;
    if args.bench {
        return bench(args);
    }
    let rows = args.world_size * args.batch;
    let (layers, data) = match &args.init_dir {
        Some(dir) => load_init(dir)?,
        None => {
            let dims = args.dims();
            let layers = init_layers(&dims, args.seed);
            let data = Dataset::random(dims[0], dims[dims.len() - 1], rows, args.steps.clamp(1, 16), args.seed);
            save_init(&args.out_dir.join("init"), &layers, &data)?;
            (layers, data)
        }
    };
    let spec = TrainSpec {
        layers,
        data: Arc::new(data),
        batch: args.batch,
        steps: args.steps,
        optimizer: args.optimizer(),
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        max_grad_norm: args.max_grad_norm,
    };
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed})")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let reports = run_on(args.backend, args.world_size, spec.clone(), Some(bar.clone()))?;
    bar.finish_and_clear();
    if reports.is_empty() {
        // One rank per process: rank 0 writes the outputs.
        return Ok(Outcome::Passed);
    }
    let first = reports.first().context("no ranks")?;
    std::fs::create_dir_all(&args.out_dir).with_context(|| format!("creating {}", args.out_dir.display()))?;
    for (name, values) in &first.params {
        let shape = spec.layers.iter().flatten().find(|p| &p.name == name).map(|p| p.shape.clone()).unwrap_or_default();
        npy::write(&args.out_dir.join(format!("{name}.npy")), &shape, values)?;
    }
    let median_step = median(&first.step_times_s);
    let overhead_per_group_step = first.overhead.total.as_secs_f64() / (first.groups.max(1) * args.steps.max(1)) as f64;
    let summary = json!({
        "losses": first.losses,
        "step_times_s": first.step_times_s,
        "median_step_time_s": median_step,
        "peak_memory_bytes": reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
        "final_memory_bytes": reports.iter().map(|r| r.final_memory_bytes).collect::<Vec<_>>(),
        "fsdp_host_overhead_per_group_per_step_s": overhead_per_group_step,
        "config": {
            "backend": args.backend.name(),
            "world_size": args.world_size,
            "hsdp": args.hsdp,
            "steps": args.steps,
            "batch": args.batch,
            "optimizer": format!("{:?}", spec.optimizer),
            "param_dtype": args.param_dtype.name(),
            "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
            "reshard_after_forward": args.reshard_after_forward.to_string(),
            "dims": std::iter::once(spec.layers[0][0].shape[1]).chain(spec.layers.iter().map(|l| l[0].shape[0])).collect::<Vec<_>>(),
            "replicate_below": args.replicate_below,
            "max_grad_norm": args.max_grad_norm,
            "seed": args.seed,
            "init_dir": args.init_dir.as_ref().map(|p| p.display().to_string()),
        },
    });
    std::fs::write(args.out_dir.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    let (l0, l1) = (first.losses.first().copied().unwrap_or(0.0), first.losses.last().copied().unwrap_or(0.0));
    let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
    println!(
        "trained {} ranks x {} steps: loss {l0:.6} -> {l1:.6}, median step {:.2} ms, peak memory {:.1} KiB/rank, FSDP overhead {:.1} us/group/step, wrote {}",
        args.world_size,
        args.steps,
        median_step * 1e3,
        peak as f64 / 1024.0,
        overhead_per_group_step * 1e6,
        args.out_dir.display()
    );
    Ok(Outcome::Passed)
}

/// `chorus train --bench`: FSDP step time and host overhead for world sizes 1, 2, 4, 8.
fn bench(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let dims = match (&args.dims, args.layers, args.width) {
        (None, None, None) => vec![64; 65],
        _ => args.dims(),
    };
    let warmup = 3;
    if !args.json {
        println!(
            "# chorus train --bench: MLP {} layers (widths {}..), batch {}/rank, {} timed steps after {warmup}, param dtype {}, backend {} (sim: sanitizer off)",
            dims.len() - 1,
            dims[0],
            args.batch,
            args.steps,
            args.param_dtype,
            args.backend
        );
        println!("# overhead = host time inside FSDP's hooks (they only enqueue) / (groups x steps)");
        println!(
            "{:>6} {:>7} {:>14} {:>22} {:>16}",
            "world", "groups", "step ms (med)", "overhead us/group/step", "peak KiB/rank"
        );
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
            steps: args.steps + warmup,
            optimizer: args.optimizer(),
            fsdp: args.fsdp_config(),
            replicate: None,
            max_grad_norm: None,
        };
        let reports = run_on(args.backend, world, spec, None)?;
        let r = reports.first().context("no ranks")?;
        let timed = &r.step_times_s[warmup.min(r.step_times_s.len())..];
        let step = median(timed);
        let overhead = r.overhead.total.as_secs_f64() / (r.groups * (args.steps + warmup)) as f64;
        let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
        if args.json {
            println!(
                "{}",
                json!({"world_size": world, "groups": r.groups, "layers": dims.len() - 1, "width": dims[1],
                       "batch": args.batch, "median_step_time_s": step, "host_overhead_per_group_per_step_s": overhead,
                       "peak_memory_bytes": peak})
            );
        } else {
            println!(
                "{world:>6} {:>7} {:>14.3} {:>22.2} {:>16.1}",
                r.groups,
                step * 1e3,
                overhead * 1e6,
                peak as f64 / 1024.0
            );
        }
    }
    Ok(Outcome::Passed)
}
