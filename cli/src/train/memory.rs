//! The memory a `chorus train` run needs on this machine (every rank's
//! share of the model, its optimizer state, the gathered groups, the
//! activations and the data), checked before anything is allocated. Sizes
//! are saturating ([`Sat`]), so no size a user gives overflows: the result
//! is then "more than any machine".

use chorus_train::models::llama::config::LlamaConfig;

use super::args::TrainArgs;
use crate::job::ModelArg;
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
    let job = &args.job;
    match job.model() {
        ModelArg::Mlp => check_mlp(args),
        ModelArg::Gpt | ModelArg::Moe => check_gpt(args),
        // Checked once, when the config, the tokenizer's vocabulary and the data's size are known and before the
        // data is read or tokenized (`llama::spec`): two checks would give two answers (the second one with more
        // of this process's address space mapped).
        ModelArg::Llama if job.init_from.is_some() || job.tokenizer.is_some() || job.data.is_some() => Ok(()),
        ModelArg::Llama => check_llama(args, &job.llama_config(), job.seq_len(), 0),
    }
}

/// The bytes the run needs at `args`' world against the machine's memory,
/// and the ranks' threads against the process's limits (where the ranks are
/// this process's threads). `needed` gives the bytes for any world size, so
/// the largest world a limit allows is found by the same count.
fn against_machine(args: &TrainArgs, needed: impl Fn(Sat) -> Sat) -> anyhow::Result<()> {
    crate::size::check_memory(
        needed(Sat::of(args.world())).0,
        "this run",
        "make the model, batch, world or --steps smaller",
    )
    .map_err(usage)?;
    if args.backend.runs_as_processes() {
        return Ok(());
    }
    super::ranks::check_thread_limits(args.world(), &|w| needed(Sat::of(w)).0).map_err(usage)
}

/// The MLP's run: every rank's parameters, gradients, optimizer state and
/// activations, and the data (the init dir's sizes are checked again once
/// its headers are read).
fn check_mlp(args: &TrainArgs) -> anyhow::Result<()> {
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
    against_machine(args, |world| {
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
fn check_gpt(args: &TrainArgs) -> anyhow::Result<()> {
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
    against_machine(args, |world| {
        let per_rank = Sat(4) * (Sat(4) * params / world + Sat(4) * params) + kept + activations + steps;
        world * per_rank + Sat(4 << 20)
    })
}

/// The Llama's run of `cfg` on sequences of `seq_len` tokens, with
/// `data_bytes` of token rows held in memory.
pub(super) fn check_llama(args: &TrainArgs, cfg: &LlamaConfig, seq_len: usize, data_bytes: u128) -> anyhow::Result<()> {
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
    against_machine(args, |world| {
        let per_rank = Sat(4) * (Sat(4) * params / world + Sat(3) * params) + activations + steps;
        world * per_rank + Sat(4 << 20) + Sat(data_bytes)
    })
}
