//! A backend wrapper that counts every call by kind and communicator size,
//! and the bytes each rank sends in them, so tests see the collectives FSDP
//! really issues.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chorus_collectives::backend::{Call, Capabilities, CommBackend, OpKind};
use chorus_collectives::Result;
use chorus_devices::Backend;

/// Per (kind, communicator size): calls and the bytes of their first view
/// (the send buffer: what this rank contributes).
type Tally = HashMap<(OpKind, usize), (usize, usize)>;

/// Counts shared by a wrapped communicator and everything split from it.
#[derive(Clone, Debug, Default)]
pub struct Counts(Arc<Mutex<Tally>>);

impl Counts {
    /// Calls of `kind` on communicators of `size` ranks.
    pub fn get(&self, kind: OpKind, size: usize) -> usize {
        self.0.lock().map(|m| m.get(&(kind, size)).map_or(0, |c| c.0)).unwrap_or(0)
    }
    /// Bytes this rank sent in calls of `kind` on communicators of `size`
    /// ranks (each call's send buffer).
    pub fn bytes(&self, kind: OpKind, size: usize) -> usize {
        self.0.lock().map(|m| m.get(&(kind, size)).map_or(0, |c| c.1)).unwrap_or(0)
    }
    /// Forgets every count.
    pub fn clear(&self) {
        if let Ok(mut m) = self.0.lock() {
            m.clear();
        }
    }
    fn add(&self, kind: OpKind, size: usize, bytes: usize) {
        if let Ok(mut m) = self.0.lock() {
            let c = m.entry((kind, size)).or_default();
            c.0 += 1;
            c.1 += bytes;
        }
    }
}

/// `C` with every launched call counted.
pub struct Counting<C> {
    inner: C,
    counts: Counts,
}

impl<C> Counting<C> {
    /// Wraps `inner`, counting into `counts`.
    pub fn new(inner: C, counts: Counts) -> Self {
        Counting { inner, counts }
    }
}

impl<C: CommBackend> CommBackend for Counting<C> {
    type B = C::B;
    const NAME: &'static str = C::NAME;
    chorus_collectives::forward_to_inner!(inner);
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn launch(&self, calls: Vec<Call<'_, C::B>>, stream: &<C::B as Backend>::Stream) -> Result<()> {
        for c in &calls {
            let bytes = c.kind().views().first().map_or(0, |v| v.bytes());
            self.counts.add(c.kind().kind(), self.inner.size(), bytes);
        }
        self.inner.launch(calls, stream)
    }
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Self>> {
        Ok(self.inner.split(color, key)?.map(|inner| Counting { inner, counts: self.counts.clone() }))
    }
}
