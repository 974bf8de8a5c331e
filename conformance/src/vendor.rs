//! The harness of the NCCL family: NCCL on cuda devices, RCCL on hip devices
//! and the simulated NCCL ABI on cpu devices, one rank per device as threads
//! of this process, bootstrapped through an in-memory store.
//!
//! The libraries cannot see a peer's call, name a missing rank, reach other
//! ranks with an abort, or inject faults: the cases that need those are
//! skipped with the reason (the checked wrapper's harness runs the mismatch
//! cases). With the simulated library, every case is also checked for the
//! library's usage rules (a handle used after abort, concurrent calls, ...).

use std::marker::PhantomData;
use std::time::Duration;

use anyhow::bail;
use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl_family::{VendorComm, VendorConfig, VendorLib};
use chorus_collectives::{Capabilities, Communicator};
use chorus_devices::{Backend, ComputeBackend, ForeignBackend};

use crate::harness::{Harness, World};
use crate::process::{RankEnv, RankHarness};
use crate::rank_threads::{start_deadline, start_ranks};
use crate::Support;

/// A device backend the vendor harness can make devices of.
pub trait HarnessDevice: ForeignBackend {
    /// Devices visible (the largest world), or why none.
    fn count() -> Result<usize, String>;
    /// Rank `rank`'s device, with host waits bounded by `timeout`.
    fn make(rank: usize, timeout: Duration) -> Result<<Self as Backend>::Device, crate::Failure>;
    /// Whether the devices run the stream sanitizer.
    fn sanitizer() -> bool;
}

impl HarnessDevice for chorus_devices::cpu::Cpu {
    fn count() -> Result<usize, String> {
        Ok(usize::MAX)
    }
    fn make(rank: usize, timeout: Duration) -> Result<chorus_devices::cpu::CpuDevice, crate::Failure> {
        use chorus_devices::cpu::{CpuConfig, CpuDevice};
        Ok(CpuDevice::new(CpuConfig::default().with_ordinal(rank).with_timeout(timeout)))
    }
    fn sanitizer() -> bool {
        true
    }
}

#[cfg(feature = "nccl")]
impl HarnessDevice for chorus_devices::cuda::Cuda {
    fn count() -> Result<usize, String> {
        chorus_devices::cuda::device_count().map_err(|e| format!("no CUDA devices: {e}"))
    }
    fn make(rank: usize, timeout: Duration) -> Result<chorus_devices::cuda::CudaDevice, crate::Failure> {
        use chorus_devices::cuda::{CudaConfig, CudaDevice};
        Ok(CudaDevice::with_config(CudaConfig { ordinal: rank, timeout })?)
    }
    fn sanitizer() -> bool {
        false
    }
}

#[cfg(feature = "rccl")]
impl HarnessDevice for chorus_devices::hip::Hip {
    fn count() -> Result<usize, String> {
        chorus_devices::hip::device_count().map_err(|e| format!("no HIP devices: {e}"))
    }
    fn make(rank: usize, timeout: Duration) -> Result<chorus_devices::hip::HipDevice, crate::Failure> {
        use chorus_devices::hip::{HipConfig, HipDevice};
        Ok(HipDevice::new(HipConfig { ordinal: rank, timeout, ..HipConfig::default() })?)
    }
    fn sanitizer() -> bool {
        false
    }
}

/// The harness of library `L`.
pub struct VendorHarness<L> {
    _lib: PhantomData<fn() -> L>,
}

impl<L> Default for VendorHarness<L> {
    fn default() -> Self {
        VendorHarness { _lib: PhantomData }
    }
}

/// What a library that cannot be loaded here would be assumed to offer when
/// listing cases: a current release (NCCL 2.18+ has `Avg` and `PreMulSum`).
const ASSUMED: Capabilities = Capabilities {
    avg: true,
    premul_sum: true,
    ranks_share_device: false,
    world_abort: false,
    fault_injection: false,
    detects_mismatch: false,
    names_missing_ranks: false,
};

impl<L: VendorLib> Harness for VendorHarness<L>
where
    L::B: HarnessDevice + ComputeBackend,
{
    type C = VendorComm<L>;

    fn name(&self) -> String {
        L::NAME.into()
    }

    fn support(&self) -> Support {
        Support {
            capabilities: VendorComm::<L>::declared_capabilities().unwrap_or(ASSUMED),
            stream_sanitizer: L::B::sanitizer(),
            fault_hooks: false,
        }
    }

    fn max_world(&self) -> Result<usize, String> {
        VendorComm::<L>::library_version().map_err(|e| e.to_string())?;
        L::B::count()
    }

    fn world(&self, size: usize, timeout: Duration) -> Result<World<VendorComm<L>>, crate::Failure> {
        let store = MemStore::new();
        let config = VendorConfig { timeout, ..VendorConfig::default() };
        // Initialization is collective: every rank at once, one thread each.
        let comms = start_ranks(L::NAME, size, start_deadline(timeout), move |rank| {
            let device = L::B::make(rank, timeout * 2)?;
            Ok(VendorComm::<L>::init(&store, rank, size, device, config.clone())?)
        })?;
        Ok(World { comms, faults: None })
    }

    fn shared_timeout(&self) -> Duration {
        Duration::from_secs(60)
    }

    fn extra_cases(&self, world_size: usize) -> Vec<crate::Case<VendorComm<L>>> {
        crate::fsdp::cases(world_size)
    }

    fn fresh_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    #[cfg(feature = "sim")]
    fn after_case(&self) -> Result<(), String> {
        if L::NAME != chorus_collectives::nccl_family::simlib::SimNccl228::NAME {
            return Ok(());
        }
        let v = chorus_collectives::nccl_family::simlib::take_violations();
        if v.is_empty() {
            Ok(())
        } else {
            Err(format!("the simulated NCCL saw its usage rules broken: {}", v.join("; ")))
        }
    }
}

/// One rank per process (NCCL or RCCL under a launcher): the unique id goes
/// through the job's store, `LOCAL_RANK` picks the device. The simulated
/// library's rendezvous lives in one process, so it refuses.
impl<L: VendorLib> RankHarness for VendorHarness<L>
where
    L::B: HarnessDevice + ComputeBackend,
{
    fn join(
        &self,
        env: &RankEnv,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Communicator<VendorComm<L>>, crate::Failure> {
        if L::NAME == "simnccl" {
            bail!("the simulated NCCL's rendezvous is inside one process: it cannot run one rank per process");
        }
        let device = L::B::make(env.local_rank, timeout * 2)?;
        let config = VendorConfig { timeout, store_key: format!("{prefix}/unique_id"), ..VendorConfig::default() };
        Ok(VendorComm::<L>::init(&*env.store, env.rank, env.size, device, config)?)
    }
}
