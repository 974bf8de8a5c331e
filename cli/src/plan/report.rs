//! What a plan reports: the numbers on stdout and in `plan.json`.

use std::fmt::Write as _;
use std::path::Path;

use chorus_plan::cost::KernelKind;
use chorus_plan::decoder_cost::Framework;
use chorus_plan::kernel_rates::KernelRates;
use chorus_plan::run::{PlanRun, RankPlan, FSDP_STREAMS};
use chorus_plan::schedule::first_divergence;
use chorus_plan::virt::comm::{CollectiveRecord, Divergence};
use chorus_plan::virt::TraceOp;
use chorus_plan::workload::StageWork;

/// Per-rank peak memory by what holds it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Breakdown {
    /// The sharded f32 master parameters.
    pub sharded_params: usize,
    /// FSDP's sharded f32 gradients, measured: the device bytes `zero_grad`
    /// frees after the measured step's backward (0 under offload: they are in host memory).
    pub gradients: usize,
    /// The optimizer's state.
    pub optimizer_state: usize,
    /// FSDP's peak less the above: unsharded parameters and gradients, and their staging.
    pub unsharded_buffers: usize,
    /// The activations' peak.
    pub activations: usize,
}

/// What a plan is of: the job and the GPUs, as the report names them, and
/// the tokens a step trains on.
#[derive(Clone, Debug)]
pub struct Planned {
    /// The model (`--model`).
    pub model: String,
    /// GPUs.
    pub gpus: usize,
    /// GPU kind.
    pub gpu: String,
    /// Whose kernels run the model (`--kernels`, or the GPU's default).
    pub framework: Framework,
    /// `--recompute` as given.
    pub recompute: String,
    /// Tokens one GPU trains on per step (its batch × the sequence length).
    pub tokens_per_gpu_step: f64,
    /// Micro-batches per step (the workload is one micro-batch's).
    pub micro_batches: usize,
}

/// One rank's collective sequence in short: how many calls and a digest of them.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SequenceDigest {
    /// The rank.
    pub rank: usize,
    /// Calls issued.
    pub calls: usize,
    /// FNV-1a over each call's communicator, op, dtype and count, as hex.
    pub digest: String,
}

/// A plan's results.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Plan {
    /// The model, GPU and layout planned.
    pub model: String,
    /// GPUs.
    pub gpus: usize,
    /// GPU kind.
    pub gpu: String,
    /// The activation checkpointing: `--recompute` as given (true, false,
    /// the groups that recompute, or selective).
    pub recompute: String,
    /// Whose kernels were priced: `torch`, `candle` or `chorus`.
    pub kernels: String,
    /// The kernel-rates file that priced them (chorus's trainer on a GPU): its GPU and date.
    pub kernel_rates: Option<String>,
    /// The ranks run; every other mirrors one of them (`chorus_plan::run::Ranks`).
    pub ranks_run: Vec<usize>,
    /// Whether the largest rank's device memory fits the GPU's (None on the cpu device).
    pub fits: Option<bool>,
    /// The GPU's memory, bytes (nvidia-smi's total).
    pub gpu_memory_bytes: Option<u64>,
    /// What the process holds beside its tensors (CUDA's context, cuBLAS's
    /// workspace, loaded kernels; from the kernel rates; 0 otherwise).
    pub runtime_memory_bytes: u64,
    /// What nvidia-smi would show at the peak: `peak_memory_bytes` plus
    /// the runtime's for chorus's trainer, PyTorch's reserved estimate for
    /// `--kernels torch`; None on the cpu device.
    pub gpu_memory_used_bytes_estimate: Option<u64>,
    /// The measured step's time (the slowest rank's), seconds; None when it does not fit.
    pub step_time_s: Option<f64>,
    /// Tokens per second per GPU; None when it does not fit.
    pub tokens_per_s_per_gpu: Option<f64>,
    /// Model FLOPs utilisation (None for a device without a peak, or when it does not fit).
    pub mfu: Option<f64>,
    /// Seconds of the step the host spends issuing operations (the largest rank's).
    pub host_issue_s: f64,
    /// Whether the host issues for longer than the compute stream runs: the step is host-bound.
    pub host_bound: bool,
    /// The largest rank's device peak, everything counted.
    pub peak_memory_bytes: usize,
    /// The largest rank's FSDP-managed peak (comparable to `chorus train`'s `peak_memory_bytes`).
    pub fsdp_peak_memory_bytes: usize,
    /// What PyTorch's caching allocator would reserve for `peak_memory_bytes`
    /// (the figure torchtitan reports; `chorus_plan::gpu::RESERVED_OVER_ALLOCATED`):
    /// `--kernels torch` on a GPU only.
    pub peak_reserved_bytes_estimate: Option<u64>,
    /// The host space's peak (offload).
    pub host_peak_memory_bytes: usize,
    /// The largest rank's sharded gradients in host memory (offload).
    pub host_gradient_bytes: usize,
    /// Seconds of the step the host spends in the offloaded optimizer step
    /// (a GPU, whose kernels cannot reach host memory; 0 otherwise).
    pub host_optimizer_step_s: f64,
    /// The largest rank's breakdown.
    pub breakdown: Breakdown,
    /// Seconds of the step in which the compute stream waited (communication not hidden).
    pub exposed_communication_s: f64,
    /// Each rank run's sequence in short.
    pub collectives: Vec<SequenceDigest>,
    /// Rank 0's sequence in full.
    pub rank0_collectives: Vec<CollectiveRecord>,
    /// The first divergence of the ranks' sequences, if any.
    pub divergence: Option<Divergence>,
    /// Ranks that failed, with why.
    pub failed_ranks: Vec<(usize, String)>,
    /// Rank 0's measured step, for the timeline.
    #[serde(skip)]
    pub trace: Vec<TraceOp>,
}

fn digest(calls: &[CollectiveRecord]) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for c in calls {
        for b in format!("{}|{}|{}|{};", c.group, c.op, c.dtype, c.count).bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// GEMM and attention FLOPs of one micro-batch's forward on one rank.
fn forward_flops(work: &[StageWork]) -> f64 {
    work.iter().flat_map(|s| &s.forward).filter(|k| k.kind != KernelKind::MemoryBound).map(|k| k.flops).sum()
}

impl Plan {
    /// The plan of `run` for what is `planned`; `work` is one micro-batch's, `peak_flops` the GPU's,
    /// `rates` the kernel rates that priced it, if any.
    pub fn new(
        planned: &Planned,
        work: &[StageWork],
        peak_flops: Option<f64>,
        rates: Option<&KernelRates>,
        run: PlanRun,
    ) -> anyhow::Result<Plan> {
        let mut ok: Vec<&RankPlan> = Vec::new();
        let mut failed_ranks = Vec::new();
        for (&rank, r) in run.run_ranks.iter().zip(&run.ranks) {
            match r {
                Ok(p) => ok.push(p),
                Err(e) => failed_ranks.push((rank, e.clone())),
            }
        }
        let sequences = &run.sequences;
        let divergence = run.divergence.clone().or_else(|| first_divergence(sequences));
        if ok.is_empty() {
            let why = failed_ranks.first().map(|(_, e)| e.clone()).unwrap_or_default();
            match &divergence {
                Some(d) => anyhow::bail!("every rank failed; the first divergence: {d} ({why})"),
                None => anyhow::bail!("every rank failed: {why}"),
            }
        }
        let max = |f: fn(&RankPlan) -> usize| ok.iter().map(|p| f(p)).max().unwrap_or(0);
        let step = ok.iter().map(|p| p.step_time_s).fold(0.0, f64::max);
        let worst = ok.iter().max_by_key(|p| p.fsdp_peak_bytes).copied().unwrap_or(ok[0]);
        let gradients = worst.gradient_bytes;
        let breakdown = Breakdown {
            sharded_params: worst.sharded_param_bytes,
            gradients,
            optimizer_state: worst.optimizer_state_bytes,
            unsharded_buffers: worst
                .fsdp_peak_bytes
                .saturating_sub(worst.sharded_param_bytes + gradients + worst.optimizer_state_bytes),
            activations: max(|p| p.activation_peak_bytes),
        };
        let compute_busy = ok.iter().map(|p| p.compute_busy_s).fold(f64::INFINITY, f64::min);
        let host_issue_s = ok.iter().map(|p| p.host_issue_s).fold(0.0, f64::max);
        let tokens = planned.tokens_per_gpu_step;
        let per_s = |x: f64| if step > 0.0 { x / step } else { 0.0 };
        // The model's FLOPs: forward, and backward at twice the forward (recomputation not counted).
        let model_flops = 3.0 * forward_flops(work) * planned.micro_batches as f64;
        let peak_memory_bytes = max(|p| p.peak_bytes);
        let gpu_memory_bytes = chorus_plan::gpu::gpu_spec(&planned.gpu).map(|s| s.memory_bytes);
        let runtime_memory_bytes = rates.map_or(0, |r| r.runtime_bytes);
        // PyTorch's caching allocator's estimate, for PyTorch's kernels only.
        let reserved = chorus_plan::gpu::reserved_estimate(&planned.gpu, peak_memory_bytes as u64)
            .filter(|_| planned.framework == Framework::TorchEager);
        // What must fit: the tensors, and chorus's runtime beside them. (For
        // PyTorch the allocated peak: its allocator frees what it caches
        // before it runs out, so its reserved estimate may pass the memory.)
        let needed = peak_memory_bytes as u64 + runtime_memory_bytes;
        let fits = gpu_memory_bytes.map(|m| needed <= m);
        let fitting = |x: f64| (fits != Some(false)).then_some(x);
        Ok(Plan {
            model: planned.model.clone(),
            gpus: planned.gpus,
            gpu: planned.gpu.clone(),
            recompute: planned.recompute.clone(),
            kernels: kernels_name(planned.framework).to_string(),
            kernel_rates: rates.map(|r| format!("{}, measured {}", r.gpu, r.measured)),
            ranks_run: run.run_ranks.clone(),
            fits,
            gpu_memory_bytes,
            runtime_memory_bytes,
            gpu_memory_used_bytes_estimate: match rates {
                Some(_) => gpu_memory_bytes.map(|_| needed),
                None => reserved,
            },
            step_time_s: fitting(step),
            tokens_per_s_per_gpu: fitting(per_s(tokens)),
            mfu: peak_flops.filter(|p| *p > 0.0).and_then(|p| fitting(per_s(model_flops) / p)),
            host_issue_s,
            host_bound: host_issue_s > compute_busy,
            peak_memory_bytes,
            fsdp_peak_memory_bytes: max(|p| p.fsdp_peak_bytes),
            peak_reserved_bytes_estimate: reserved,
            host_peak_memory_bytes: max(|p| p.host_peak_bytes),
            host_gradient_bytes: max(|p| p.host_gradient_bytes),
            host_optimizer_step_s: ok.iter().map(|p| p.host_step_s).fold(0.0, f64::max),
            breakdown,
            exposed_communication_s: (step - compute_busy).max(0.0),
            collectives: sequences
                .iter()
                .zip(&run.run_ranks)
                .map(|(calls, &rank)| SequenceDigest { rank, calls: calls.len(), digest: digest(calls) })
                .collect(),
            rank0_collectives: sequences.first().cloned().unwrap_or_default(),
            divergence,
            failed_ranks,
            trace: ok.iter().find(|p| p.rank == 0).map(|p| p.trace.clone()).unwrap_or_default(),
        })
    }

    /// The report on stdout.
    pub fn text(&self) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let b = &self.breakdown;
        let mut s = String::new();
        let _ = writeln!(s, "chorus plan: {} on {} × {} ({} kernels)", self.model, self.gpus, self.gpu, self.kernels);
        if let Some(r) = &self.kernel_rates {
            let _ = writeln!(s, "kernel rates          {r}");
        }
        if self.ranks_run.len() < self.gpus {
            let ranks: Vec<String> = self.ranks_run.iter().map(|r| r.to_string()).collect();
            let _ = writeln!(
                s,
                "ranks run             {} (the other {} run the same program: each mirrors them)",
                ranks.join(" and "),
                self.gpus - self.ranks_run.len()
            );
        }
        let _ = writeln!(
            s,
            "peak memory per GPU   {:.3} GiB (FSDP-managed {:.3} GiB)",
            gib(self.peak_memory_bytes),
            gib(self.fsdp_peak_memory_bytes)
        );
        if let Some(r) = self.peak_reserved_bytes_estimate {
            let _ = writeln!(s, "  reserved (est.)     {:.3} GiB (PyTorch's caching allocator)", gib(r as usize));
        }
        if self.runtime_memory_bytes > 0 {
            let _ = writeln!(
                s,
                "  runtime             {:.3} GiB (CUDA's context, cuBLAS, kernels: the kernel rates')",
                gib(self.runtime_memory_bytes as usize)
            );
        }
        let _ = writeln!(s, "  sharded params      {:.3} GiB", gib(b.sharded_params));
        let _ = writeln!(s, "  gradients           {:.3} GiB", gib(b.gradients));
        let _ = writeln!(s, "  optimizer state     {:.3} GiB", gib(b.optimizer_state));
        let _ = writeln!(s, "  unsharded buffers   {:.3} GiB", gib(b.unsharded_buffers));
        let _ = writeln!(s, "  activations         {:.3} GiB", gib(b.activations));
        if self.host_peak_memory_bytes > 0 {
            let _ = writeln!(s, "host memory per GPU   {:.3} GiB", gib(self.host_peak_memory_bytes));
            let _ = writeln!(s, "  gradients           {:.3} GiB", gib(self.host_gradient_bytes));
        }
        let needed = self.peak_memory_bytes as u64 + self.runtime_memory_bytes;
        match (self.fits, self.gpu_memory_bytes) {
            (Some(true), Some(m)) => {
                let _ =
                    writeln!(s, "fits                  yes: {:.3} of {:.3} GiB", gib(needed as usize), gib(m as usize));
            }
            (Some(false), Some(m)) => {
                let _ = writeln!(
                    s,
                    "fits                  NO: DOES NOT FIT: {:.3} GiB needed, the GPU has {:.3} GiB (no step time for a step that cannot run)",
                    gib(needed as usize),
                    gib(m as usize)
                );
            }
            _ => {}
        }
        if self.host_optimizer_step_s > 0.0 {
            let _ = writeln!(s, "optimizer on the host {:.4} s per step", self.host_optimizer_step_s);
        }
        if let Some(step) = self.step_time_s {
            let _ = writeln!(s, "step time             {step:.4} s");
        }
        if let Some(t) = self.tokens_per_s_per_gpu {
            let _ = writeln!(s, "tokens/s per GPU      {t:.1}");
        }
        match (self.mfu, self.fits) {
            (_, Some(false)) => {}
            (Some(m), _) => drop(writeln!(s, "MFU                   {:.1} %", 100.0 * m)),
            (None, _) => drop(writeln!(s, "MFU                   - (no peak FLOP/s for {})", self.gpu)),
        }
        if self.host_issue_s > 0.0 {
            let bound =
                if self.host_bound { " (host-bound: the host issues for longer than the GPU computes)" } else { "" };
            let _ = writeln!(s, "host issue time       {:.4} s per step{bound}", self.host_issue_s);
        }
        let _ = writeln!(s, "exposed communication {:.4} s per step", self.exposed_communication_s);
        match &self.divergence {
            None => drop(writeln!(s, "schedule check        every rank issues the same collectives")),
            Some(d) => drop(writeln!(s, "schedule check        DIVERGES: {d}")),
        }
        for (rank, e) in self.failed_ranks.iter().take(4) {
            let _ = writeln!(s, "rank {rank} failed: {e}");
        }
        s
    }

    /// Writes `plan.json` and `timeline.svg` into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(self)?;
        crate::outdir::write_file(&dir.join("plan.json"), &json)?;
        super::timeline::draw(&dir.join("timeline.svg"), &self.trace, &FSDP_STREAMS)
    }
}

/// `--kernels`' name of `f`.
fn kernels_name(f: Framework) -> &'static str {
    match f {
        Framework::TorchEager => "torch",
        Framework::Candle => "candle",
        Framework::Chorus => "chorus",
    }
}
