//! The events FSDP's streams order themselves with, made once and reused.
//!
//! Every hook orders streams through events (copy-in before all-gather,
//! all-gather before copy-out, compute before reduce-scatter, ...); making
//! and destroying one per synchronisation point is a driver call each on a
//! GPU. A wait takes the record the event has when the wait is enqueued
//! (CUDA's `cuStreamWaitEvent`; the cpu device and its sanitizer alike), so
//! an event may be recorded again once every wait on its record has been
//! enqueued. That is the pool's one rule: an event goes back only after its
//! waits are enqueued, never while a wait on it is still to be issued.

use std::sync::Mutex;

use chorus_collectives::CommBackend;
use chorus_devices::{Device, Stream};

use crate::{Ev, Result, Strm};

/// Idle events of one device.
pub(crate) struct EventPool<C: CommBackend> {
    idle: Mutex<Vec<Ev<C>>>,
}

impl<C: CommBackend> Default for EventPool<C> {
    fn default() -> Self {
        EventPool { idle: Mutex::new(Vec::new()) }
    }
}

impl<C: CommBackend> EventPool<C> {
    /// An idle event, or a new one of `device`.
    pub(crate) fn take(&self, device: &<C::B as chorus_devices::Backend>::Device) -> Result<Ev<C>> {
        if let Some(e) = self.idle.lock().ok().and_then(|mut idle| idle.pop()) {
            return Ok(e);
        }
        Ok(device.create_event()?)
    }

    /// Returns `event`, every wait on whose record has been enqueued.
    pub(crate) fn give(&self, event: Ev<C>) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(event);
        }
    }

    /// An event recorded on `stream` now (to be waited on later and then given back).
    pub(crate) fn record(&self, device: &<C::B as chorus_devices::Backend>::Device, stream: &Strm<C>) -> Result<Ev<C>> {
        let e = self.take(device)?;
        stream.record(&e)?;
        Ok(e)
    }

    /// Makes each of `waiters` wait (on the device) for what `stream` has enqueued so far.
    pub(crate) fn order(
        &self,
        device: &<C::B as chorus_devices::Backend>::Device,
        stream: &Strm<C>,
        waiters: &[&Strm<C>],
    ) -> Result<()> {
        let e = self.record(device, stream)?;
        self.wait_and_give(e, waiters)
    }

    /// Makes each of `waiters` wait for `event`'s record, then takes it back.
    pub(crate) fn wait_and_give(&self, event: Ev<C>, waiters: &[&Strm<C>]) -> Result<()> {
        let waited = waiters.iter().try_for_each(|w| w.wait(&event));
        // Given back even after a failed wait: nothing waits on it any more.
        self.give(event);
        Ok(waited?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_collectives::sim::SimComm;
    use chorus_devices::cpu::{CpuConfig, CpuDevice};
    use chorus_devices::{Buffer, DType, DeviceError, Priority, Scalar};

    /// The pool's rule on the cpu device's sanitizer: an event given back
    /// after its wait was enqueued orders the waiter, even once it is
    /// recorded again elsewhere; one given back before its wait (and taken
    /// and recorded elsewhere meanwhile) orders the waiter after the wrong
    /// stream, and the sanitizer reports the read that follows as a race.
    #[test]
    fn an_event_goes_back_only_after_its_waits_are_enqueued() -> Result<()> {
        let dev = CpuDevice::new(CpuConfig::default());
        let stream = || dev.create_stream(Priority::Normal);
        let (a, b, c) = (stream()?, stream()?, stream()?);
        let pool = EventPool::<SimComm>::default();

        let x = a.alloc(DType::F32, 16)?;
        a.fill(x.view(), Scalar::Float(1.0))?;
        let e = pool.record(&dev, &a)?;
        pool.wait_and_give(e, &[&b])?;
        // The same event, recorded again on another stream: B's wait already took A's record.
        let reused = pool.record(&dev, &c)?;
        pool.give(reused);
        let y = b.alloc(DType::F32, 16)?;
        b.copy(x.view(), y.view())?;

        let z = a.alloc(DType::F32, 16)?;
        a.fill(z.view(), Scalar::Float(2.0))?;
        let e = pool.record(&dev, &a)?;
        pool.give(e); // too early: B has not waited yet
        let taken = pool.record(&dev, &c)?;
        b.wait(&taken)?;
        let w = b.alloc(DType::F32, 16)?;
        match b.copy(z.view(), w.view()) {
            Err(DeviceError::Race(_)) => {}
            other => panic!("a read ordered after the wrong stream was not reported: {other:?}"),
        }
        dev.synchronize()?;
        Ok(())
    }
}
