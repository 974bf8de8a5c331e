//! The simulated NCCL ABI: an in-process library with NCCL's C interface on
//! cpu devices, so the NCCL family's communicator ([`VendorComm`](crate::nccl_family::VendorComm)) — the code
//! that runs NCCL and RCCL on GPUs — runs in CI, and the library's usage
//! rules are enforced where a GPU would enforce them.
//!
//! It keeps NCCL's semantics that chorus depends on:
//! - **non-blocking** communicators: `ncclGroupEnd` returns `ncclInProgress`
//!   and the kernels are enqueued on the caller's stream later, from the
//!   library's own thread; `ncclCommSplit` returns `ncclSuccess` at once (as
//!   NCCL 2.28 does; only the parent's async error says when the split is
//!   done) and writes the child handle into the caller's slot when the split
//!   completes, milliseconds later. A caller that returns before the group
//!   is enqueued gets stale results; one that reads the split's handle early
//!   reads null — as on NCCL;
//! - **a destroy waits for the whole device** to be idle, as NCCL's does
//!   (it frees device memory, and a free waits for every stream): work that
//!   never ends holds it up, here within the device's deadline;
//! - **the data plane** is the sim backend's (rendezvous by call number,
//!   every dtype and operator, rank-order reductions), on raw addresses;
//! - **a known bug**: versions before 2.29.7 leave the elements past the
//!   last multiple of 256 unwritten (`Avg`) or unscaled (`PreMulSum`) in
//!   one-rank all-reduces and reduce-scatters, as NCCL 2.28 does on an H100
//!   (NVIDIA/nccl#1950) — so the workaround's version gate is tested;
//! - **the rules, checked**: a call on a handle that was aborted or
//!   destroyed, two calls on one communicator at once, a call on a
//!   communicator whose non-blocking operation is still in progress, a
//!   reduce operator used after it was destroyed, a finalize or destroy on
//!   the watchdog's thread (NCCL's destroy blocks), a destroy of a
//!   communicator that is not ready (NCCL 2.28 returns early from it inside
//!   an open group, so the thread's later calls never run): each returns
//!   `ncclInvalidUsage` and is recorded ([`take_violations`]), where NCCL
//!   would crash, hang or corrupt memory.
//!
//! What it does not simulate: a missing peer is only noticed by the
//! caller's deadline (the library has none of its own within the test
//! horizon), and a mismatched call is an error of the library, not a hang.

mod calls;
mod ffi;
mod state;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use chorus_devices::cpu::Cpu;

use super::abi::Version;
use super::result::Lib;
use super::sys::Api;
use super::VendorLib;
use crate::Result;

pub use state::take_violations;

/// The simulated library, reporting NCCL version `CODE` (`NCCL_VERSION`
/// encoding, e.g. `22803` for 2.28.3).
#[derive(Debug)]
pub enum SimNccl<const CODE: i32> {}

/// The simulated library as NCCL 2.28.3, the H100 node's: one-rank
/// `Avg`/`PreMulSum` are broken there and chorus must work around them.
pub type SimNccl228 = SimNccl<22803>;
/// The simulated library as NCCL 2.30.7, where the bug is fixed.
pub type SimNccl230 = SimNccl<23007>;

impl<const CODE: i32> VendorLib for SimNccl<CODE> {
    const NAME: &'static str = "simnccl";
    type B = Cpu;

    fn lib() -> Result<Lib> {
        Ok(Lib { api: api(CODE), name: "simnccl" })
    }

    fn one_rank_scaling_broken(version: Version) -> bool {
        super::abi::nccl_one_rank_scaling_broken(version)
    }
}

/// The symbol table of the simulated library reporting `code`.
fn api(code: i32) -> &'static Api {
    static APIS: OnceLock<Mutex<HashMap<i32, &'static Api>>> = OnceLock::new();
    let apis = APIS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut apis = apis.lock().unwrap_or_else(|p| p.into_inner());
    apis.entry(code).or_insert_with(|| Box::leak(Box::new(ffi::table(code))))
}
