//! A cost model of this machine's cpu device as `chorus train` uses it on
//! the sim backend: candle computes the model on the CPU (its matmul on
//! `cores / ranks` threads per rank), the cpu device runs FSDP's copies and
//! the optimizer, and the sim communicator moves bytes between rank threads.
//!
//! Where the time goes, as the model has it: the model's kernels run on the
//! rank's own thread (the host waits for each: [`Issuer::Model`] runs on
//! the host), FSDP's hooks spend host time per stream operation they issue,
//! and a rank with fewer than two cores runs its stream executors' work
//! (copies, the optimizer, the sim's collectives) on its host's core too.
//!
//! The rates come from `plan/examples/calibrate_cpu.rs` (microbenchmarks,
//! and two calibration transformers of other shapes than the bench's), with
//! `chorus bench` for the sim: `ci/cpu-plan-check.sh` writes them to a file
//! `chorus plan --gpu cpu --cpu-rates FILE` reads ([`CpuRates`]). The frozen
//! ones below are one such run. They describe one small shared VM, so they
//! say whether the planner's machinery adds up on a machine we can measure,
//! not what any other CPU does.

use chorus_devices::MemorySpace;

use crate::cost::{CollectiveShape, CostModel, HostCost, Issuer, KernelCost, KernelKind};

/// Calibrated on: `nproc` 2, "Intel(R) Xeon(R) Processor", KVM guest,
/// candle 0.11.1, the workspace's dev profile (opt-level 2, dependencies
/// 3), 2026-11-26 05:42 UTC, load average 1.8 (the machine otherwise
/// idle), `ci/cpu-plan-check.sh`'s transformer calibration, on the tree
/// whose FSDP copy-out is a few copies per parameter.
pub const CALIBRATED_ON: &str =
    "2-core Xeon KVM guest, candle 0.11.1, dev profile, 2026-11-26 05:42 UTC, load average 1.8";

/// Cores of the calibration machine.
pub const CORES: usize = 2;

/// What `calibrate_cpu` measured with 1 and with 2 candle threads.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// candle's f32 matmul, FLOP/s: the median over transformer projection
    /// shapes (`[256, 64] × [64, 64 | 96 | 256]`, `[256, 256] × [256, 64]`,
    /// `[512, 256] × [256, 256]`).
    pub gemm_flops_per_s: f64,
    /// candle's batched `[b·h, s, hd] × [b·h, hd, s]`, FLOP/s (median of three shapes).
    pub attention_flops_per_s: f64,
    /// Element-wise traffic of a kernel moving more than [`CACHE_BYTES`],
    /// bytes/s: `x + y` on 4 Mi floats, or the in-cache rate if slower.
    pub memory_bytes_per_s: f64,
    /// Element-wise traffic of candle's kernels in a training graph,
    /// bytes/s: fitted with [`Rates::op_overhead_s`] to two calibration
    /// transformers' candle time per step (less their GEMMs at the rates
    /// above). Far below `x + y`'s: softmax, GELU and layer norm are
    /// several candle ops each, forward and backward.
    pub cached_bytes_per_s: f64,
    /// The fixed cost of one kernel of the trace inside candle's graph,
    /// seconds (the same fit; at least 0.1 µs).
    pub op_overhead_s: f64,
}

/// Traffic a kernel keeps in cache (the calibration machine's 4 MiB L2).
pub const CACHE_BYTES: f64 = 4.0 * 1024.0 * 1024.0;

/// One candle thread, fitted at two ranks (`RAYON_NUM_THREADS=1`): gemm
/// 46.9 GFLOP/s (median over the shapes), attention 20.0, `x + y` 24.8
/// GB/s; the calibration transformers' candle step 7.9 and 54.8 ms, of
/// which GEMMs 1.8 and 17.6 ms: element-wise 2.54 GB/s, the fixed cost
/// fitted below its floor.
pub const ONE_THREAD: Rates = Rates {
    gemm_flops_per_s: 46.9e9,
    attention_flops_per_s: 20.0e9,
    memory_bytes_per_s: 2.54e9,
    cached_bytes_per_s: 2.54e9,
    op_overhead_s: 1e-7,
};

/// Two candle threads, fitted at one rank: gemm 42.7 GFLOP/s, attention
/// 30.5, `x + y` 52.9 GB/s; candle steps 8.9 and 51.4 ms, GEMMs 1.8 and
/// 18.0 ms: element-wise 2.85 GB/s and 1.5 µs per kernel.
pub const TWO_THREADS: Rates = Rates {
    gemm_flops_per_s: 42.7e9,
    attention_flops_per_s: 30.5e9,
    memory_bytes_per_s: 2.85e9,
    cached_bytes_per_s: 2.85e9,
    op_overhead_s: 1.46e-6,
};

/// One memcpy between host buffers, bytes/s (`docs/benchmarks.md`, the
/// reference memcpy column of the sim rows: 24.5–27.0 GB/s; the GPU models'
/// host-to-host copies use it too, so a calibration's own goes in its file).
pub const HOST_COPY_BYTES_PER_S: f64 = 25e9;

/// A small sim collective, seconds: `chorus bench --backend sim --op
/// all_gather --world-size 2`'s median time at 1–64 KiB.
pub const SIM_CALL_S: f64 = 64.6e-6;

/// The sim's bus bandwidth on this machine, bytes/s: the same bench's
/// median at 4–16 MiB.
pub const SIM_BUSBW: f64 = 6.69e9;

/// FSDP's host time per operation it issues, seconds: its hooks' CPU time
/// per step over the operations a plan counts, on the calibration
/// transformers: 7.0 and 27.5 µs at 2 ranks, 11.8 and 37.4 at 1 (the larger
/// model's per-parameter work costs more per operation; a batched copy of
/// a whole group counts as one operation); the mean of the two rank
/// counts' larger values.
pub const FSDP_OP_S: f64 = 32.5e-6;

/// Everything the cpu model takes from a calibration: what
/// `ci/cpu-plan-check.sh` writes and `chorus plan --cpu-rates FILE` reads.
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
    /// time per operation (the optimizer's steps among them) is the host's;
    /// a rank without a core of its own for its stream executors runs their
    /// work on its host's core. A batched copy is one job (no cost per
    /// piece), and FSDP's hooks cost what their operations cost (the
    /// calibration measures it per operation).
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        match issuer {
            Issuer::Model => HostCost { issue_s: 0.0, runs_on_host: true },
            Issuer::Fsdp | Issuer::Optimizer => {
                HostCost { issue_s: self.fsdp_op_s, runs_on_host: self.streams_on_host }
            }
            Issuer::Collective => HostCost { issue_s: 0.0, runs_on_host: self.streams_on_host },
            Issuer::CopyPiece | Issuer::Hook => HostCost::default(),
        }
    }

    fn peak_flops(&self) -> Option<f64> {
        None
    }
}
