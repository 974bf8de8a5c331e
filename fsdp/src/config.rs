//! Policies: reshard-after-forward, mixed precision, sharding placement, gradient reduction.

use std::fmt;
use std::sync::Arc;

use chorus_collectives::{CommBackend, CommError, Communicator, Mesh};
use chorus_devices::DType;

use crate::{FsdpError, Result};

/// Whether a group frees its unsharded parameters after forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reshard {
    /// Free them; backward all-gathers again (ZeRO-3).
    Yes,
    /// Keep them until after backward (ZeRO-2-like for this group).
    No,
    /// Keep a copy sharded over a smaller world of this many ranks (it must
    /// divide the shard world); backward all-gathers within that smaller group.
    To(usize),
}

impl std::str::FromStr for Reshard {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "true" | "yes" => Ok(Reshard::Yes),
            "false" | "no" => Ok(Reshard::No),
            n => n
                .parse::<usize>()
                .ok()
                .filter(|k| *k > 0)
                .map(Reshard::To)
                .ok_or_else(|| format!("expected true, false or a positive rank count, got `{s}`")),
        }
    }
}

impl fmt::Display for Reshard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reshard::Yes => f.write_str("true"),
            Reshard::No => f.write_str("false"),
            Reshard::To(k) => write!(f, "{k}"),
        }
    }
}

/// PyTorch's `MixedPrecisionPolicy`: sharded master parameters and sharded
/// gradients stay f32 whatever these say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MixedPrecision {
    /// Dtype of all-gathers and of the unsharded parameters used in compute
    /// (`None`: f32).
    pub param_dtype: Option<DType>,
    /// Dtype gradients are cast to before the reduce-scatter (`None`: the param dtype).
    pub reduce_dtype: Option<DType>,
    /// Dtype the model's output is cast to (`None`: left as computed).
    pub output_dtype: Option<DType>,
    /// Dtype parameters travel in on the all-gather (`None`: the param
    /// dtype). `Some(DType::F8E4M3)` is torchao's float8 all-gather
    /// (`enable_fsdp_float8_all_gather` with precomputed dynamic scales): the
    /// parameters [`gathers_as_float8`] picks are quantized per tensor from
    /// their f32 masters with a scale from the whole parameter's amax (one
    /// MAX all-reduce per group), gathered as one byte per element and
    /// dequantized to the param dtype; the others are gathered in the param
    /// dtype. Compute and gradients never see float8.
    pub all_gather_dtype: Option<DType>,
}

/// Whether a sharded parameter of this (unsharded) shape is all-gathered as
/// float8 under `all_gather_dtype: Some(DType::F8E4M3)`: matrices with both
/// dimensions at least 16. This stands in for torchao's "the weights of
/// `Float8Linear`s" by shape (whose `_scaled_mm` wants dimensions that are
/// multiples of 16): biases, norms' scales and other vectors stay in the
/// param dtype. An embedding table is a matrix too and is gathered as
/// float8 (torchao leaves embeddings alone).
pub fn gathers_as_float8(shape: &[usize]) -> bool {
    shape.len() == 2 && shape.iter().all(|&d| d >= 16)
}

impl MixedPrecision {
    /// Checks the dtypes: param, reduce and output dtypes are floats with
    /// arithmetic; the all-gather dtype is the param dtype or float8 e4m3.
    pub fn validate(&self) -> Result<()> {
        for d in [Some(self.param()), Some(self.reduce()), self.output_dtype].into_iter().flatten() {
            if !d.is_float() {
                return Err(FsdpError::InvalidArgument(format!(
                    "mixed-precision dtypes must be floats with arithmetic, got {d} \
                     (float8 is an all-gather dtype: compute is not float8)"
                )));
            }
        }
        match self.all_gather_dtype {
            None | Some(DType::F8E4M3) => Ok(()),
            Some(d) if d == self.param() => Ok(()),
            Some(d) => Err(FsdpError::InvalidArgument(format!(
                "the all-gather dtype must be the param dtype ({}) or f8e4m3, got {d}",
                self.param()
            ))),
        }
    }

    /// Whether eligible parameters are all-gathered as float8.
    pub fn float8_all_gather(&self) -> bool {
        self.all_gather_dtype == Some(DType::F8E4M3)
    }

    /// The effective param dtype.
    pub fn param(&self) -> DType {
        self.param_dtype.unwrap_or(DType::F32)
    }
    /// The effective reduce dtype.
    pub fn reduce(&self) -> DType {
        self.reduce_dtype.unwrap_or(self.param())
    }
}

/// FSDP2's `CPUOffloadPolicy`: a group's sharded parameters, their
/// gradients and the optimizer state live in host memory
/// ([`MemorySpace::Host`](chorus_devices::MemorySpace)). A shard is copied
/// to the device before its all-gather, the reduce-scattered gradient back
/// to the host after, and the optimizer step (and gradient clipping) runs on
/// the host. The results equal those without offload exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffloadPolicy {
    /// Page-locked host memory where the device has it (FSDP2's default, true).
    pub pin_memory: bool,
}

impl Default for OffloadPolicy {
    fn default() -> Self {
        OffloadPolicy { pin_memory: true }
    }
}

/// Chooses the dimension a parameter is sharded on (negative counts from the end).
pub type ShardPlacement = Arc<dyn Fn(&str, &[usize]) -> isize + Send + Sync>;

/// Settings shared by every group of one [`Fsdp`](crate::Fsdp).
#[derive(Clone)]
pub struct FsdpConfig {
    /// For non-root groups (the root never reshards after forward by default).
    pub reshard_after_forward: Reshard,
    /// Mixed precision.
    pub mixed_precision: MixedPrecision,
    /// Parameters with fewer elements than this are replicated, not sharded,
    /// and their gradients are all-reduced.
    pub replicate_below: usize,
    /// Per-parameter shard dimension (`None`: dim 0 for every parameter).
    pub shard_placement: Option<ShardPlacement>,
    /// Divide gradients by this instead of the data-parallel world size.
    pub divide_factor: Option<f64>,
    /// Reduce with plain sums and divide afterwards.
    pub force_sum: bool,
    /// CPU offload of every group (`None`: none); a group may have its own
    /// through [`Fsdp::set_offload`](crate::Fsdp::set_offload).
    pub offload: Option<OffloadPolicy>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            reshard_after_forward: Reshard::Yes,
            mixed_precision: MixedPrecision::default(),
            replicate_below: 0,
            shard_placement: None,
            divide_factor: None,
            force_sum: false,
            offload: None,
        }
    }
}

impl fmt::Debug for FsdpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsdpConfig")
            .field("reshard_after_forward", &self.reshard_after_forward)
            .field("mixed_precision", &self.mixed_precision)
            .field("replicate_below", &self.replicate_below)
            .field("shard_placement", &self.shard_placement.as_ref().map(|_| "custom"))
            .field("divide_factor", &self.divide_factor)
            .field("force_sum", &self.force_sum)
            .field("offload", &self.offload)
            .finish()
    }
}

/// The data-parallel layout: parameters are sharded over `shard` and
/// replicated over `replicate` (HSDP); plain FSDP has no replicate group; DDP
/// shards over one rank.
pub struct DataParallel<C: CommBackend> {
    /// The group parameters are sharded over.
    pub shard: Arc<Communicator<C>>,
    /// The group gradients are all-reduced over after the reduce-scatter.
    pub replicate: Option<Arc<Communicator<C>>>,
}

impl<C: CommBackend> Clone for DataParallel<C> {
    fn clone(&self) -> Self {
        DataParallel { shard: self.shard.clone(), replicate: self.replicate.clone() }
    }
}

impl<C: CommBackend> DataParallel<C> {
    /// FSDP: shard over the whole world.
    pub fn fsdp(world: Arc<Communicator<C>>) -> Self {
        DataParallel { shard: world, replicate: None }
    }

    /// HSDP on a 2-D mesh with dimensions named `replicate` and `shard`.
    pub fn hsdp(mesh: &Mesh<C>) -> Result<Self> {
        Ok(DataParallel { shard: mesh.comm("shard")?.clone(), replicate: Some(mesh.comm("replicate")?.clone()) })
    }

    /// DDP: every rank holds every parameter; gradients are all-reduced over the world.
    pub fn ddp(world: Arc<Communicator<C>>) -> Result<Self> {
        let alone = world
            .split(Some(world.rank() as u32), 0)?
            .ok_or_else(|| FsdpError::Comm(CommError::Unsupported { backend: C::NAME, what: "split".into() }))?;
        Ok(DataParallel { shard: Arc::new(alone), replicate: Some(world) })
    }

    /// Ranks in the data-parallel world (shard × replicate).
    pub fn world_size(&self) -> usize {
        self.shard.size() * self.replicate.as_ref().map_or(1, |r| r.size())
    }
}
