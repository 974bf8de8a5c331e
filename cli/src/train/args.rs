//! The arguments of `chorus train`: the job ([`JobArgs`], shared with
//! `chorus plan`) and the run's own (backend, steps, checkpoints, outputs,
//! the benchmark), and every check made before anything is written.

use std::path::PathBuf;

use chorus_devices::DType;
use chorus_fsdp_candle::Recompute;
use chorus_train::decoder::TrainSpec;

use super::loop_args::LoopArgs;
use crate::backends::Backend;
use crate::job::{JobArgs, ModelArg, RecomputeArg};
use crate::usage;

/// Why `--bench --model moe` is refused (`gpt_bench.rs` compares gpt and llama with plain candle).
pub(super) const NO_MOE_BENCH: &str = "--bench measures --model mlp, gpt and llama, not moe";

/// Arguments of `chorus train`.
#[derive(Clone, Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// The communication backend: sim or simnccl (ranks as threads of this process), ucx (one rank per process
    /// under a launcher), nccl or rccl (one rank per GPU); ucx, nccl and rccl in builds with those features.
    #[arg(long, default_value = "sim", value_parser = crate::backends::parse_backend)]
    pub backend: Backend,
    /// Training steps (default 300 for gpt, 20 for the gpt bench, 50 for mlp); with --resume, the step to stop before.
    #[arg(long)]
    pub steps: Option<u64>,
    /// gpt, llama: train on this text file instead of generated text (UTF-8, or else read as Latin-1; characters
    /// other than a-z, A-Z, space, '.' and newline become spaces).
    #[arg(long, conflicts_with = "data")]
    pub text: Option<PathBuf>,
    /// gpt, llama: save a sharded checkpoint every N steps (and at the end).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// gpt, llama: where checkpoints go (default <out-dir>-checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// gpt, llama: keep only the newest N checkpoints (never the one `latest` names nor the one resumed from).
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// gpt, llama: resume from a checkpoint directory (a step-* directory, or one with a `latest` file); `auto`:
    /// from this job's own newest checkpoint in --checkpoint-dir, starting fresh where there is none (a job that
    /// `chorus launch --max-restarts` starts again continues where it saved last).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// gpt, llama: write checkpoints while the training goes on: the step waits only while each rank copies its
    /// share of the training state to host memory (one copy more of it, at most one save in flight), not while the
    /// files are written; the checkpoint is complete (and `latest` names it) once every rank has written its files.
    #[arg(long)]
    pub async_save: bool,
    /// gpt, llama: start over in a --checkpoint-dir that holds another run's checkpoints, removing them (without
    /// it, a run that does not --resume from there is refused).
    #[arg(long)]
    pub overwrite_checkpoints: bool,
    /// gpt, llama: with --resume, continue with other optimizer settings (--lr, --momentum, --weight-decay) than the checkpoint's; the changes are reported.
    #[arg(long)]
    pub allow_optimizer_change: bool,
    /// Keep training when the loss is NaN or infinite (default: stop with an error).
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// Seed of the weights and data (mlp: when there is no --init-dir).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the results go (default out/train): what an earlier run wrote there is replaced when the run
    /// succeeds; a directory holding anything else is refused.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Benchmark instead of training: the mlp (default) at world sizes 1, 2, 4, 8 (step time, FSDP host
    /// overhead per group per step, peak memory), or with --model gpt the transformer through the candle
    /// adapter at --world-size ranks against plain single-process candle on the same global batch.
    #[arg(long)]
    pub bench: bool,
    /// With --bench: print one JSON object per row.
    #[arg(long)]
    pub json: bool,
    /// With --bench --model gpt: run one side of the comparison in this process and print its JSON (internal).
    #[arg(long, value_enum, hide = true)]
    pub bench_part: Option<BenchPart>,
    /// gpt, llama: one device's peak in TFLOP/s for MFU (default: known for H100, H200 and A100 GPUs; none for
    /// the CPU, whose MFU is then not given).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// gpt, moe, llama: time each kind of fused op (RMSNorm, RoPE, SwiGLU, attention, cross-entropy; forward and
    /// backward) in every step of rank 0: device time on the GPU (CUDA events), wall time on the CPU; into
    /// summary.json (`op_times`) and a line after the closing one. Off by default.
    #[arg(long)]
    pub op_times: bool,
    /// A job file (TOML) setting any of these flags by its long name (`steps = 100`, `world_size = 4`, at the top
    /// level or in tables); the command line wins. Every run writes its flags as config.toml in --out-dir, which
    /// `chorus plan --config` reads too.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The effective configuration, `config.toml`'s text (not a flag): set by [`TrainArgs::resolve`].
    #[arg(skip)]
    pub(crate) effective: Option<String>,
    /// What the summary says of this attempt of a job that a launcher
    /// restarts, or that `--resume auto` continues (not a flag): set by
    /// [`super::resume::resolve_auto`].
    #[arg(skip)]
    pub(crate) restart: Option<serde_json::Value>,
    #[command(flatten)]
    pub job: JobArgs,
    #[command(flatten)]
    pub llama: LlamaOutputArgs,
    #[command(flatten)]
    pub decoder: LoopArgs,
}

/// How `chorus train --model llama` writes the Hugging Face model.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct LlamaOutputArgs {
    /// llama: dtype of the Hugging Face model written at the end (f32 or bf16).
    #[arg(long, value_enum, default_value = "f32")]
    pub save_dtype: SaveDtypeArg,
    /// llama: start a new safetensors file when one would pass this size (K/M/G = 1024-based, or plain bytes).
    #[arg(long, default_value = "2G", value_parser = crate::size::parse_nonzero_bytes)]
    pub max_file_bytes: u64,
}

/// Dtypes `chorus train --model llama` writes the model in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SaveDtypeArg {
    /// float32.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
}

impl SaveDtypeArg {
    pub(crate) fn dtype(self) -> chorus_train::models::llama::hf::SaveDtype {
        match self {
            SaveDtypeArg::F32 => chorus_train::models::llama::hf::SaveDtype::F32,
            SaveDtypeArg::Bf16 => chorus_train::models::llama::hf::SaveDtype::BF16,
        }
    }
}

/// One side of `chorus train --bench --model gpt`, each run in a process of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchPart {
    /// Plain single-process candle on the global batch.
    Plain,
    /// FSDP through the candle adapter on simulated ranks.
    Fsdp,
}

/// The keys of a job file `chorus train` reads: every flag of its own, and
/// a plan's own flags (`gpus`, `gpu`, ...) passed over, as a plan passes over
/// the run's, so one job file trains and plans a job. (Import circle,
/// allowed: plan.rs names `TrainArgs` for the same reason.)
pub(crate) fn file_scope() -> crate::job::file::Scope {
    crate::job::file::Scope { takes: None, passes_over: Some(crate::plan::own_flags()) }
}

impl TrainArgs {
    /// This process's `chorus train` arguments, with `--config`'s file read
    /// and the defaults that depend on other flags filled in: the model
    /// (`--bench` measures the mlp) and the per-rank batch `--global-batch`
    /// gives.
    pub(super) fn resolve() -> anyhow::Result<TrainArgs> {
        use crate::job::file::{resolve_process, Resolved};
        let Resolved { args, effective } = resolve_process::<TrainArgs>("train", file_scope())?;
        args.filled(effective)
    }

    /// These arguments with `effective` and the defaults that depend on other flags filled in.
    pub(super) fn filled(mut self, effective: String) -> anyhow::Result<TrainArgs> {
        self.effective = Some(effective);
        if self.job.model.is_none() && self.bench {
            self.job.model = Some(ModelArg::Mlp);
        }
        // Under a launcher each rank is a process and the launcher knows the
        // world (it changes with `chorus launch --nnodes MIN:MAX`): it is the
        // run's unless --world-size is given, and one that disagrees is refused
        // before anything starts.
        if let Some(launched) = self.launched_world() {
            match self.job.world_size {
                None => self.job.world_size = Some(launched),
                Some(w) if w != launched => {
                    return Err(usage(format!(
                        "--world-size {w} but the launcher started {launched} ranks (WORLD_SIZE): leave --world-size \
                         out to take the launcher's"
                    )))
                }
                Some(_) => {}
            }
        }
        // A world of 0 is refused by `usage`, naming --world-size.
        let world = self.world().max(1);
        self.job.resolve_batch(world)?;
        Ok(self)
    }

    /// The world size of the launcher that started this process, where the
    /// run's ranks are processes (not `--bench`, which sets its own worlds).
    /// A launcher's variables that cannot be read are left to the ranks' start, which names them.
    fn launched_world(&self) -> Option<usize> {
        if self.bench || !self.backend.runs_as_processes() {
            return None;
        }
        chorus_collectives::bootstrap::LaunchEnv::from_process_env().ok().map(|env| env.world_size)
    }

    pub(super) fn model(&self) -> ModelArg {
        self.job.model()
    }
    pub(super) fn world(&self) -> usize {
        self.job.world()
    }
    pub(super) fn steps(&self) -> u64 {
        self.steps.unwrap_or(match self.model() {
            ModelArg::Gpt | ModelArg::Llama | ModelArg::Moe if self.bench => 20,
            ModelArg::Gpt | ModelArg::Llama | ModelArg::Moe => 300,
            ModelArg::Mlp => 50,
        })
    }
    pub(super) fn out_dir(&self) -> PathBuf {
        self.out_dir.clone().unwrap_or_else(|| PathBuf::from("out/train"))
    }

    /// The groups that recompute (`usage` refused `selective`).
    pub(super) fn recompute(&self) -> Recompute {
        self.job.recompute_groups().cloned().unwrap_or_default()
    }

    /// Every check that needs no file: the job's ([`JobArgs::check`]) and
    /// the run's flags (the memory the run needs is `memory::check`'s).
    pub(super) fn usage(&self) -> anyhow::Result<()> {
        let model = self.model();
        let world = self.world();
        if world == 0 || self.job.batch == 0 {
            return Err(usage("--world-size and --batch must be at least 1"));
        }
        if self.steps() == 0 {
            return Err(usage("--steps must be at least 1"));
        }
        if !self.backend.runs_as_processes() {
            crate::backends::check_thread_world(self.backend, world).map_err(usage)?;
        }
        crate::backends::check_not_one_of_many(self.backend).map_err(usage)?;
        if self.bench && model == ModelArg::Moe {
            return Err(usage(NO_MOE_BENCH));
        }
        if self.job.recompute == RecomputeArg::Selective {
            return Err(usage(
                "--recompute selective is torchtitan's op-level checkpointing, which chorus plan prices; chorus train recomputes whole groups (true, false or a list of groups)",
            ));
        }
        if self.bench {
            self.usage_bench()?;
        } else if self.json {
            return Err(usage("--json goes with --bench"));
        }
        self.job.check(world)?;
        self.decoder.usage(model, self.steps(), self.job.optimizer().lr(), self.job.data.is_some())?;
        if model != ModelArg::Llama && self.llama.save_dtype != SaveDtypeArg::F32 {
            return Err(usage("--save-dtype is for --model llama"));
        }
        match model {
            ModelArg::Mlp => self.usage_mlp(),
            ModelArg::Gpt | ModelArg::Moe | ModelArg::Llama => self.usage_candle_model(),
        }
    }

    /// What `--bench` does not use.
    fn usage_bench(&self) -> anyhow::Result<()> {
        let mlp = self.model() == ModelArg::Mlp;
        for (given, name) in [
            (mlp && self.job.world_size.is_some(), "--world-size with the mlp (it measures 1, 2, 4 and 8 ranks)"),
            (self.job.init_dir.is_some(), "--init-dir"),
            (self.out_dir.is_some(), "--out-dir (it writes nothing)"),
            (mlp && self.job.hsdp.is_some(), "--hsdp with the mlp"),
            (self.resume.is_some(), "--resume"),
            (self.save_every.is_some(), "--save-every"),
            (self.checkpoint_dir.is_some(), "--checkpoint-dir"),
            (self.keep_last.is_some(), "--keep-last"),
            (self.overwrite_checkpoints, "--overwrite-checkpoints"),
            (self.allow_optimizer_change, "--allow-optimizer-change"),
            (self.async_save, "--async-save"),
            (
                !mlp && self.job.param_dtype != DType::F32,
                "--param-dtype with --model gpt|llama (plain candle trains in f32)",
            ),
            (!mlp && self.job.max_grad_norm.is_some(), "--max-grad-norm with --model gpt|llama"),
        ] {
            if given {
                return Err(usage(format!("--bench does not use {name}")));
            }
        }
        Ok(())
    }

    /// The run flags the MLP does not take (its job flags are [`JobArgs::check`]'s).
    fn usage_mlp(&self) -> anyhow::Result<()> {
        for (given, name) in [
            (self.text.is_some(), "--text"),
            (self.save_every.is_some(), "--save-every"),
            (self.checkpoint_dir.is_some(), "--checkpoint-dir"),
            (self.resume.is_some(), "--resume"),
            (self.keep_last.is_some(), "--keep-last"),
            (self.overwrite_checkpoints, "--overwrite-checkpoints"),
            (self.allow_optimizer_change, "--allow-optimizer-change"),
            (self.async_save, "--async-save"),
        ] {
            if given {
                return Err(usage(format!("{name} is for --model gpt and llama")));
            }
        }
        Ok(())
    }

    /// What the runs of the models candle computes (gpt, moe, llama) share:
    /// a backend whose device candle computes on, and the checkpoints' flags.
    fn usage_candle_model(&self) -> anyhow::Result<()> {
        // On nccl the stages compute on candle's CUDA device (feature
        // `candle-cuda`); without it, or on rccl, candle would compute on the
        // CPU with every group crossing PCIe twice a step.
        let on_gpu = matches!(self.backend.name(), "nccl" | "rccl");
        if on_gpu && !(cfg!(feature = "candle-cuda") && self.backend.name() == "nccl") {
            let model = format!("{:?}", self.model()).to_lowercase();
            return Err(usage(format!(
                "--model {model} computes with candle on the CPU in this build, so it runs on backends whose device holds host memory (sim, simnccl, ucx), not {}; use --model mlp, or (nccl) a build with the candle-cuda feature (README, \"candle on CUDA\")",
                self.backend
            )));
        }
        if self.save_every == Some(0) {
            return Err(usage("--save-every must be at least 1"));
        }
        match self.keep_last {
            Some(0) => return Err(usage("--keep-last must be at least 1")),
            Some(_) if self.save_every.is_none() && self.checkpoint_dir.is_none() => {
                return Err(usage("--keep-last goes with --save-every or --checkpoint-dir"))
            }
            _ => {}
        }
        if self.allow_optimizer_change && self.resume.is_none() {
            return Err(usage("--allow-optimizer-change goes with --resume"));
        }
        if self.async_save && self.save_every.is_none() && self.checkpoint_dir.is_none() {
            return Err(usage("--async-save goes with --save-every or --checkpoint-dir"));
        }
        Ok(())
    }

    /// `spec` with this run's settings of the decoder loop beyond the job:
    /// clipping, checkpoints, resuming, the guards and `--op-times`.
    pub(super) fn with_run_settings<M>(&self, spec: TrainSpec<M>) -> TrainSpec<M> {
        TrainSpec {
            max_grad_norm: self.job.max_grad_norm,
            checkpoint_dir: (self.save_every.is_some() || self.checkpoint_dir.is_some()).then(|| self.checkpoint_dir()),
            save_every: self.save_every.unwrap_or(0),
            keep_last: self.keep_last,
            resume: self.resume.clone(),
            allow_optimizer_change: self.allow_optimizer_change,
            allow_nonfinite: self.allow_nonfinite,
            op_times: self.op_times,
            async_save: self.async_save,
            ..spec
        }
    }

    pub(super) fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir.clone().unwrap_or_else(|| {
            let out = self.out_dir();
            let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "train".into());
            out.with_file_name(format!("{name}-checkpoints"))
        })
    }
}
