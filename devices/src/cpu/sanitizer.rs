//! The stream sanitizer: vector-clock race detection at enqueue time.
//!
//! Each stream has a vector clock (one counter per stream of the device);
//! each enqueued operation advances its own stream's counter and gets that
//! value as its position. Recording an event snapshots the stream's clock;
//! waiting on the event merges the snapshot into the waiting stream's clock;
//! host synchronization merges into a host clock that every later enqueue
//! inherits. Operation X (stream a, position p) happens before operation Y
//! on stream b exactly when Y's clock has `clock[a] >= p`.
//!
//! Per buffer, the sanitizer keeps the accesses that later accesses must be
//! ordered after. A new access conflicts with an earlier one on another
//! stream when either writes, their byte ranges intersect, and the earlier
//! does not happen before the new. The check runs when the operation is
//! enqueued, so a race is reported deterministically, before anything runs,
//! and the racing operation is not enqueued.
//!
//! A stream occupies a slot (a clock component) while it lives. When its
//! executor has run its last job, every later enqueue is ordered after all
//! of its work (the executor finished it, then took the sanitizer's lock),
//! so its records are dropped and the slot is reused; the next stream in
//! the slot continues the slot's positions, so no stale clock component can
//! order its operations. Clocks are as long as the most streams alive at
//! once, not as every stream ever made.

use std::collections::HashMap;
use std::ops::Range;

use crate::error::{AccessKind, RaceAccess, RaceReport};

/// One access an operation declares.
#[derive(Clone, Debug)]
pub struct Access {
    pub(crate) buffer: u64,
    /// The buffer's dtype and length, for the report's label: formatted
    /// only when a race is reported, not on every enqueue.
    pub(crate) shape: (crate::DType, usize),
    pub(crate) bytes: Range<usize>,
    pub(crate) kind: AccessKind,
}

impl Access {
    /// The operation reads `view`.
    pub fn read(view: crate::View<'_, super::Cpu>) -> Access {
        Access::new(view, AccessKind::Read)
    }
    /// The operation writes `view`.
    pub fn write(view: crate::View<'_, super::Cpu>) -> Access {
        Access::new(view, AccessKind::Write)
    }
    /// How a race report names the buffer.
    fn label(&self) -> String {
        format!("buffer #{} ({}[{}])", self.buffer, self.shape.0, self.shape.1)
    }
    fn new(view: crate::View<'_, super::Cpu>, kind: AccessKind) -> Access {
        use crate::Buffer;
        let b = view.buffer();
        Access { buffer: b.id(), shape: (b.dtype(), b.len()), bytes: view.byte_range(), kind }
    }
}

#[derive(Clone, Debug, Default)]
struct Clock(Vec<u64>);

impl Clock {
    fn get(&self, i: usize) -> u64 {
        self.0.get(i).copied().unwrap_or(0)
    }
    fn set(&mut self, i: usize, v: u64) {
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] = v;
    }
    fn merge(&mut self, other: &Clock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a = (*a).max(*b);
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    bytes: Range<usize>,
    kind: AccessKind,
    stream: usize,
    position: u64,
    op: &'static str,
}

/// The sanitizer's state for one device.
#[derive(Debug, Default)]
pub(crate) struct Sanitizer {
    /// Per slot: the stream's name and clock (kept after retirement, so the
    /// slot's next stream continues its positions).
    streams: Vec<(String, Clock)>,
    /// Slots whose stream has retired.
    free: Vec<usize>,
    host: Clock,
    events: HashMap<u64, Clock>,
    buffers: HashMap<u64, Vec<Entry>>,
}

fn intersects(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

fn covers(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

impl Sanitizer {
    /// Gives a new stream a slot.
    pub(crate) fn add_stream(&mut self, name: String) -> usize {
        match self.free.pop() {
            Some(slot) => {
                let last = self.streams[slot].1.get(slot);
                let mut clock = Clock::default();
                clock.set(slot, last);
                self.streams[slot] = (name, clock);
                slot
            }
            None => {
                self.streams.push((name, Clock::default()));
                self.streams.len() - 1
            }
        }
    }

    /// The stream in `slot` has run all its work: forget its accesses and free the slot.
    pub(crate) fn retire_stream(&mut self, slot: usize) {
        if slot >= self.streams.len() || self.free.contains(&slot) {
            return;
        }
        for entries in self.buffers.values_mut() {
            entries.retain(|e| e.stream != slot);
        }
        self.buffers.retain(|_, entries| !entries.is_empty());
        self.free.push(slot);
    }

    /// Slots in use: the length of every clock.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.streams.len()
    }

    /// Checks `accesses` of operation `op` on `stream`; on success records
    /// them and advances the stream's clock.
    pub(crate) fn enqueue(
        &mut self,
        stream: usize,
        op: &'static str,
        accesses: &[Access],
    ) -> Result<(), Box<RaceReport>> {
        let mut clock = self.streams.get(stream).map(|s| s.1.clone()).unwrap_or_default();
        clock.merge(&self.host);
        let position = clock.get(stream) + 1;
        clock.set(stream, position);
        let ordered = |e: &Entry| e.stream == stream || clock.get(e.stream) >= e.position;

        for a in accesses.iter().filter(|a| !a.bytes.is_empty()) {
            let Some(entries) = self.buffers.get(&a.buffer) else {
                continue;
            };
            let conflict = entries.iter().find(|e| {
                (e.kind == AccessKind::Write || a.kind == AccessKind::Write)
                    && intersects(&e.bytes, &a.bytes)
                    && !ordered(e)
            });
            if let Some(e) = conflict {
                let name = |i: usize| self.streams.get(i).map(|s| s.0.clone()).unwrap_or_default();
                return Err(Box::new(RaceReport {
                    buffer: a.label(),
                    previous: RaceAccess {
                        op: e.op.to_string(),
                        stream: name(e.stream),
                        position: e.position,
                        kind: e.kind,
                        bytes: e.bytes.clone(),
                    },
                    current: RaceAccess {
                        op: op.to_string(),
                        stream: name(stream),
                        position,
                        kind: a.kind,
                        bytes: a.bytes.clone(),
                    },
                }));
            }
        }

        for a in accesses.iter().filter(|a| !a.bytes.is_empty()) {
            let entries = self.buffers.entry(a.buffer).or_default();
            // An earlier access that this one covers and follows can be dropped:
            // anything ordered after this one is ordered after it too (clocks are
            // transitive). A write must stay on record until a write replaces it,
            // because later reads are checked against writes only.
            entries.retain(|e| {
                !(covers(&a.bytes, &e.bytes)
                    && ordered(e)
                    && (a.kind == AccessKind::Write || e.kind == AccessKind::Read))
            });
            entries.push(Entry { bytes: a.bytes.clone(), kind: a.kind, stream, position, op });
        }
        if let Some(s) = self.streams.get_mut(stream) {
            s.1 = clock;
        }
        Ok(())
    }

    pub(crate) fn record_event(&mut self, event: u64, stream: usize) {
        let clock = self.streams.get(stream).map(|s| s.1.clone()).unwrap_or_default();
        self.events.insert(event, clock);
    }

    pub(crate) fn wait_event(&mut self, event: u64, stream: usize) {
        if let (Some(snapshot), Some(s)) = (self.events.get(&event), self.streams.get_mut(stream)) {
            s.1.merge(snapshot);
        }
    }

    pub(crate) fn host_synced_stream(&mut self, stream: usize) {
        if let Some(s) = self.streams.get(stream) {
            let c = s.1.clone();
            self.host.merge(&c);
        }
    }

    pub(crate) fn host_synced_event(&mut self, event: u64) {
        if let Some(c) = self.events.get(&event).cloned() {
            self.host.merge(&c);
        }
    }

    pub(crate) fn forget_buffer(&mut self, buffer: u64) {
        self.buffers.remove(&buffer);
    }

    pub(crate) fn forget_event(&mut self, event: u64) {
        self.events.remove(&event);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::cpu::CpuDevice;
    use crate::{Buffer, DType, Device, Scalar, Stream};

    #[test]
    fn clocks_stay_as_long_as_the_streams_alive_at_once() {
        let dev = CpuDevice::with_ordinal(0);
        let keep = dev.create_stream(crate::Priority::Normal).unwrap();
        let buf = dev.alloc(DType::F32, 16).unwrap();
        for i in 0..200 {
            let s = dev.create_stream(crate::Priority::Normal).unwrap();
            s.fill(buf.view(), Scalar::Float(i as f64)).unwrap();
            s.synchronize().unwrap();
            drop(s);
            // The executor retires the slot when it exits, after the drop.
            let start = Instant::now();
            while dev.with_sanitizer(|z| z.free.len()).unwrap_or(0) == 0 && start.elapsed() < Duration::from_secs(10) {
                std::thread::yield_now();
            }
        }
        let slots = dev.with_sanitizer(|z| z.slots()).unwrap();
        assert!(slots <= 3, "{slots} slots after 200 short-lived streams");
        // The long-lived stream and a reused slot still order correctly: a
        // fill on `keep` after the host synchronized is accepted, and the
        // value is the last one written.
        keep.fill(buf.view(), Scalar::Float(-1.0)).unwrap();
        assert_eq!(crate::StreamExt::read_vec::<f32>(&keep, buf.view()).unwrap(), vec![-1.0; 16]);
    }

    #[test]
    fn a_reused_slot_does_not_inherit_the_old_streams_order() {
        let dev = CpuDevice::with_ordinal(0);
        let buf = dev.alloc(DType::F32, 16).unwrap();
        let other = dev.create_stream(crate::Priority::Normal).unwrap();
        // `other` writes without any host synchronization afterwards.
        let first = dev.create_stream(crate::Priority::Normal).unwrap();
        first.synchronize().unwrap();
        drop(first);
        let start = Instant::now();
        while dev.with_sanitizer(|z| z.free.len()).unwrap_or(0) == 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::yield_now();
        }
        other.fill(buf.view(), Scalar::Float(1.0)).unwrap();
        // A new stream in the freed slot must still see the race with `other`.
        let second = dev.create_stream(crate::Priority::Normal).unwrap();
        let e = second.fill(buf.view(), Scalar::Float(2.0)).unwrap_err();
        assert!(matches!(e, crate::DeviceError::Race(_)), "{e}");
        other.synchronize().unwrap();
    }
}
