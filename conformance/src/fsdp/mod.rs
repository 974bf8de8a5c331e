//! FSDP conformance: the reference MLP trained under FSDP on the world under
//! test must equal a host reference trained on the global batch; the state
//! machine, the collectives per step and the memory bound must be FSDP2's.
//!
//! Every case runs on a communicator split from the world (FSDP keeps its
//! communicators), so it leaves the world's own sequence in step (`world.rs`).
//! The cases by what they check: `parity.rs` (FSDP against the host
//! reference, `reference.rs`), `collective_counts.rs`, `state_machine.rs`,
//! `memory.rs`, `offload.rs`, `float8.rs`, and the mixture-of-experts
//! model's routed groups (`routed.rs`, over `moe.rs` and `moe_reference.rs`);
//! this file lists them.

mod collective_counts;
pub mod counting;
pub mod float8;
mod memory;
pub mod moe;
pub mod moe_reference;
pub mod offload;
mod parity;
pub mod reference;
mod routed;
mod state_machine;
mod world;

use std::sync::Arc;

use chorus_collectives::CommBackend;
use chorus_devices::{ComputeBackend, DType};
use chorus_fsdp::{FsdpConfig, Reshard};

use crate::{Case, Requirements};
use collective_counts::{counts_case, hsdp_counts_case};
use memory::memory_case;
use parity::{adamw, bf16_case, losses_case, parity_case, sgd};
pub use parity::{max_diff, train_fsdp, train_reference, Setup};
use state_machine::{prefetch_case, state_machine_case};
// float8.rs takes the worlds through this module.
use world::{counted, own_world};

/// The FSDP cases for a world of `world_size` ranks.
pub fn cases<C: CommBackend>(world_size: usize) -> Vec<Case<C>>
where
    C::B: ComputeBackend,
{
    let even = Requirements { even_world: true, ..Requirements::default() };
    let half = (world_size / 2).max(1);
    let mut out = vec![
        parity_case("sgd", Setup::new(sgd(0.05, 0.0)), 1e-6),
        parity_case("sgd-momentum", Setup::new(sgd(0.05, 0.9)), 1e-6),
        parity_case("adamw", Setup::new(adamw()), 1e-5),
        parity_case(
            "reshard-after-forward-false",
            Setup {
                config: FsdpConfig { reshard_after_forward: Reshard::No, ..FsdpConfig::default() },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        ),
        parity_case(
            &format!("reshard-after-forward-{half}"),
            Setup {
                config: FsdpConfig { reshard_after_forward: Reshard::To(half), ..FsdpConfig::default() },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        )
        .needs(even),
        parity_case(
            "shard-dim-1",
            Setup {
                config: FsdpConfig {
                    shard_placement: Some(Arc::new(|_: &str, shape: &[usize]| if shape.len() == 2 { -1 } else { 0 })),
                    ..FsdpConfig::default()
                },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        ),
        // Biases (≤ 64 elements) and the last weight (165) stay replicated.
        parity_case(
            "replicate-below-threshold",
            Setup { config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() }, ..Setup::new(adamw()) },
            1e-5,
        ),
        // Four accumulated micro-batch means are four times the big batch's mean.
        parity_case("accumulate-4-micro-batches", Setup { micro: 4, ..Setup::new(sgd(0.05 / 4.0, 0.0)) }, 1e-6),
        parity_case(
            "forced-sum",
            Setup { config: FsdpConfig { force_sum: true, ..FsdpConfig::default() }, ..Setup::new(sgd(0.05, 0.0)) },
            1e-6,
        ),
        parity_case("ddp", Setup { ddp: true, ..Setup::new(sgd(0.05, 0.0)) }, 1e-6),
        // Clipping to half the first norm (padding and replicated parameters counted once).
        parity_case("clip-grad-norm", Setup { clip_fraction: Some(0.5), ..Setup::new(sgd(0.05, 0.9)) }, 1e-6),
        parity_case(
            "clip-grad-norm-replicated-params",
            Setup {
                clip_fraction: Some(0.5),
                config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() },
                ..Setup::new(sgd(0.05, 0.0))
            },
            1e-6,
        ),
        bf16_case(DType::F32),
        bf16_case(DType::BF16),
        state_machine_case(),
        prefetch_case(),
        counts_case(),
        memory_case(),
        losses_case(),
    ];
    // A divide factor of n/2 doubles the averaged gradient (with and without forced sums).
    for force_sum in [false, true] {
        let config = FsdpConfig { divide_factor: Some(world_size as f64 / 2.0), force_sum, ..FsdpConfig::default() };
        let name = if force_sum { "divide-factor-forced-sum" } else { "divide-factor" };
        out.push(parity_case(name, Setup { config, grad_scale: 2.0, ..Setup::new(sgd(0.05, 0.0)) }, 1e-6));
    }
    if world_size >= 4 && world_size % 2 == 0 {
        let r = Some(2);
        out.push(parity_case(&format!("hsdp-2x{half}"), Setup { replicate: r, ..Setup::new(sgd(0.05, 0.0)) }, 1e-6));
        out.push(parity_case(
            &format!("hsdp-2x{half}-replicate-below-threshold"),
            Setup {
                replicate: r,
                config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() },
                ..Setup::new(adamw())
            },
            1e-5,
        ));
        // Partial reduce-scatter results accumulate until the all-reduce.
        out.push(parity_case(
            &format!("hsdp-2x{half}-deferred-all-reduce"),
            Setup { replicate: r, micro: 2, defer_all_reduce: true, ..Setup::new(sgd(0.05 / 2.0, 0.0)) },
            1e-6,
        ));
        out.push(hsdp_counts_case());
    }
    out.extend(routed::cases(world_size));
    out.extend(offload::cases(world_size));
    out.extend(float8::cases());
    out
}
