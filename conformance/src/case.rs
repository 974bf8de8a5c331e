//! Cases, what they need, and what a rank running one is given.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chorus_collectives::{Capabilities, CommBackend, Communicator};
use chorus_devices::{Backend, Device, Priority};

/// Why a case failed on one rank. Cases build it with `anyhow`'s macros and `?`.
pub type Failure = anyhow::Error;

/// The device type of backend `C`.
pub type Dev<C> = <<C as CommBackend>::B as Backend>::Device;
/// The stream type of backend `C`.
pub type Strm<C> = <<C as CommBackend>::B as Backend>::Stream;
/// The buffer type of backend `C`.
pub type Buf<C> = <<C as CommBackend>::B as Backend>::Buffer;
/// The event type of backend `C`.
pub type Evt<C> = <<C as CommBackend>::B as Backend>::Event;

/// The body of a case: run once by every rank of the world.
pub type CaseFn<C> = Arc<dyn Fn(&RankCtx<'_, C>) -> Result<(), Failure> + Send + Sync>;

/// What a case needs beyond the required operations. A harness skips (and
/// reports) a case whose needs its backend or world does not meet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requirements {
    /// An even number of ranks (a 2 × n/2 mesh).
    pub even_world: bool,
    /// `ReduceOp::Avg` ([`Capabilities::avg`]).
    pub avg: bool,
    /// `ReduceOp::PreMulSum` ([`Capabilities::premul_sum`]).
    pub premul_sum: bool,
    /// One rank's abort fails every rank ([`Capabilities::world_abort`]).
    pub world_abort: bool,
    /// Faults can be injected: the backend declares it
    /// ([`Capabilities::fault_injection`]) and the harness offers [`Faults`].
    pub fault_injection: bool,
    /// The device checks cross-stream accesses and refuses unordered ones
    /// with `DeviceError::Race` (the cpu device's stream sanitizer).
    pub stream_sanitizer: bool,
    /// Mismatched calls fail with `Mismatch` ([`Capabilities::detects_mismatch`]).
    pub detects_mismatch: bool,
    /// A `Timeout` names the missing ranks ([`Capabilities::names_missing_ranks`]).
    pub names_missing_ranks: bool,
}

/// What a harness and its backend offer, to decide skips.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Support {
    /// The backend's declared capabilities.
    pub capabilities: Capabilities,
    /// The devices run a stream sanitizer (on for the whole run).
    pub stream_sanitizer: bool,
    /// The harness passes a [`Faults`] injector to the cases.
    pub fault_hooks: bool,
}

/// Whether a case may share its world with other cases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// Leaves the communicator healthy and in step on every rank when it
    /// passes, so many such cases can run one after another in one world.
    Shared,
    /// Breaks the communicator on purpose (errors, aborts, faults), or needs
    /// the collective sequence to start at 0: it gets a world of its own, and
    /// harnesses give such worlds a short deadline so that timeouts are quick.
    Fresh,
}

/// One conformance case.
pub struct Case<C: CommBackend> {
    /// Unique, stable name: `op/variant/dtype/...`. Filters match substrings of it.
    pub name: String,
    /// The fewest ranks the case makes sense for.
    pub min_world: usize,
    /// Optional capabilities it needs.
    pub needs: Requirements,
    /// Whether it may share a world with other cases.
    pub isolation: Isolation,
    /// The SPMD body.
    pub run: CaseFn<C>,
}

impl<C: CommBackend> Clone for Case<C> {
    fn clone(&self) -> Self {
        Case {
            name: self.name.clone(),
            min_world: self.min_world,
            needs: self.needs,
            isolation: self.isolation,
            run: self.run.clone(),
        }
    }
}

impl<C: CommBackend> fmt::Debug for Case<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("min_world", &self.min_world)
            .field("needs", &self.needs)
            .field("isolation", &self.isolation)
            .finish_non_exhaustive()
    }
}

impl<C: CommBackend> Case<C> {
    /// A case that runs on any world size, needs nothing optional, and shares its world.
    pub fn new(
        name: impl Into<String>,
        run: impl Fn(&RankCtx<'_, C>) -> Result<(), Failure> + Send + Sync + 'static,
    ) -> Self {
        Case {
            name: name.into(),
            min_world: 1,
            needs: Requirements::default(),
            isolation: Isolation::Shared,
            run: Arc::new(run),
        }
    }

    /// Sets the minimum world size.
    pub fn min_world(mut self, n: usize) -> Self {
        self.min_world = n;
        self
    }

    /// Adds requirements (or-ed into those already declared).
    pub fn needs(mut self, r: Requirements) -> Self {
        let n = &mut self.needs;
        n.even_world |= r.even_world;
        n.avg |= r.avg;
        n.premul_sum |= r.premul_sum;
        n.world_abort |= r.world_abort;
        n.fault_injection |= r.fault_injection;
        n.stream_sanitizer |= r.stream_sanitizer;
        n.detects_mismatch |= r.detects_mismatch;
        n.names_missing_ranks |= r.names_missing_ranks;
        self
    }

    /// Gives the case a world of its own.
    pub fn fresh(mut self) -> Self {
        self.isolation = Isolation::Fresh;
        self
    }

    /// Why the case does not apply to a world of `world_size` ranks with
    /// `support`, or `None` when it runs.
    pub fn skip_reason(&self, world_size: usize, support: &Support) -> Option<String> {
        let caps = &support.capabilities;
        let needs = &self.needs;
        if world_size < self.min_world {
            return Some(format!("needs at least {} ranks; the world has {world_size}", self.min_world));
        }
        if needs.even_world && world_size % 2 != 0 {
            return Some(format!("needs an even number of ranks; the world has {world_size}"));
        }
        if needs.avg && !caps.avg {
            return Some("the backend does not support ReduceOp::Avg (Capabilities::avg)".into());
        }
        if needs.premul_sum && !caps.premul_sum {
            return Some("the backend does not support ReduceOp::PreMulSum (Capabilities::premul_sum)".into());
        }
        if needs.world_abort && !caps.world_abort {
            return Some("an abort does not reach every rank on this backend (Capabilities::world_abort)".into());
        }
        if needs.fault_injection && !(caps.fault_injection && support.fault_hooks) {
            return Some("faults cannot be injected here (Capabilities::fault_injection and harness hooks)".into());
        }
        if needs.stream_sanitizer && !support.stream_sanitizer {
            return Some("the device has no stream sanitizer to report missing waits".into());
        }
        if needs.detects_mismatch && !caps.detects_mismatch {
            return Some(
                "the backend cannot see a peer's call, so a mismatch hangs instead of failing \
                 (Capabilities::detects_mismatch; run it under the checked wrapper)"
                    .into(),
            );
        }
        if needs.names_missing_ranks && !caps.names_missing_ranks {
            return Some("the backend cannot tell which rank is missing (Capabilities::names_missing_ranks)".into());
        }
        None
    }
}

/// What an injected fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// The call fails on that rank with a backend error, which aborts the world.
    Fail,
    /// The rank sleeps this long before it arrives at the call.
    Stall(Duration),
}

/// A fault: `rank`'s collective number `call` (0-based, in the world
/// communicator's sequence) misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultSpec {
    /// The rank.
    pub rank: usize,
    /// The call's position in the world communicator's collective sequence.
    pub call: u64,
    /// What happens.
    pub action: FaultAction,
}

/// Fault injection into the world a case runs in (harnesses that can).
pub trait Faults: Send + Sync {
    /// Arms `fault`. Call it from one rank, then [`Hooks::host_barrier`], so
    /// every rank issues the call only after the fault is armed.
    fn inject(&self, fault: FaultSpec) -> Result<(), Failure>;
    /// Aborts the whole world from outside, as a crashing job would.
    fn abort_world(&self, reason: &str);
}

/// What the harness provides to the ranks besides the communicator.
pub trait Hooks: Send + Sync {
    /// Blocks until every rank of the world has called it, through a channel
    /// of the harness's own (not the communicator under test). Fails when a
    /// rank has failed or the harness gives up waiting.
    fn host_barrier(&self) -> Result<(), Failure>;
    /// The fault injector, where the harness has one.
    fn faults(&self) -> Option<&dyn Faults>;
}

/// What one rank running a case is given.
pub struct RankCtx<'a, C: CommBackend> {
    /// This rank's endpoint of the world under test.
    pub comm: &'a Communicator<C>,
    /// The harness's hooks.
    pub hooks: &'a dyn Hooks,
    /// What the harness and backend offer (the case has already been
    /// checked against it; cases read it only to adapt checks).
    pub support: Support,
    /// The communicator's deadline: a rank that has not arrived at a
    /// collective this long after the others makes them fail with `Timeout`.
    pub comm_timeout: Duration,
}

impl<C: CommBackend> RankCtx<'_, C> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }
    /// This rank's device.
    pub fn device(&self) -> &Dev<C> {
        self.comm.device()
    }
    /// A new stream on this rank's device (cases use fresh streams, so an
    /// error left on one cannot leak into the next case).
    pub fn stream(&self) -> Result<Strm<C>, Failure> {
        Ok(self.device().create_stream(Priority::Normal)?)
    }
    /// See [`Hooks::host_barrier`].
    pub fn host_barrier(&self) -> Result<(), Failure> {
        self.hooks.host_barrier()
    }
    /// The fault injector; an error if the harness has none (cases that use
    /// it declare [`Requirements::fault_injection`], so this does not happen).
    pub fn faults(&self) -> Result<&dyn Faults, Failure> {
        self.hooks.faults().ok_or_else(|| anyhow::anyhow!("the harness offers no fault injection"))
    }
}
