//! The memory a `chorus train` run needs on this machine (every rank's
//! share of the model, its optimizer state, the gathered groups, the
//! activations and the data, and with `--async-save` the save's staged
//! copy), checked before anything is allocated. Sizes are saturating
//! ([`Sat`]), so no size a user gives overflows: the result is then "more
//! than any machine".

use chorus_train::models::llama::config::LlamaConfig;

use super::args::TrainArgs;
use crate::job::{ModelArg, OptimizerArg};
use crate::usage;

/// A byte or element count: saturating arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sat(u128);

impl Sat {
    fn of<T: TryInto<u128>>(n: T) -> Sat {
        Sat(n.try_into().unwrap_or(u128::MAX))
    }
}

impl std::ops::Add for Sat {
    type Output = Sat;
    fn add(self, o: Sat) -> Sat {
        Sat(self.0.saturating_add(o.0))
    }
}

impl std::ops::Mul for Sat {
    type Output = Sat;
    fn mul(self, o: Sat) -> Sat {
        Sat(self.0.saturating_mul(o.0))
    }
}

impl std::ops::Div for Sat {
    type Output = Sat;
    fn div(self, o: Sat) -> Sat {
        Sat(self.0.checked_div(o.0).unwrap_or(u128::MAX))
    }
}

/// The memory the run `args` describe needs, against the machine's (a
/// Llama from `--init-from` is checked once its config is read).
pub(super) fn check(args: &TrainArgs) -> anyhow::Result<()> {
    check_against(args, crate::size::available_memory())
}

/// [`check`] against `available` bytes of memory (`None`: unknown).
fn check_against(args: &TrainArgs, available: Option<u128>) -> anyhow::Result<()> {
    let job = &args.job;
    match job.model() {
        ModelArg::Mlp => check_mlp(args, available),
        ModelArg::Gpt | ModelArg::Moe => check_gpt(args, available),
        // Checked once, when the config, the tokenizer's vocabulary and the data's size are known and before the
        // data is read or tokenized (`llama::spec`): two checks would give two answers (the second one with more
        // of this process's address space mapped).
        ModelArg::Llama if job.init_from.is_some() || job.tokenizer.is_some() || job.data.is_some() => Ok(()),
        ModelArg::Llama => check_llama_against(args, &job.llama_config(), job.seq_len(), 0, available),
    }
}

/// The bytes the run needs at `args`' world (`needed`, and `staged` for
/// `--async-save`'s copy) against `available` bytes of memory, and the
/// ranks' threads against the process's limits (where the ranks are this
/// process's threads). `needed` gives the bytes for any world size, so the
/// largest world a limit allows is found by the same count.
fn against_machine(
    args: &TrainArgs,
    available: Option<u128>,
    staged: Sat,
    needed: impl Fn(Sat) -> Sat,
) -> anyhow::Result<()> {
    let needed = |world: Sat| needed(world) + staged;
    let (what, hint) = match staged.0 {
        0 => ("this run".to_string(), "make the model, batch, world or --steps smaller"),
        bytes => (
            format!(
                "this run (with {}: --async-save's staged copy, one more copy of every rank's share of the \
                 parameters and optimizer state in host memory)",
                about(bytes)
            ),
            "make the model, batch, world or --steps smaller, or save without --async-save",
        ),
    };
    crate::size::check_memory_against(needed(Sat::of(args.world())).0, available, &what, hint).map_err(usage)?;
    if args.backend.runs_as_processes() {
        return Ok(());
    }
    super::ranks::check_thread_limits(args.world(), &|w| needed(Sat::of(w)).0).map_err(usage)
}

/// "about 1.5 GiB", "about 19.1 MiB".
fn about(bytes: u128) -> String {
    let (scale, unit) = if bytes >= 1 << 30 { (1u128 << 30, "GiB") } else { (1 << 20, "MiB") };
    match bytes as f64 / scale as f64 {
        n if n < 1e6 => format!("about {n:.1} {unit}"),
        _ => "more than a million GiB".to_string(),
    }
}

/// The bytes of `--async-save`'s staged copies on this machine (none
/// without it): at a save every rank copies its shard of the parameters
/// (`params` of them over the world, in f32) and its optimizer's moments
/// to host memory, one save at a time. Under HSDP only the first replica
/// writes, whose ranks' shards are again the whole model.
fn staged_copy(args: &TrainArgs, params: Sat) -> Sat {
    if !args.async_save {
        return Sat(0);
    }
    let moments = match args.job.optimizer_arg() {
        OptimizerArg::Adamw => 2,
        OptimizerArg::Sgd if args.job.momentum != 0.0 => 1,
        OptimizerArg::Sgd => 0,
    };
    Sat(4) * Sat(1 + moments) * params
}

/// The MLP's run: every rank's parameters, gradients, optimizer state and
/// activations, and the data (the init dir's sizes are checked again once
/// its headers are read).
fn check_mlp(args: &TrainArgs, available: Option<u128>) -> anyhow::Result<()> {
    let job = &args.job;
    let dims: Vec<Sat> = match (&job.dims, job.layers, job.width) {
        (Some(d), _, _) => d.iter().map(|v| Sat::of(*v)).collect(),
        (None, Some(l), Some(w)) => vec![Sat::of(w); l + 1],
        _ if job.init_dir.is_some() => return Ok(()),
        _ => [16, 64, 64, 4].map(Sat::of).to_vec(),
    };
    let params = dims.windows(2).fold(Sat(0), |acc, w| acc + w[0] * w[1] + w[1]);
    let widest = dims.iter().map(|d| d.0).max().map_or(Sat(0), Sat);
    let (batch, steps) = (Sat::of(job.batch), Sat::of(args.steps()));
    let batches = Sat::of(args.steps().clamp(1, 16));
    let width_sum = dims.iter().fold(Sat(0), |a, d| a + *d);
    // The MLP saves no checkpoints (`--async-save` is refused with it).
    against_machine(args, available, Sat(0), |world| {
        let data = batches * world * batch * (dims[0] + dims[dims.len() - 1]) * Sat(4);
        let per_rank = Sat(4) * (Sat(4) * params / world + Sat(3) * params + Sat(4) * batch * width_sum)
            + Sat(16) * steps
            + Sat(8) * widest;
        data + world * per_rank + Sat(8) * params
    })
}

/// The transformer's run (`--model gpt`, or `moe` with its router and
/// experts): groups that keep their graphs hold candle's copy of their
/// parameters until backward.
fn check_gpt(args: &TrainArgs, available: Option<u128>) -> anyhow::Result<()> {
    let job = &args.job;
    let moe = job.model() == ModelArg::Moe;
    let cfg = job.gpt_config();
    let experts = if moe { job.moe_config().experts } else { 1 };
    let (v, d, l, f, t) =
        (Sat::of(cfg.vocab), Sat::of(cfg.d_model), Sat::of(cfg.layers), Sat::of(cfg.d_ff), Sat::of(cfg.seq_len));
    // moe: the router (experts × d) and each expert's MLP; the front and combine stages' outputs.
    let (e, router) = (Sat::of(experts), if moe { Sat::of(experts) * d } else { Sat(0) });
    let params = Sat(2) * v * d + d + l * (Sat(4) * d * d + e * Sat(2) * d * f + Sat(2) * d + router);
    let tokens = Sat::of(job.batch) * t;
    let heads = Sat::of(cfg.heads);
    let routing = if moe { Sat(6) * d + Sat(2) * e } else { Sat(0) };
    let activations =
        Sat(4) * tokens * (l + Sat(2)) * (Sat(8) * d + Sat(2) * f + Sat(3) * heads * t + Sat(3) * v + routing);
    let kept = if args.recompute() == chorus_fsdp_candle::Recompute::All { Sat(0) } else { Sat(4) * params };
    let steps = Sat(16) * Sat::of(args.steps());
    against_machine(args, available, staged_copy(args, params), |world| {
        let per_rank = Sat(4) * (Sat(4) * params / world + Sat(4) * params) + kept + activations + steps;
        world * per_rank + Sat(4 << 20)
    })
}

/// The Llama's run of `cfg` on sequences of `seq_len` tokens, with
/// `data_bytes` of token rows held in memory.
pub(super) fn check_llama(args: &TrainArgs, cfg: &LlamaConfig, seq_len: usize, data_bytes: u128) -> anyhow::Result<()> {
    check_llama_against(args, cfg, seq_len, data_bytes, crate::size::available_memory())
}

/// [`check_llama`] against `available` bytes of memory.
fn check_llama_against(
    args: &TrainArgs,
    cfg: &LlamaConfig,
    seq_len: usize,
    data_bytes: u128,
    available: Option<u128>,
) -> anyhow::Result<()> {
    let params = Sat::of(cfg.num_params());
    let (v, h, l, f) = (
        Sat::of(cfg.vocab_size),
        Sat::of(cfg.hidden_size),
        Sat::of(cfg.num_hidden_layers),
        Sat::of(cfg.intermediate_size),
    );
    let tokens = Sat::of(args.job.batch) * Sat::of(seq_len);
    let heads = Sat::of(cfg.num_attention_heads);
    let t = Sat::of(seq_len);
    let activations = Sat(4) * tokens * (l + Sat(2)) * (Sat(10) * h + Sat(4) * f + Sat(3) * heads * t + Sat(3) * v);
    let steps = Sat(16) * Sat::of(args.steps());
    against_machine(args, available, staged_copy(args, params), |world| {
        let per_rank = Sat(4) * (Sat(4) * params / world + Sat(3) * params) + activations + steps;
        world * per_rank + Sat(4 << 20) + Sat(data_bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    fn args(line: &str) -> TrainArgs {
        Cli::try_parse_from(std::iter::once("train").chain(line.split_whitespace())).unwrap().train
    }

    /// The least memory (bytes available) the check lets `args` run in.
    fn least_memory(args: &TrainArgs) -> u128 {
        let (mut refused, mut fits) = (0u128, 1u128 << 60);
        assert!(check_against(args, Some(fits)).is_ok());
        while fits - refused > 1 {
            let mid = refused + (fits - refused) / 2;
            match check_against(args, Some(mid)) {
                Ok(()) => fits = mid,
                Err(_) => refused = mid,
            }
        }
        fits
    }

    /// `--async-save` adds one copy of every rank's share of the parameters
    /// and the optimizer's moments: a run that fits without it and not with
    /// it is refused up front, the message naming the staged copy.
    #[test]
    fn the_asynchronous_saves_staged_copy_is_counted() {
        let base = "--model gpt --d-model 256 --layers 4 --seq-len 64 --world-size 2 --steps 16 --save-every 4";
        let (blocking, staged) = (args(base), args(&format!("{base} --async-save")));
        let (without, with) = (least_memory(&blocking), least_memory(&staged));
        // AdamW: the parameters and two moments, in f32; the check keeps a tenth of the memory free.
        let params = blocking.job.gpt_config().num_params() as u128;
        let copy = 12 * params;
        assert!((with - without).abs_diff(copy * 10 / 9) <= 20, "{with} - {without} for a copy of {copy} bytes");
        let between = Some(without + (with - without) / 2);
        assert!(check_against(&blocking, between).is_ok());
        let refused = check_against(&staged, between).unwrap_err().to_string();
        assert!(refused.contains("--async-save's staged copy"), "{refused}");
        assert!(refused.contains(&format!("(with {}: ", about(copy))), "{refused}");
        assert!(refused.contains("or save without --async-save"), "{refused}");
        // Plain SGD has no moments: the copy is the parameters alone.
        let sgd = format!("{base} --optimizer sgd --async-save");
        let sgd_copy = least_memory(&args(&sgd)) - least_memory(&args(&format!("{base} --optimizer sgd")));
        assert!(sgd_copy.abs_diff(4 * params * 10 / 9) <= 20, "{sgd_copy}");
        // The Llama's runs count it too.
        let llama = "--model llama --d-model 64 --layers 2 --seq-len 32 --world-size 2 --save-every 4";
        assert!(least_memory(&args(&format!("{llama} --async-save"))) > least_memory(&args(llama)));
    }

    /// The largest sizes a user can give saturate instead of overflowing.
    #[test]
    fn a_huge_staged_copy_saturates() {
        let huge = args("--model gpt --d-model 4000000000 --layers 4000000000 --save-every 1 --async-save");
        let refused = check_against(&huge, Some(1 << 40)).unwrap_err().to_string();
        assert!(refused.contains("more than a million GiB"), "{refused}");
    }
}
