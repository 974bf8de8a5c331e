//! FSDP's host path per group and step, measured alone: the hooks of a
//! training step (pre/post forward per group, pre/post backward in reverse,
//! finalize, the optimizer step, `zero_grad`) on groups shaped like a
//! model's, with no model compute, so what is timed is FSDP's own host work.
//! Prints µs per group and step by hook (wall and the thread's CPU time), the
//! optimizer's host time per step, and the device calls per group and step
//! by name — on the cpu device the operations FSDP enqueues, events and
//! allocations; on the cuda device the CUDA driver calls
//! ([`Device::count_calls`]) — then one JSON line.
//!
//! ```sh
//! cargo run --example host_path -p chorus-fsdp -- --shape llama-110m                     # sim, 1 rank
//! cargo run --example host_path -p chorus-fsdp --features nccl -- --backend nccl           # one GPU
//! # --shape mlp (64 groups of Linear(64): weight and bias), --world-size N (sim),
//! # --param-dtype f32|bf16, --steps, --warmup, --max-us (exit 1 above this many µs per group and step)
//! ```
//!
//! The 110M Llama's groups (`--shape llama-110m`, the default) are
//! torchtitan's grouping of `chorus train --model llama --layers 12 --heads
//! 12 --kv-heads 12 --hidden 768 --intermediate 2048 --vocab 16000`: the
//! embedding, each decoder layer (q, k, v, o, gate, up, down, two norms),
//! and the final norm with the untied head as the root group.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::{DType, Device};
use chorus_fsdp::{
    DataParallel, DeferredParam, Fsdp, FsdpConfig, Hook, MixedPrecision, OptimizerKind, ShardSource, ShardedOptimizer,
};

/// A parameter of `shape` whose every value is `value`, read by rows as
/// FSDP asks (nobody holds the whole of it).
fn param(name: &str, shape: &[usize], value: f32) -> DeferredParam {
    struct Rows {
        shape: Vec<usize>,
        value: f32,
    }
    impl ShardSource for Rows {
        fn read_rows(&self, dim: usize, rows: Range<usize>) -> Result<Vec<f32>, String> {
            let outer: usize = self.shape[..dim.min(self.shape.len())].iter().product();
            let inner: usize = self.shape.get(dim + 1..).map_or(1, |s| s.iter().product());
            Ok(vec![self.value; outer * rows.len() * inner])
        }
    }
    DeferredParam {
        name: name.to_string(),
        shape: shape.to_vec(),
        source: Arc::new(Rows { shape: shape.to_vec(), value }),
    }
}

/// The groups of a model shape: (name, parameters, root).
fn groups(shape: &str) -> Result<Vec<(String, Vec<DeferredParam>, bool)>, String> {
    match shape {
        "llama-110m" => {
            let (hidden, inter, vocab, layers) = (768, 2048, 16000, 12);
            let mut out =
                vec![("embed".to_string(), vec![param("embed_tokens.weight", &[vocab, hidden], 0.01)], false)];
            for l in 0..layers {
                let p = |n: &str, s: &[usize]| param(&format!("layers.{l}.{n}"), s, 0.02);
                let params = vec![
                    p("self_attn.q_proj.weight", &[hidden, hidden]),
                    p("self_attn.k_proj.weight", &[hidden, hidden]),
                    p("self_attn.v_proj.weight", &[hidden, hidden]),
                    p("self_attn.o_proj.weight", &[hidden, hidden]),
                    p("mlp.gate_proj.weight", &[inter, hidden]),
                    p("mlp.up_proj.weight", &[inter, hidden]),
                    p("mlp.down_proj.weight", &[hidden, inter]),
                    p("input_layernorm.weight", &[hidden]),
                    p("post_attention_layernorm.weight", &[hidden]),
                ];
                out.push((format!("layers.{l}"), params, false));
            }
            let head = vec![param("norm.weight", &[hidden], 1.0), param("lm_head.weight", &[vocab, hidden], 0.01)];
            out.push(("head".to_string(), head, true));
            Ok(out)
        }
        "mlp" => Ok((0..64)
            .map(|l| {
                let params =
                    vec![param(&format!("{l}.weight"), &[64, 64], 0.1), param(&format!("{l}.bias"), &[64], 0.0)];
                (format!("layer{l}"), params, l == 63)
            })
            .collect()),
        other => Err(format!("unknown --shape {other} (llama-110m or mlp)")),
    }
}

#[derive(Clone, Debug)]
struct Args {
    backend: String,
    world_size: usize,
    shape: String,
    param_dtype: DType,
    steps: usize,
    warmup: usize,
    max_us: Option<f64>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        backend: "sim".into(),
        world_size: 1,
        shape: "llama-110m".into(),
        param_dtype: DType::BF16,
        steps: 20,
        warmup: 3,
        max_us: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => a.backend = value()?,
            "--world-size" => a.world_size = value()?.parse().map_err(|e| format!("--world-size: {e}"))?,
            "--shape" => a.shape = value()?,
            "--param-dtype" => {
                a.param_dtype = match value()?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    other => return Err(format!("--param-dtype {other}: f32 or bf16")),
                }
            }
            "--steps" => a.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--warmup" => a.warmup = value()?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "--max-us" => a.max_us = Some(value()?.parse().map_err(|e| format!("--max-us: {e}"))?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.steps == 0 || a.world_size == 0 {
        return Err("--steps and --world-size must be at least 1".into());
    }
    Ok(a)
}

/// Calls by name, added up.
type Calls = BTreeMap<&'static str, u64>;

fn add(total: &mut Calls, from: &[(&'static str, u64)], to: &[(&'static str, u64)]) {
    for (name, n) in to {
        let before = from.iter().find(|(m, _)| m == name).map_or(0, |(_, k)| *k);
        *total.entry(name).or_default() += n - before.min(*n);
    }
}

/// What one rank measured.
struct Measured {
    groups: usize,
    steps: usize,
    overhead: chorus_fsdp::HostOverhead,
    optimizer: Duration,
    hook_calls: Option<Calls>,
    optimizer_calls: Option<Calls>,
    collectives: chorus_fsdp::CommCounts,
}

fn run_rank<C: CommBackend>(comm: Communicator<C>, args: &Args) -> Result<Measured, String>
where
    C::B: chorus_devices::ComputeBackend,
{
    let err = |e: chorus_fsdp::FsdpError| e.to_string();
    let mp =
        MixedPrecision { param_dtype: Some(args.param_dtype), reduce_dtype: Some(DType::F32), ..Default::default() };
    let config = FsdpConfig { mixed_precision: mp, ..FsdpConfig::default() };
    let mut fsdp = Fsdp::new(DataParallel::fsdp(Arc::new(comm)), config).map_err(err)?;
    for (name, params, root) in groups(&args.shape)? {
        fsdp.add_group_deferred(&name, params, root).map_err(err)?;
    }
    let n = fsdp.num_groups();
    let mut opt = ShardedOptimizer::new(OptimizerKind::adamw(1e-4, 0.01));
    let device = fsdp.device().clone();
    let mut step = |fsdp: &mut Fsdp<C>, counting: bool| -> Result<(Duration, Calls, Calls), String> {
        let mut hook_calls = Calls::new();
        let at_start = device.call_counts();
        for g in 0..n {
            fsdp.pre_forward(g).map_err(err)?;
            fsdp.post_forward(g).map_err(err)?;
        }
        for g in (0..n).rev() {
            fsdp.pre_backward(g).map_err(err)?;
            fsdp.post_backward(g).map_err(err)?;
        }
        fsdp.finalize_backward().map_err(err)?;
        let after_hooks = device.call_counts();
        let t0 = Instant::now();
        opt.step(fsdp).map_err(err)?;
        fsdp.zero_grad();
        let optimizer = t0.elapsed();
        let mut opt_calls = Calls::new();
        if counting {
            add(&mut hook_calls, &at_start, &after_hooks);
            add(&mut opt_calls, &after_hooks, &device.call_counts());
        }
        // Each step ends on the device, so queued work never piles up behind the host.
        fsdp.synchronize().map_err(err)?;
        Ok((optimizer, hook_calls, opt_calls))
    };
    for _ in 0..args.warmup {
        step(&mut fsdp, false)?;
    }
    let counting = device.count_calls(true);
    let (before, collectives_before) = (fsdp.host_overhead(), fsdp.comm_counts());
    let (mut optimizer, mut hook_calls, mut optimizer_calls) = (Duration::ZERO, Calls::new(), Calls::new());
    for _ in 0..args.steps {
        let (o, h, c) = step(&mut fsdp, counting)?;
        optimizer += o;
        for (k, v) in h {
            *hook_calls.entry(k).or_default() += v;
        }
        for (k, v) in c {
            *optimizer_calls.entry(k).or_default() += v;
        }
    }
    device.count_calls(false);
    let after = fsdp.comm_counts();
    let collectives = chorus_fsdp::CommCounts {
        all_gathers: after.all_gathers - collectives_before.all_gathers,
        reduce_scatters: after.reduce_scatters - collectives_before.reduce_scatters,
        all_reduces: after.all_reduces - collectives_before.all_reduces,
    };
    Ok(Measured {
        groups: n,
        steps: args.steps,
        overhead: fsdp.host_overhead().since(&before),
        optimizer,
        hook_calls: counting.then_some(hook_calls),
        optimizer_calls: counting.then_some(optimizer_calls),
        collectives,
    })
}

fn report(args: &Args, device: &str, m: &Measured) -> f64 {
    let per = (m.groups * m.steps) as f64;
    let us = |d: Duration| d.as_secs_f64() * 1e6 / per;
    let total = us(m.overhead.total);
    println!(
        "FSDP host path: {} ({} groups), {} param dtype, {} on {device}, {} measured steps",
        args.shape, m.groups, args.param_dtype, args.backend, m.steps
    );
    println!("{:<18} {:>12} {:>12} {:>8}", "hook", "µs/group/step", "cpu µs", "calls");
    for h in Hook::ALL.iter().filter(|h| m.overhead.hook(**h).calls > 0) {
        let t = m.overhead.hook(*h);
        println!("{:<18} {:>12.2} {:>12.2} {:>8}", h.name(), us(t.total), us(t.cpu), t.calls);
    }
    println!("{:<18} {:>12.2} {:>12.2}", "all hooks", total, us(m.overhead.cpu));
    let opt_us = m.optimizer.as_secs_f64() * 1e6 / m.steps as f64;
    println!("optimizer step + zero_grad: {opt_us:.1} µs per step ({:.2} per group)", opt_us / m.groups as f64);
    let c = m.collectives;
    println!(
        "collectives per group and step: {:.2} all-gathers, {:.2} reduce-scatters, {:.2} all-reduces",
        c.all_gathers as f64 / per,
        c.reduce_scatters as f64 / per,
        c.all_reduces as f64 / per
    );
    let calls_json = |calls: &Option<Calls>, label: &str| -> String {
        let Some(calls) = calls else {
            println!("{label}: this device does not count its calls");
            return "null".into();
        };
        let sum: u64 = calls.values().sum();
        println!("{label}: {:.1} per group and step", sum as f64 / per);
        for (name, n) in calls {
            println!("  {name:<28} {:>8.2}", *n as f64 / per);
        }
        let fields: Vec<String> = calls.iter().map(|(k, v)| format!("\"{k}\": {:.3}", *v as f64 / per)).collect();
        format!("{{{}}}", fields.join(", "))
    };
    let hooks = calls_json(&m.hook_calls, "device calls in hooks");
    let optimizer = calls_json(&m.optimizer_calls, "device calls in the optimizer step");
    let by_hook: Vec<String> = Hook::ALL
        .iter()
        .filter(|h| m.overhead.hook(**h).calls > 0)
        .map(|h| format!("\"{}\": {:.3}", h.name(), us(m.overhead.hook(*h).total)))
        .collect();
    println!(
        "{{\"bench\": \"fsdp_host_path\", \"shape\": \"{}\", \"backend\": \"{}\", \"device\": \"{device}\", \"groups\": {}, \"steps\": {}, \"param_dtype\": \"{}\", \"host_us_per_group_step\": {total:.3}, \"host_cpu_us_per_group_step\": {:.3}, \"by_hook_us_per_group_step\": {{{}}}, \"optimizer_us_per_step\": {opt_us:.3}, \"calls_per_group_step\": {hooks}, \"optimizer_calls_per_group_step\": {optimizer}}}",
        args.shape,
        args.backend,
        m.groups,
        m.steps,
        args.param_dtype,
        us(m.overhead.cpu),
        by_hook.join(", ")
    );
    total
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("host_path: {e}");
            std::process::exit(2);
        }
    };
    let measured = match args.backend.as_str() {
        "sim" => sim(&args),
        "nccl" => nccl(&args),
        other => Err(format!("unknown --backend {other} (sim or nccl)")),
    };
    match measured {
        Ok((device, m)) => {
            let us = report(&args, &device, &m);
            if let Some(max) = args.max_us {
                if us > max {
                    eprintln!("host_path: {us:.1} µs per group and step is above the limit of {max} µs");
                    std::process::exit(1);
                }
                println!("within the limit of {max} µs per group and step");
            }
        }
        Err(e) => {
            eprintln!("host_path: {e}");
            std::process::exit(1);
        }
    }
}

/// Every rank of a sim world; rank 0's measurement is reported.
fn sim(args: &Args) -> Result<(String, Measured), String> {
    use chorus_collectives::sim::{SimConfig, SimWorld};
    let a = args.clone();
    let config = SimConfig {
        // SAFETY: FSDP orders every cross-stream access with events, and the
        // conformance suite and `fsdp/tests/host_path.rs` run these very hooks
        // with the sanitizer on; timed without its per-operation bookkeeping,
        // as `chorus train` runs.
        device: unsafe { chorus_devices::cpu::CpuConfig::default().without_sanitizer() },
        ..SimConfig::default()
    };
    let results = SimWorld::run(args.world_size, config, move |comm| {
        let name = comm.device().name();
        run_rank(comm, &a).map(|m| (name, m))
    })
    .map_err(|e| e.to_string())?;
    results.into_iter().next().ok_or("no rank ran")?.map_err(|e| e.to_string())?
}

#[cfg(feature = "nccl")]
fn nccl(args: &Args) -> Result<(String, Measured), String> {
    use chorus_collectives::bootstrap::MemStore;
    use chorus_collectives::nccl::{NcclComm, NcclConfig};
    if args.world_size != 1 {
        return Err("--backend nccl runs one rank on GPU 0 (--world-size 1)".into());
    }
    let store = MemStore::new();
    let comm = NcclComm::init_on_ordinal(&store, 0, 1, 0, NcclConfig::default()).map_err(|e| e.to_string())?;
    let name = comm.device().name();
    run_rank(comm, args).map(|m| (name, m))
}

#[cfg(not(feature = "nccl"))]
fn nccl(_: &Args) -> Result<(String, Measured), String> {
    Err("built without the nccl feature (cargo run --example host_path -p chorus-fsdp --features nccl)".into())
}
