//! The conformance suite: what every chorus communication backend must do.
//!
//! A **case** ([`Case`]) is an SPMD function written once, generic over the
//! backend: every rank of a world runs it with its own [`RankCtx`] (its
//! communicator, its device, and a few harness hooks) and returns `Ok` or a
//! [`Failure`]. Expected values are computed on the host by this crate
//! ([`expected`]), never by the code under test.
//!
//! A case declares what it needs ([`Requirements`]: a minimum world size,
//! optional capabilities such as `ReduceOp::Avg`, fault injection or the
//! stream sanitizer). A harness compares that with what its backend offers
//! ([`Support`]) and reports the case as skipped, with the reason, when it
//! does not apply; a case never returns early on its own to hide a skip.
//!
//! The suite ([`cases`]) is made of
//! - [`collectives`]: every operation × dtype × reduce operator × count, out of
//!   place and in place, plus send/recv patterns, groups and barriers;
//! - [`subgroups`]: split by color (with opted-out ranks and key order) and
//!   both dimensions of a 2-D [`Mesh`](chorus_collectives::Mesh);
//! - [`streams`]: cross-stream ordering through events, and the sanitizer's
//!   race report when the event is missing;
//! - [`fsdp`]: FSDP trained on the world under test against a host
//!   reference (every optimizer, layout and policy), its state machine, the
//!   collectives per step and the memory bound;
//! - [`errors`]: invalid arguments, mismatched calls, missing ranks, abort and
//!   injected faults, each of which must give the right error on every rank
//!   before the deadline.
//!
//! Harnesses (one [`harness::Harness`] each, one runner for all, in
//! [`harness`]): [`sim`] (feature `sim`, default) runs the suite on the sim
//! backend, ranks as threads of this process; [`vendor`] runs it on the NCCL
//! family — the simulated NCCL ABI on cpu devices (in CI), NCCL on cuda
//! devices (feature `nccl`) and RCCL on hip devices (feature `rccl`), one
//! rank per device; [`ucx`] (feature `ucx`) runs it on the UCX backend, with
//! every rank in this process or one rank per process. [`process`] is the
//! runner for ranks that are processes: the same cases, host barriers and
//! results through the job's store. [`rank_threads`] starts the ranks of a
//! world in this process, each making its communicator, with a deadline.
#![warn(missing_docs)]

mod barrier;
mod case;
pub mod checked;
pub mod collectives;
pub mod errors;
pub mod expected;
pub mod fsdp;
pub mod harness;
pub mod process;
pub mod rank_threads;
mod report;
#[cfg(feature = "sim")]
pub mod sim;
pub mod streams;
pub mod subgroups;
#[cfg(feature = "ucx")]
pub mod ucx;
mod util;
pub mod vendor;

pub use barrier::HostBarrier;
pub use case::{
    Buf, Case, CaseFn, Dev, Evt, Failure, FaultAction, FaultSpec, Faults, Hooks, Isolation, RankCtx, Requirements,
    Strm, Support,
};
pub use report::{CaseOutcome, Status, Summary};

use chorus_collectives::CommBackend;

/// The suite every communication backend must pass, for a world of
/// `world_size` ranks, in a fixed order: collectives, subgroups, streams,
/// errors. Names are unique and stable; some depend on the world size (roots,
/// chunk lengths). A backend whose device has the compute kernels also runs
/// [`fsdp::cases`] (its harness adds them, [`harness::Harness::extra_cases`]).
pub fn cases<C: CommBackend>(world_size: usize) -> Vec<Case<C>> {
    let mut all = collectives::cases(world_size);
    all.extend(subgroups::cases(world_size));
    all.extend(streams::cases(world_size));
    all.extend(errors::cases(world_size));
    all
}
