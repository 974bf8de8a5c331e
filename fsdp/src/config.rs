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
}

impl MixedPrecision {
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
