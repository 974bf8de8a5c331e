//! A kernel-rates file: what one GPU achieves per kind of kernel, and what
//! the host of chorus's trainer spends per operation it issues, as measured
//! on that GPU (`chorus plan --kernel-rates FILE`; the format is in
//! `docs/plan-costs.md`, "Kernel rates").
//!
//! A kernel of [`KernelOp`] `op` takes `max(FLOPs / rate, bytes /
//! bandwidth) + launch`; a GEMM's rate depends on its size (interpolated
//! between measured points). The host's constants price each operation
//! the trainer issues ([`crate::cost::Issuer`]). The files for the H100 SXM
//! and the H200 that ship with chorus are [`KernelRates::default_for`]'s.

use crate::cost::KernelOp;

/// The `format` a rates file names (a new field or meaning gets a new one).
pub const FORMAT: &str = "chorus-kernel-rates-1";

/// The largest rates file read, bytes.
pub const MAX_FILE_BYTES: u64 = 64 << 10;

/// One kernel's achieved rates: `T` is its arithmetic rate ([`OpRate`], [`GemmRate`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate<T> {
    /// Arithmetic rate, TFLOP/s on the FLOPs the kernel does (attention's:
    /// the causal half): one number, absent for a kernel bounded by memory
    /// alone; for a GEMM, `[GFLOP, TFLOP/s]` points in increasing GFLOP, its
    /// rate interpolated linearly in log GFLOP between them (the first's
    /// below the first, the last's above the last).
    #[serde(default)]
    pub tflop_per_s: T,
    /// Memory rate, GB/s of bytes read plus bytes written.
    pub gb_per_s: f64,
    /// What each launch adds, µs (the shortest kernel's time in a stream).
    pub launch_us: f64,
    /// Where the numbers come from.
    #[serde(default)]
    pub source: String,
}

/// A kernel's rates, its arithmetic one optional.
pub type OpRate = Rate<Option<f64>>;

/// A GEMM's rates, its arithmetic one by size.
pub type GemmRate = Rate<Vec<[f64; 2]>>;

/// Every kernel's rates, by the names [`KernelOp`] serializes to.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kernels {
    /// cuBLAS GEMMs.
    pub gemm: GemmRate,
    /// chorus's RMSNorm.
    pub rms_norm: OpRate,
    /// Its backward.
    pub rms_norm_backward: OpRate,
    /// chorus's rotary embedding.
    pub rope: OpRate,
    /// Its backward.
    pub rope_backward: OpRate,
    /// chorus's flash attention (`tflop_per_s` required).
    pub attention: OpRate,
    /// Its backward (`tflop_per_s` required).
    pub attention_backward: OpRate,
    /// chorus's SwiGLU.
    pub swiglu: OpRate,
    /// Its backward.
    pub swiglu_backward: OpRate,
    /// chorus's fused cross-entropy.
    pub cross_entropy: OpRate,
    /// Its backward.
    pub cross_entropy_backward: OpRate,
    /// Every other element-wise kernel (candle's, FSDP's).
    pub elementwise: OpRate,
    /// A device-to-device copy (bytes read plus written).
    pub copy: OpRate,
}

impl Kernels {
    /// The rates of `op` (GEMMs: [`Kernels::gemm`]).
    pub fn rate(&self, op: KernelOp) -> Option<&OpRate> {
        Some(match op {
            KernelOp::Gemm => return None,
            KernelOp::RmsNorm => &self.rms_norm,
            KernelOp::RmsNormBackward => &self.rms_norm_backward,
            KernelOp::Rope => &self.rope,
            KernelOp::RopeBackward => &self.rope_backward,
            KernelOp::Attention => &self.attention,
            KernelOp::AttentionBackward => &self.attention_backward,
            KernelOp::Swiglu => &self.swiglu,
            KernelOp::SwigluBackward => &self.swiglu_backward,
            KernelOp::CrossEntropy => &self.cross_entropy,
            KernelOp::CrossEntropyBackward => &self.cross_entropy_backward,
            KernelOp::Elementwise => &self.elementwise,
        })
    }

    /// Every entry but the GEMM's, by name.
    fn named(&self) -> [(&'static str, &OpRate); 12] {
        [
            ("rms_norm", &self.rms_norm),
            ("rms_norm_backward", &self.rms_norm_backward),
            ("rope", &self.rope),
            ("rope_backward", &self.rope_backward),
            ("attention", &self.attention),
            ("attention_backward", &self.attention_backward),
            ("swiglu", &self.swiglu),
            ("swiglu_backward", &self.swiglu_backward),
            ("cross_entropy", &self.cross_entropy),
            ("cross_entropy_backward", &self.cross_entropy_backward),
            ("elementwise", &self.elementwise),
            ("copy", &self.copy),
        ]
    }
}

/// What the host of chorus's trainer spends, µs, per operation it issues.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostRates {
    /// One operation of the model's framework (candle: its graph node, the
    /// output's allocation, the launch), forward or backward.
    pub model_op_us: f64,
    /// One of FSDP's hooks on one group, besides the operations it issues.
    pub fsdp_hook_us: f64,
    /// One operation FSDP enqueues on its streams (a copy, cast, fill, reduction).
    pub fsdp_op_us: f64,
    /// Each piece of a batched 2-D copy (one driver call per piece on the
    /// cuda device; 0 once a batch is one launch).
    pub copy_piece_us: f64,
    /// One optimizer step kernel (one per parameter shard).
    pub optimizer_launch_us: f64,
    /// One collective's launch.
    pub collective_us: f64,
    /// Where the numbers come from.
    #[serde(default)]
    pub source: String,
}

/// A kernel-rates file.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRates {
    /// [`FORMAT`].
    pub format: String,
    /// The GPU measured (nvidia-smi's name).
    pub gpu: String,
    /// When it was measured (a date), or that it was not.
    pub measured: String,
    /// How the numbers were obtained.
    pub source: String,
    /// Per kernel.
    pub kernels: Kernels,
    /// Per host operation.
    pub host: HostRates,
    /// Device memory the trainer's process holds besides its tensors
    /// (CUDA's context, cuBLAS's workspace, loaded kernels, NCCL's
    /// buffers), bytes: nvidia-smi's used memory less what is allocated.
    pub runtime_bytes: u64,
}

/// Why a rates file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KernelRatesError {
    /// Not the JSON of [`KernelRates`].
    #[error("not a kernel rates file: {0}")]
    Json(String),
    /// Another format.
    #[error("format `{0}`: this chorus reads `{FORMAT}`")]
    Format(String),
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

/// The H100 SXM's file (`plan/kernel-rates/h100-sxm.json`).
const H100_SXM: &str = include_str!("../kernel-rates/h100-sxm.json");
/// The H200's file (`plan/kernel-rates/h200.json`).
const H200: &str = include_str!("../kernel-rates/h200.json");

impl KernelRates {
    /// Parses and checks a rates file's text: every rate finite and
    /// positive, every launch and host time finite and not negative, the
    /// GEMM's points in increasing size, attention's arithmetic rates given.
    pub fn from_json(text: &str) -> Result<KernelRates, KernelRatesError> {
        let rates: KernelRates = serde_json::from_str(text).map_err(|e| KernelRatesError::Json(e.to_string()))?;
        rates.check()?;
        Ok(rates)
    }

    /// The file chorus ships for `--gpu KIND`, if any (`h100-sxm`, `h200`).
    pub fn default_for(gpu: &str) -> Option<KernelRates> {
        let text = match gpu {
            "h100-sxm" => H100_SXM,
            "h200" => H200,
            _ => return None,
        };
        // Checked by the tests; a broken shipped file is a refusal, not a panic.
        KernelRates::from_json(text).ok()
    }

    /// The checks of [`KernelRates::from_json`].
    pub fn check(&self) -> Result<(), KernelRatesError> {
        if self.format != FORMAT {
            return Err(KernelRatesError::Format(self.format.clone()));
        }
        let bad = |field: String, value: f64, why| Err(KernelRatesError::Value { field, value, why });
        let positive = |field: String, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(field, v, "must be a finite positive number")
            }
        };
        let not_negative = |field: String, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                bad(field, v, "must be a finite number, not negative")
            }
        };
        for (name, r) in self.kernels.named() {
            positive(format!("kernels.{name}.gb_per_s"), r.gb_per_s)?;
            not_negative(format!("kernels.{name}.launch_us"), r.launch_us)?;
            match (r.tflop_per_s, name) {
                (Some(t), _) => positive(format!("kernels.{name}.tflop_per_s"), t)?,
                (None, "attention" | "attention_backward") => {
                    return bad(
                        format!("kernels.{name}.tflop_per_s"),
                        f64::NAN,
                        "must be given (attention is FLOP-bound)",
                    )
                }
                (None, _) => {}
            }
        }
        let g = &self.kernels.gemm;
        positive("kernels.gemm.gb_per_s".into(), g.gb_per_s)?;
        not_negative("kernels.gemm.launch_us".into(), g.launch_us)?;
        if g.tflop_per_s.is_empty() || g.tflop_per_s.len() > 256 {
            return bad("kernels.gemm.tflop_per_s".into(), g.tflop_per_s.len() as f64, "must hold 1 to 256 points");
        }
        let mut last = 0.0;
        for (i, [gflop, tflops]) in g.tflop_per_s.iter().enumerate() {
            positive(format!("kernels.gemm.tflop_per_s[{i}] GFLOP"), *gflop)?;
            positive(format!("kernels.gemm.tflop_per_s[{i}] TFLOP/s"), *tflops)?;
            if *gflop <= last {
                return bad(
                    format!("kernels.gemm.tflop_per_s[{i}] GFLOP"),
                    *gflop,
                    "must be larger than the point before",
                );
            }
            last = *gflop;
        }
        let h = &self.host;
        for (name, v) in [
            ("model_op_us", h.model_op_us),
            ("fsdp_hook_us", h.fsdp_hook_us),
            ("fsdp_op_us", h.fsdp_op_us),
            ("copy_piece_us", h.copy_piece_us),
            ("optimizer_launch_us", h.optimizer_launch_us),
            ("collective_us", h.collective_us),
        ] {
            not_negative(format!("host.{name}"), v)?;
        }
        Ok(())
    }

    /// The arithmetic rate of a GEMM of `flops`, FLOP/s.
    pub fn gemm_flops_per_s(&self, flops: f64) -> f64 {
        let points = &self.kernels.gemm.tflop_per_s;
        let gflop = flops / 1e9;
        let tflops = match points.iter().position(|[g, _]| *g >= gflop) {
            None => points.last().map_or(1.0, |p| p[1]),
            Some(0) => points[0][1],
            Some(i) => {
                let ([g0, r0], [g1, r1]) = (points[i - 1], points[i]);
                let w = (gflop.ln() - g0.ln()) / (g1.ln() - g0.ln());
                r0 + w * (r1 - r0)
            }
        };
        tflops * 1e12
    }
}
