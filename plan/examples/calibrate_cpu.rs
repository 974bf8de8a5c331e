//! Measures what the cpu model (`plan/src/cpu_model.rs`) needs on this
//! machine now, with one and with two candle threads (a part of its own per
//! thread count, as `chorus train` sizes candle's pool once per process):
//! candle's f32 matmul and batched attention matmul and its element-wise
//! throughput (microbenchmarks); its fixed cost per kernel and element-wise
//! rate in a training graph, and FSDP's host time per stream operation,
//! from short sharded runs of two calibration models of one family (`gpt`,
//! the default, or `llama`; never the bench's shape) on as many sim ranks
//! as share the cores at that thread count.
//!
//! `cargo run -p chorus-plan --example calibrate_cpu -- [--model gpt|llama]`
//!
//! Prints one JSON object per measurement, and last a line `{"cpu_rates":
//! …}` with `one_thread`, `two_threads` and `fsdp_op_s` of
//! [`CpuRates`](chorus_plan::cpu_model::CpuRates); `ci/cpu-plan-check.sh`
//! adds the sim's and the memcpy's rates from `chorus bench` and writes the
//! file `chorus plan --cpu-rates` reads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::Communicator;
use chorus_fsdp::OptimizerKind;
use chorus_plan::constant::ConstantRates;
use chorus_plan::cost::{CollectiveShape, CostModel, HostCost, Issuer, KernelCost, KernelKind};
use chorus_plan::cpu_model::{CpuModel, CpuRates, Rates, CORES};
use chorus_plan::decoder_cost::Framework;
use chorus_plan::run::{run, GroupSpec, ModelSpec, RunSpec};
use chorus_plan::workload::StageWork;
use chorus_plan::workload::{DecoderShape, RecomputeMode};
use chorus_train::decoder::{train_sharded, Data, TokenRows, TrainReport, TrainSpec};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::{self, LlamaModel};
use chorus_train::models::{gpt, DecoderGroups, DecoderModel};
use chorus_train::npy::Tokens;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Median seconds of `reps` runs of `f` after two warm-ups.
fn median_s(reps: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    f()?;
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// candle's rates with the threads of this process (`RAYON_NUM_THREADS`).
fn kernel_rates() -> Res<Rates> {
    let dev = Device::Cpu;
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    let mut gemm_rates = Vec::new();
    // Tokens × in → out: transformer projections of several widths.
    for (m, k, n) in [(256, 64, 64), (256, 64, 256), (256, 256, 64), (256, 64, 96), (512, 256, 256)] {
        let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        let s = median_s(50, || a.matmul(&w.t()?).map(|_| ()))?;
        let rate = 2.0 * (m * k * n) as f64 / s;
        println!("{{\"kind\":\"gemm\",\"m\":{m},\"k\":{k},\"n\":{n},\"threads\":\"{threads}\",\"seconds\":{s:.3e},\"flops_per_s\":{rate:.3e}}}");
        gemm_rates.push(rate);
    }
    // [b·h, s, hd] · [b·h, hd, s]: attention scores.
    let mut attn_rates = Vec::new();
    for (bh, s, hd) in [(32, 32, 16), (32, 64, 16), (64, 128, 32)] {
        let q = Tensor::randn(0f32, 1.0, (bh, s, hd), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (bh, hd, s), &dev)?;
        let t = median_s(50, || q.matmul(&k).map(|_| ()))?;
        let rate = 2.0 * (bh * s * s * hd) as f64 / t;
        println!("{{\"kind\":\"attention\",\"bh\":{bh},\"s\":{s},\"hd\":{hd},\"threads\":\"{threads}\",\"seconds\":{t:.3e},\"flops_per_s\":{rate:.3e}}}");
        attn_rates.push(rate);
    }
    // x + y reads two and writes one: 12 bytes an element.
    let add_rate = |n: usize, reps: usize| -> Res<f64> {
        let x = Tensor::randn(0f32, 1.0, n, &dev)?;
        let y = Tensor::randn(0f32, 1.0, n, &dev)?;
        let s = median_s(reps, || (&x + &y).map(|_| ()))?;
        println!("{{\"kind\":\"elementwise\",\"elements\":{n},\"threads\":\"{threads}\",\"seconds\":{s:.3e},\"bytes_per_s\":{:.3e}}}", (12 * n) as f64 / s);
        Ok((12 * n) as f64 / s)
    };
    // 4 Mi floats stream from memory; 64 Ki floats (768 KiB moved) stay in cache.
    let memory_bytes_per_s = add_rate(1 << 22, 20)?;
    let cached_bytes_per_s = add_rate(1 << 16, 200)?;
    Ok(Rates {
        gemm_flops_per_s: median(gemm_rates),
        attention_flops_per_s: median(attn_rates),
        memory_bytes_per_s,
        cached_bytes_per_s,
        op_overhead_s: 0.0,
    })
}

/// One thread count's part: the rates, its fixed cost per kernel fitted
/// on the calibration transformer, and FSDP's host time per operation.
#[derive(serde::Serialize, serde::Deserialize)]
struct Part {
    rates: Rates,
    fsdp_op_s: f64,
}

/// The part run in this process: `ranks` sim ranks share the cores, with
/// the candle threads `RAYON_NUM_THREADS` gives each.
fn part(ranks: usize, family: &str) -> Res<Part> {
    let mut rates = kernel_rates()?;
    // Each calibration transformer's candle time per step is modelled as
    // its GEMMs and attention at the measured rates, plus a fixed cost per
    // kernel, plus its element-wise bytes at one rate: two unknowns, fitted
    // on the two shapes (candle's element-wise kernels — softmax, GELU,
    // layer norm, the head reshapes — are far slower than `x + y`).
    let cpu = CpuRates { one_thread: rates, two_threads: rates, ..CpuRates::frozen() };
    let bare = CpuModel::from_rates(&cpu, 1);
    let mut rows = Vec::new();
    let mut fsdp_op = Vec::new();
    for cal in cals(family)? {
        let (compute, fsdp_cpu) = calibration_run(&cal, ranks)?;
        let work = cal.work();
        let all = || work.iter().flat_map(|s| s.forward.iter().chain(&s.backward));
        let arith: f64 = all().filter(|k| k.kind != KernelKind::MemoryBound).map(|k| arith_s(&bare, k)).sum();
        let bytes: f64 = all().filter(|k| k.kind == KernelKind::MemoryBound).map(|k| k.bytes).sum();
        let count = all().count() as f64;
        let ops = fsdp_ops_per_step(&cal, ranks)?;
        println!(
            "{{\"kind\":\"calibration\",\"ranks\":{ranks},\"d_model\":{},\"layers\":{},\"kernels\":{count},\"arith_s\":{arith:.3e},\"elementwise_bytes\":{bytes:.3e},\"candle_compute_s\":{compute:.3e},\"fsdp_ops_per_step\":{ops},\"fsdp_cpu_per_step_s\":{fsdp_cpu:.3e}}}",
            cal.shape().d_model,
            cal.shape().layers
        );
        rows.push((compute - arith, count, bytes));
        if ops > 0.0 {
            fsdp_op.push(fsdp_cpu / ops);
        }
    }
    // rest = count·o + bytes/bw for both shapes: Cramer's rule.
    let [(r1, n1, b1), (r2, n2, b2)] = [rows[0], rows[1]];
    let det = n1 * b2 - n2 * b1;
    let (mut o, mut inv_bw) =
        if det.abs() > 0.0 { ((r1 * b2 - r2 * b1) / det, (n1 * r2 - n2 * r1) / det) } else { (0.0, 0.0) };
    if o < 1e-7 {
        // A kernel is never free: with a floor of 0.1 µs per kernel, the
        // rate alone is fitted (least squares over the two shapes).
        o = 1e-7;
        inv_bw = ((r1 - n1 * o) * b1 + (r2 - n2 * o) * b2) / (b1 * b1 + b2 * b2).max(f64::MIN_POSITIVE);
    }
    // A rate that noise made non-positive falls back to the microbenchmark's.
    rates.op_overhead_s = o;
    if inv_bw > 0.0 {
        rates.cached_bytes_per_s = 1.0 / inv_bw;
        rates.memory_bytes_per_s = rates.memory_bytes_per_s.min(rates.cached_bytes_per_s);
    }
    println!(
        "{{\"kind\":\"fit\",\"ranks\":{ranks},\"op_overhead_s\":{:.3e},\"elementwise_bytes_per_s\":{:.3e}}}",
        rates.op_overhead_s, rates.cached_bytes_per_s
    );
    Ok(Part { rates, fsdp_op_s: median(fsdp_op) })
}

/// A kernel's arithmetic time at `model`'s rates, without a fixed cost.
fn arith_s(model: &CpuModel, k: &KernelCost) -> f64 {
    let r = &model.rates;
    match k.kind {
        KernelKind::Gemm => k.flops / r.gemm_flops_per_s,
        KernelKind::Attention => k.flops / r.attention_flops_per_s,
        KernelKind::MemoryBound => 0.0,
    }
}

/// Runs this program's part with `threads` candle threads (on `CORES /
/// threads` ranks, as `chorus train` shares the cores); its last line.
fn kernel_part(threads: usize, family: &str) -> Res<Part> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .args(["--part", &(CORES / threads).max(1).to_string(), family])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("the {threads}-thread part failed ({})", out.status).into());
    }
    let text = String::from_utf8(out.stdout)?;
    print!("{text}");
    let last = text.lines().last().ok_or("the part printed nothing")?;
    Ok(serde_json::from_str(last)?)
}

/// Counts the stream operations FSDP issues (the host costs asked for).
#[derive(Debug)]
struct Counting {
    inner: ConstantRates,
    fsdp_ops: AtomicUsize,
}

impl CostModel for Counting {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        self.inner.kernel_seconds(k)
    }
    fn collective_seconds(&self, s: &CollectiveShape) -> f64 {
        self.inner.collective_seconds(s)
    }
    fn copy_seconds(&self, b: u64, f: chorus_devices::MemorySpace, t: chorus_devices::MemorySpace) -> f64 {
        self.inner.copy_seconds(b, f, t)
    }
    fn peak_flops(&self) -> Option<f64> {
        None
    }
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        // The operations FSDP issues, its optimizer steps among them (the cpu model prices both alike).
        if matches!(issuer, Issuer::Fsdp | Issuer::Optimizer) {
            self.fsdp_ops.fetch_add(1, Ordering::Relaxed);
        }
        HostCost::default()
    }
}

/// A calibration model: its configuration and sequences per rank.
enum Cal {
    Gpt(gpt::GptConfig, usize),
    Llama(Arc<LlamaConfig>, usize, usize),
}

/// The calibration models of a family (`chorus train --model gpt|llama`):
/// two shapes each, neither the bench's (gpt d_model 64 × 2 blocks, 4
/// heads, d_ff 256; llama hidden 64 × 2 layers, 4 heads, 2 kv, 128; both 8
/// × 32 tokens per rank).
fn cals(family: &str) -> Res<Vec<Cal>> {
    let llama = |hidden, inter, layers, heads, kv, batch, seq| {
        Cal::Llama(Arc::new(LlamaConfig::new(40, hidden, inter, layers, heads, kv)), batch, seq)
    };
    Ok(match family {
        "gpt" => vec![
            Cal::Gpt(gpt::GptConfig { vocab: 40, d_model: 48, layers: 3, heads: 3, d_ff: 96, seq_len: 24 }, 6),
            Cal::Gpt(gpt::GptConfig { vocab: 40, d_model: 96, layers: 2, heads: 6, d_ff: 384, seq_len: 48 }, 8),
        ],
        "llama" => vec![llama(48, 96, 3, 4, 2, 6, 24), llama(96, 192, 2, 6, 2, 8, 48)],
        other => return Err(format!("unknown model family `{other}`: gpt or llama").into()),
    })
}

impl Cal {
    fn batch(&self) -> usize {
        match self {
            Cal::Gpt(_, b) | Cal::Llama(_, b, _) => *b,
        }
    }
    fn seq(&self) -> usize {
        match self {
            Cal::Gpt(c, _) => c.seq_len,
            Cal::Llama(_, _, s) => *s,
        }
    }
    fn shape(&self) -> DecoderShape {
        match self {
            Cal::Gpt(c, _) => DecoderShape::from(c),
            Cal::Llama(c, ..) => DecoderShape::from(&**c),
        }
    }
    fn groups(&self) -> Res<DecoderGroups> {
        Ok(match self {
            Cal::Gpt(c, _) => gpt::groups(c)?,
            Cal::Llama(c, ..) => llama::groups(c)?,
        })
    }
    /// Its kernels as the planner counts them (candle's, f32, every group recomputed).
    fn work(&self) -> Vec<StageWork> {
        Framework::Candle.decoder_work(&self.shape(), self.batch(), self.seq(), 4, RecomputeMode::Full)
    }
}

/// FSDP stream operations per step of rank 0 of the calibration model on
/// `ranks` ranks: a plan of two steps less a plan of one.
fn fsdp_ops_per_step(cal: &Cal, ranks: usize) -> Res<f64> {
    let groups = cal.groups()?;
    let specs =
        groups.groups.iter().map(|g| GroupSpec { name: g.name.clone(), params: g.params.clone(), root: g.root });
    let model = ModelSpec::decoder(specs.collect(), groups.embed, groups.head, cal.work())?;
    let count = |steps: usize| -> Res<usize> {
        let cost = Arc::new(Counting { inner: ConstantRates::round(), fsdp_ops: AtomicUsize::new(0) });
        run(&model, &RunSpec::new(ranks, steps), cost.clone())?;
        Ok(cost.fsdp_ops.load(Ordering::Relaxed) / ranks)
    };
    Ok(count(2)? as f64 - count(1)? as f64)
}

/// The calibration transformer on `ranks` sim ranks (12 steps, three
/// runs): rank 0's candle time per step and its FSDP hooks' CPU time per
/// step, each the median over the runs.
fn calibration_run(cal: &Cal, ranks: usize) -> Res<(f64, f64)> {
    let steps = 12;
    let (mut compute, mut fsdp) = (Vec::new(), Vec::new());
    for run in 0..3 {
        let (batch, seq) = (cal.batch(), cal.seq());
        let global = batch * ranks;
        let rows = 2 * global;
        let v = cal.shape().vocab;
        let ids = (0..rows * (seq + 1)).map(|i| ((i * 7919 + i / 3) % v) as u32).collect();
        let data = Arc::new(Data::Tokens(TokenRows::new(Tokens::from_ids(rows, seq + 1, ids)?, v, global)?));
        let opt = OptimizerKind::adamw(1e-3, 0.01);
        let r = match cal {
            Cal::Gpt(c, _) => {
                let model = gpt::GptModel { config: *c, init: gpt::init_params(c, 3)? };
                on_ranks(ranks, TrainSpec::new(model, data, batch, steps, opt))?
            }
            Cal::Llama(c, ..) => {
                let model = LlamaModel { config: c.clone(), init: llama::init_params(c, 5) };
                on_ranks(ranks, TrainSpec::new(model, data, batch, steps, opt))?
            }
        };
        let r = &r;
        let c = r.adapter.compute.as_secs_f64() / steps as f64;
        let f = r.overhead.cpu.as_secs_f64() / steps as f64;
        println!("{{\"kind\":\"calibration_run\",\"ranks\":{ranks},\"run\":{run},\"candle_compute_per_step_s\":{c:.3e},\"fsdp_cpu_per_step_s\":{f:.3e}}}");
        compute.push(c);
        fsdp.push(f);
    }
    Ok((median(compute), median(fsdp)))
}

/// Trains `spec` on `ranks` sim ranks; rank 0's report.
fn on_ranks<M: DecoderModel + 'static>(ranks: usize, spec: TrainSpec<M>) -> Res<TrainReport> {
    let spec = Arc::new(spec);
    let world = SimWorld::new(ranks, SimConfig { timeout: Duration::from_secs(60), ..SimConfig::default() })?;
    let mut handles = Vec::new();
    for r in 0..ranks {
        let comm = Arc::new(Communicator::new(world.communicator(r)?.into_backend()));
        let spec = spec.clone();
        handles.push(std::thread::spawn(move || train_sharded(comm, &spec, &mut |_, _| {}).map_err(|e| e.to_string())));
    }
    let mut reports = Vec::new();
    for h in handles {
        reports.push(h.join().map_err(|_| "a rank panicked")??);
    }
    reports.into_iter().next().ok_or_else(|| "no ranks".into())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, ranks, family] = args.as_slice() {
        if flag == "--part" {
            let part = part(ranks.parse()?, family)?;
            println!("{}", serde_json::to_string(&part)?);
            return Ok(());
        }
    }
    let family = match args.as_slice() {
        [] => "gpt".to_string(),
        [flag, family] if flag == "--model" => family.clone(),
        _ => return Err(format!("usage: calibrate_cpu [--model gpt|llama]; got {args:?}").into()),
    };
    cals(&family)?;
    let one = kernel_part(1, &family)?;
    let two = kernel_part(2, &family)?;
    // FSDP's time per operation, from both runs: the larger rank count issues more.
    let fsdp_op_s = (one.fsdp_op_s + two.fsdp_op_s) / 2.0;
    let (one_thread, two_threads) = (one.rates, two.rates);
    println!(
        "{}",
        serde_json::json!({ "cpu_rates": { "one_thread": one_thread, "two_threads": two_threads, "fsdp_op_s": fsdp_op_s } })
    );
    Ok(())
}
