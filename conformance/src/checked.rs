//! The checked wrapper's harness: any harness's worlds, each communicator
//! wrapped in [`Checked`] over one in-memory store, so the call-sequence
//! checks (mismatch, missing rank) run on backends that cannot make them
//! themselves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::checked::Checked;
use chorus_devices::{ComputeBackend, ForeignBackend};

use crate::harness::{Harness, World};
use crate::{Case, Support};

/// Harness `H` with every communicator checked.
#[derive(Default)]
pub struct CheckedHarness<H> {
    inner: H,
    worlds: AtomicU64,
}

impl<H> CheckedHarness<H> {
    /// Wraps `inner`.
    pub fn new(inner: H) -> Self {
        CheckedHarness { inner, worlds: AtomicU64::new(0) }
    }
}

impl<H: Harness> Harness for CheckedHarness<H>
where
    <H::C as chorus_collectives::CommBackend>::B: ForeignBackend + ComputeBackend,
{
    type C = Checked<H::C>;

    fn name(&self) -> String {
        format!("checked {}", self.inner.name())
    }

    fn support(&self) -> Support {
        let mut s = self.inner.support();
        s.capabilities.detects_mismatch = true;
        s.capabilities.names_missing_ranks = true;
        s
    }

    fn max_world(&self) -> Result<usize, String> {
        self.inner.max_world()
    }

    fn world(&self, size: usize, timeout: Duration) -> Result<World<Self::C>, crate::Failure> {
        let inner = self.inner.world(size, timeout)?;
        let store: Arc<dyn chorus_collectives::bootstrap::Store> = Arc::new(MemStore::new());
        let prefix = format!("checked/{}", self.worlds.fetch_add(1, Ordering::Relaxed));
        let comms = inner.comms.into_iter().map(|c| Checked::wrap(c, store.clone(), &prefix, timeout)).collect();
        Ok(World { comms, faults: inner.faults })
    }

    fn shared_timeout(&self) -> Duration {
        self.inner.shared_timeout()
    }

    fn fresh_timeout(&self) -> Duration {
        self.inner.fresh_timeout()
    }

    fn case_deadline(&self, timeout: Duration) -> Duration {
        self.inner.case_deadline(timeout)
    }

    fn extra_cases(&self, world_size: usize) -> Vec<Case<Self::C>> {
        crate::fsdp::cases(world_size)
    }

    fn after_case(&self) -> Result<(), String> {
        self.inner.after_case()
    }
}
