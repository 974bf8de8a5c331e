//! A cost model of this machine's cpu device as `chorus train` uses it on
//! the sim backend: candle computes the model on the CPU (its matmul on
//! `cores / ranks` threads per rank), the cpu device runs FSDP's copies and
//! the optimizer, and the sim communicator moves bytes between rank threads.
//!
//! The rates are frozen from `plan/examples/calibrate_cpu.rs` (run it in
//! release to measure again); the date and the machine are noted with them.
//! They describe one small shared VM, so they say whether the planner's
//! machinery adds up on a machine we can measure, not what any other CPU does.

use chorus_devices::MemorySpace;

use crate::cost::{CollectiveShape, CostModel, HostCost, Issuer, KernelCost, KernelKind};

/// Calibrated on: `nproc` 2, "Intel(R) Xeon(R) Processor" (as `chorus
/// train --bench` reports it), KVM guest, candle 0.11.1, the workspace's
/// dev profile (dependencies at opt-level 3), 2026-11-26 01:55 UTC, load
/// average 17 (other builds sharing the two cores: every rate here is what
/// a rank got under that load, not the machine's best).
pub const CALIBRATED_ON: &str = "2-core Xeon KVM guest, candle 0.11.1 (opt-level 3), 2026-11-26, load average 17";

/// Cores of the calibration machine.
pub const CORES: usize = 2;

/// What `calibrate_cpu` measured with 1 and with 2 candle threads.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// candle's f32 matmul, FLOP/s: the median over the bench models'
    /// shapes (`[256, 64] × [64, 64 | 96 | 256]`, `[256, 256] × [256, 64]`,
    /// `[512, 256] × [256, 256]`). A second thread does not help at these sizes.
    pub gemm_flops_per_s: f64,
    /// candle's batched `[b·h, s, hd] × [b·h, hd, s]`, FLOP/s (median of three shapes).
    pub attention_flops_per_s: f64,
    /// `x + y` on 4 Mi floats (48 MiB of traffic, out of cache), bytes read
    /// and written per second.
    pub memory_bytes_per_s: f64,
    /// Element-wise traffic that stays in cache (a kernel moving at most
    /// [`CACHE_BYTES`]), bytes/s: fitted with [`Rates::op_overhead_s`] to the
    /// tracked chain (`graph_op`: 100 ops on `[256, 64]` f32, forward 6.8 µs
    /// and backward 11.1 µs per op at one thread, about 2 µs + bytes / 30 GB/s).
    pub cached_bytes_per_s: f64,
    /// The fixed cost of one kernel of the trace inside candle's graph: the
    /// tracked chain's forward-and-backward time per op, less its traffic at
    /// `cached_bytes_per_s`, over the two kernels (forward, backward) the
    /// trace emits per op.
    pub op_overhead_s: f64,
}

/// Traffic a kernel keeps in cache (the calibration machine's 4 MiB L2).
pub const CACHE_BYTES: f64 = 4.0 * 1024.0 * 1024.0;

/// One candle thread (`RAYON_NUM_THREADS=1`): gemm 48.2 GFLOP/s (46.2–53.5
/// over the shapes), attention 21.2, element-wise 3.65 GB/s; the tracked
/// chain 17.9 µs per op forward and backward, of which its ~0.48 MB of
/// traffic at 30 GB/s is 16 µs: 1 µs per kernel.
pub const ONE_THREAD: Rates = Rates {
    gemm_flops_per_s: 48.2e9,
    attention_flops_per_s: 21.2e9,
    memory_bytes_per_s: 3.65e9,
    cached_bytes_per_s: 30e9,
    op_overhead_s: 1e-6,
};

/// Two candle threads: gemm 46.3 GFLOP/s, attention 33.2, element-wise 2.56
/// GB/s; the tracked chain 60.5 µs per op (candle's element-wise pool
/// synchronizing two threads on small tensors): (60.5 − 16) / 2 = 22 µs per kernel.
pub const TWO_THREADS: Rates = Rates {
    gemm_flops_per_s: 46.3e9,
    attention_flops_per_s: 33.2e9,
    memory_bytes_per_s: 2.56e9,
    cached_bytes_per_s: 30e9,
    op_overhead_s: 22e-6,
};

/// One memcpy between host buffers, bytes/s (`docs/benchmarks.md`, the
/// reference memcpy column of the sim rows: 24.5–27.0 GB/s).
pub const HOST_COPY_BYTES_PER_S: f64 = 25e9;

/// A small sim collective, seconds: a 2-rank all_reduce of a few elements
/// takes a median 45.9 µs (`docs/benchmarks.md`, the flight recorder's cost).
pub const SIM_CALL_S: f64 = 45.9e-6;

/// The sim's bus bandwidth on this machine, bytes/s: 1.73–2.25 GB/s at 16–64
/// MiB on 8 ranks (`docs/benchmarks.md`, "Results: sim backend").
pub const SIM_BUSBW: f64 = 1.9e9;

/// FSDP's host time per operation it enqueues, seconds: frozen before it
/// was measured; 0 (a rates file from `calibrate_cpu` carries the measurement).
pub const FSDP_OP_S: f64 = 0.0;

/// Everything the cpu model takes from a calibration: what
/// `calibrate_cpu --out FILE` writes and `chorus plan --cpu-rates FILE` reads.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuRates {
    /// Where and when it was measured (free text, for the report).
    pub calibrated_on: String,
    /// Cores of the machine.
    pub cores: usize,
    /// candle with one thread.
    pub one_thread: Rates,
    /// candle with two threads.
    pub two_threads: Rates,
    /// A host-to-host memcpy, bytes/s.
    pub host_copy_bytes_per_s: f64,
    /// A small sim collective, seconds.
    pub sim_call_s: f64,
    /// The sim's bus bandwidth, bytes/s.
    pub sim_busbw: f64,
    /// FSDP's host time per stream operation it issues, seconds (its hooks'
    /// CPU time over the operations they issue, on a calibration model).
    pub fsdp_op_s: f64,
}

/// Why a rates file was refused.
#[derive(Debug, thiserror::Error)]
pub enum RatesError {
    /// Not the JSON of [`CpuRates`].
    #[error("not a cpu rates file: {0}")]
    Json(String),
    /// A number out of range.
    #[error("{field} is {value}: {why}")]
    Value {
        /// The field.
        field: String,
        /// Its value.
        value: f64,
        /// What it must be.
        why: &'static str,
    },
}

impl CpuRates {
    /// The rates frozen in this file.
    pub fn frozen() -> CpuRates {
        CpuRates {
            calibrated_on: CALIBRATED_ON.to_string(),
            cores: CORES,
            one_thread: ONE_THREAD,
            two_threads: TWO_THREADS,
            host_copy_bytes_per_s: HOST_COPY_BYTES_PER_S,
            sim_call_s: SIM_CALL_S,
            sim_busbw: SIM_BUSBW,
            fsdp_op_s: FSDP_OP_S,
        }
    }

    /// Parses and checks a rates file's text: every rate finite and
    /// positive, the FSDP time finite and non-negative, 1..=4096 cores.
    pub fn from_json(text: &str) -> Result<CpuRates, RatesError> {
        let rates: CpuRates = serde_json::from_str(text).map_err(|e| RatesError::Json(e.to_string()))?;
        rates.check()?;
        Ok(rates)
    }

    /// The checks of [`CpuRates::from_json`].
    pub fn check(&self) -> Result<(), RatesError> {
        let bad = |field: String, value: f64, why| Err(RatesError::Value { field, value, why });
        if self.cores == 0 || self.cores > 4096 {
            return bad("cores".into(), self.cores as f64, "must be in 1..=4096");
        }
        let mut positive = vec![
            ("host_copy_bytes_per_s".to_string(), self.host_copy_bytes_per_s),
            ("sim_call_s".into(), self.sim_call_s),
            ("sim_busbw".into(), self.sim_busbw),
        ];
        for (name, r) in [("one_thread", &self.one_thread), ("two_threads", &self.two_threads)] {
            positive.extend([
                (format!("{name}.gemm_flops_per_s"), r.gemm_flops_per_s),
                (format!("{name}.attention_flops_per_s"), r.attention_flops_per_s),
                (format!("{name}.memory_bytes_per_s"), r.memory_bytes_per_s),
                (format!("{name}.cached_bytes_per_s"), r.cached_bytes_per_s),
                (format!("{name}.op_overhead_s"), r.op_overhead_s),
            ]);
        }
        for (field, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, v, "must be a finite positive number");
            }
        }
        if !(self.fsdp_op_s.is_finite() && self.fsdp_op_s >= 0.0) {
            return bad("fsdp_op_s".into(), self.fsdp_op_s, "must be a finite non-negative number");
        }
        Ok(())
    }
}

/// The cpu device's cost model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuModel {
    /// One rank's rates.
    pub rates: Rates,
    /// Fixed cost per collective, seconds.
    pub call_s: f64,
    /// Collective bus bandwidth, bytes/s.
    pub busbw: f64,
    /// A host memcpy, bytes/s.
    pub copy_bytes_per_s: f64,
    /// FSDP's host time per operation it issues, seconds.
    pub fsdp_op_s: f64,
    /// Whether a rank's stream executors share its host thread's core (a
    /// rank with fewer than two cores): then the host is busy for what
    /// they run, too.
    pub streams_on_host: bool,
}

impl CpuModel {
    /// The frozen calibration for one rank alone on the machine.
    pub fn frozen() -> CpuModel {
        CpuModel::for_ranks(1)
    }

    /// The frozen calibration when `ranks` sim ranks share the machine.
    pub fn for_ranks(ranks: usize) -> CpuModel {
        CpuModel::from_rates(&CpuRates::frozen(), ranks)
    }

    /// `rates` when `ranks` sim ranks share the machine: `chorus train`
    /// gives each `cores / ranks` candle threads (at least one); more ranks
    /// than cores share the cores, each proportionally slower.
    pub fn from_rates(rates: &CpuRates, ranks: usize) -> CpuModel {
        let (ranks, cores) = (ranks.max(1), rates.cores.max(1));
        let base = if cores / ranks >= 2 { rates.two_threads } else { rates.one_thread };
        let share = if ranks > cores { cores as f64 / ranks as f64 } else { 1.0 };
        CpuModel {
            rates: Rates {
                gemm_flops_per_s: base.gemm_flops_per_s * share,
                attention_flops_per_s: base.attention_flops_per_s * share,
                memory_bytes_per_s: base.memory_bytes_per_s * share,
                cached_bytes_per_s: base.cached_bytes_per_s * share,
                op_overhead_s: base.op_overhead_s / share,
            },
            call_s: rates.sim_call_s / share,
            busbw: rates.sim_busbw * share,
            copy_bytes_per_s: rates.host_copy_bytes_per_s * share,
            fsdp_op_s: rates.fsdp_op_s / share,
            streams_on_host: cores / ranks < 2,
        }
    }
}

impl CostModel for CpuModel {
    fn kernel_seconds(&self, kernel: &KernelCost) -> f64 {
        let r = &self.rates;
        let compute = match kernel.kind {
            KernelKind::Gemm => kernel.flops / r.gemm_flops_per_s,
            KernelKind::Attention => kernel.flops / r.attention_flops_per_s,
            KernelKind::MemoryBound => 0.0,
        };
        let rate = if kernel.bytes <= CACHE_BYTES { r.cached_bytes_per_s } else { r.memory_bytes_per_s };
        r.op_overhead_s + compute.max(kernel.bytes / rate)
    }

    fn collective_seconds(&self, shape: &CollectiveShape) -> f64 {
        if shape.ranks.len() <= 1 {
            return 0.0;
        }
        let moved = crate::nccl::bytes_moved(shape.op, shape.bytes, shape.ranks.len());
        self.call_s + moved / self.busbw
    }

    fn copy_seconds(&self, bytes: u64, _from: MemorySpace, _to: MemorySpace) -> f64 {
        // Host and device memory are the same RAM on the cpu device.
        bytes as f64 / self.copy_bytes_per_s
    }

    /// candle runs the model's kernels on the rank's thread; FSDP's issue
    /// time per operation is the host's; a rank without a core of its own
    /// for its stream executors runs their work on its host's core.
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        match issuer {
            Issuer::Model => HostCost { issue_s: 0.0, runs_on_host: true },
            Issuer::Fsdp => HostCost { issue_s: self.fsdp_op_s, runs_on_host: self.streams_on_host },
            Issuer::Collective => HostCost { issue_s: 0.0, runs_on_host: self.streams_on_host },
        }
    }

    fn peak_flops(&self) -> Option<f64> {
        None
    }
}
