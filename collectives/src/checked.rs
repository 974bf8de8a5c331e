//! The checked wrapper: call-sequence checks across ranks for any backend.
//!
//! A vendor library cannot see a peer's call: when ranks disagree on a
//! collective, NCCL hangs or corrupts memory. [`Checked`] wraps any
//! [`CommBackend`] (PyTorch has this only for NCCL, as `ProcessGroupWrapper`)
//! and, before each launch, compares what every rank is about to do through
//! a side channel — the rendezvous [`Store`]:
//! - a launch with collectives publishes their sequence numbers and
//!   fingerprints under `{prefix}/c/{seq}/{rank}` and reads every rank's; if
//!   they differ, every rank fails the launch's stream with
//!   [`CommError::Mismatch`] naming the ranks and the calls of each, and none
//!   issues it (so the wrapped communicator stays in step); a rank that does
//!   not publish within the deadline makes the others fail with
//!   [`CommError::Timeout`] naming it;
//! - a send publishes its dtype and count under `{prefix}/p/{src}-{dst}/{n}`;
//!   the matching receive compares and answers under `{prefix}/a/...`, so a
//!   send and a receive that disagree fail on both ranks with `Mismatch`.
//!
//! Every rank deletes its own collective keys of the previous check once the
//! current one has completed (by then every rank has read them), and a
//! pair's keys are deleted by their reader, so the store does not grow. The checks block the host per launch: a debug mode, switchable
//! at run time ([`Checked::set_enabled`], shared with the communicator's
//! splits); switched off, a launch costs one atomic load more.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_devices::{Backend, DeviceError, ForeignBackend, Stream};

use crate::backend::{Call, CallKind, Capabilities, CommBackend, OpKind};
use crate::bootstrap::Store;
use crate::{CommError, Communicator, Result};

/// A communicator whose calls are checked across ranks before they run.
pub struct Checked<C: CommBackend> {
    inner: C,
    store: Arc<dyn Store>,
    prefix: String,
    timeout: Duration,
    enabled: Arc<AtomicBool>,
    /// The previous check's keys of this rank, deleted after the next check.
    stale: Mutex<Vec<String>>,
    splits: AtomicU64,
    /// Sends to and receives from each peer so far (they are numbered per pair).
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
}

impl<C: CommBackend> std::fmt::Debug for Checked<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checked({} rank {}/{}, {})", C::NAME, self.inner.rank(), self.inner.size(), self.prefix)
    }
}

impl<C: CommBackend> Checked<C>
where
    C::B: ForeignBackend,
{
    /// Wraps `inner`. Every rank of the communicator must wrap it with the
    /// same `store` and `prefix` (unique per communicator in the store);
    /// `timeout` bounds each check's wait for the other ranks.
    pub fn new(inner: C, store: Arc<dyn Store>, prefix: impl Into<String>, timeout: Duration) -> Checked<C> {
        Checked::with_switch(inner, store, prefix.into(), timeout, Arc::new(AtomicBool::new(true)))
    }

    /// Wraps every communicator of a world (rank order does not matter) with
    /// one store and prefix.
    pub fn wrap(comm: Communicator<C>, store: Arc<dyn Store>, prefix: &str, timeout: Duration) -> Communicator<Self> {
        Communicator::new(Checked::new(comm.into_backend(), store, prefix, timeout))
    }

    fn with_switch(
        inner: C,
        store: Arc<dyn Store>,
        prefix: String,
        timeout: Duration,
        enabled: Arc<AtomicBool>,
    ) -> Checked<C> {
        Checked {
            inner,
            store,
            prefix,
            timeout,
            enabled,
            stale: Mutex::new(Vec::new()),
            splits: AtomicU64::new(0),
            sent: Mutex::new(HashMap::new()),
            received: Mutex::new(HashMap::new()),
        }
    }

    /// Turns the checks on or off, for this communicator and its splits.
    /// Every rank must switch at the same point of its call sequence.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Release);
    }

    /// Whether the checks are on.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Compares `calls` with every rank's; `Err` with the failure every rank
    /// reaches alike.
    fn check(&self, calls: &[Call<'_, C::B>]) -> Result<()> {
        let me = self.inner.rank();
        let mut mine = Vec::new();
        let mut published: Vec<String> = Vec::new();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let collective_seq =
            calls.iter().find(|c| !matches!(c.kind().kind(), OpKind::Send | OpKind::Recv)).map(|c| c.seq());
        for c in calls {
            match c.kind() {
                CallKind::Send { buf, peer } => {
                    let n = next(&self.sent, *peer);
                    let key = format!("{}/p/{me}-{peer}/{n}", self.prefix);
                    self.store.set(&key, format!("{} x {}", buf.len(), buf.dtype()).as_bytes())?;
                    sends.push((*peer, n));
                }
                CallKind::Recv { buf, peer } => recvs.push((*peer, format!("{} x {}", buf.len(), buf.dtype()))),
                _ => mine.push(format!("#{} {}", c.seq(), c.fingerprint())),
            }
        }
        let mut failure: Option<CommError> = None;
        // Receives first: they answer the peers' sends, which publish before waiting.
        for (peer, expected) in recvs {
            let n = next(&self.received, peer);
            let key = format!("{}/p/{peer}-{me}/{n}", self.prefix);
            let sent = String::from_utf8_lossy(&self.store.get(&key, self.timeout)?).into_owned();
            // A pair's keys are deleted by their reader: nobody else needs them.
            let _ = self.store.delete(&key);
            let answer = if sent == expected {
                "ok".to_string()
            } else {
                format!("rank {peer} sent {sent} to rank {me}, which posted a recv of {expected}")
            };
            let ack = format!("{}/a/{peer}-{me}/{n}", self.prefix);
            self.store.set(&ack, answer.as_bytes())?;
            if answer != "ok" {
                failure.get_or_insert(CommError::Mismatch { seq: 0, details: answer });
            }
        }
        if let Some(seq) = collective_seq {
            let text = mine.join("; ");
            let key = format!("{}/c/{seq}/{me}", self.prefix);
            self.store.set(&key, text.as_bytes())?;
            published.push(key);
            let n = self.inner.size();
            let keys: Vec<String> = (0..n).map(|r| format!("{}/c/{seq}/{r}", self.prefix)).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match self.store.multi_get(&refs, self.timeout) {
                Ok(values) => {
                    let values: Vec<String> =
                        values.into_iter().map(|v| String::from_utf8_lossy(&v).into_owned()).collect();
                    if values.iter().any(|v| *v != values[0]) {
                        let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
                        for (r, v) in values.iter().enumerate() {
                            match groups.iter_mut().find(|(x, _)| *x == v.as_str()) {
                                Some((_, ranks)) => ranks.push(r),
                                None => groups.push((v.as_str(), vec![r])),
                            }
                        }
                        let details: Vec<String> =
                            groups.iter().map(|(v, ranks)| format!("ranks {ranks:?} called {v}")).collect();
                        failure.get_or_insert(CommError::Mismatch { seq, details: details.join("; ") });
                    }
                }
                Err(CommError::Timeout { waited, .. }) => {
                    let present: Vec<bool> = refs.iter().map(|k| self.store.check(&[k]).unwrap_or(false)).collect();
                    let missing: Vec<usize> = (0..n).filter(|r| !present[*r]).collect();
                    let op =
                        calls.iter().find(|c| c.seq() == seq).map(|c| c.kind().kind().name()).unwrap_or("collective");
                    failure.get_or_insert(CommError::Timeout { op: op.to_string(), seq, waited, missing });
                }
                Err(e) => return Err(e),
            }
        }
        for (peer, n) in sends {
            let ack = format!("{}/a/{me}-{peer}/{n}", self.prefix);
            let answer = String::from_utf8_lossy(&self.store.get(&ack, self.timeout)?).into_owned();
            let _ = self.store.delete(&ack);
            if answer != "ok" {
                failure.get_or_insert(CommError::Mismatch { seq: 0, details: answer });
            }
        }
        // Every rank has read what this rank published before the last check
        // (a call refused locally after its check is issued again under the
        // same number: its key is kept).
        let stale = self.stale.lock().map(|mut s| std::mem::replace(&mut *s, published.clone())).unwrap_or_default();
        for key in stale.iter().filter(|k| !published.contains(k)) {
            let _ = self.store.delete(key);
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Fails `stream` from its next position with `error` (the launch is not issued).
    fn fail_stream(&self, stream: &<C::B as Backend>::Stream, op: &'static str, error: CommError) -> Result<()> {
        let handle = C::B::failure_handle(stream);
        let wrapped = DeviceError::OpFailed { op, stream: stream.name(), source: Arc::new(error) };
        if let Some(pos) = C::B::enqueue_foreign(stream, op, &[], &mut |_| Ok(())).map_err(CommError::Device)? {
            handle.fail(pos, wrapped);
        }
        Ok(())
    }
}

/// The next number of a pair's sends (or receives), counting this one.
fn next(counters: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
    match counters.lock() {
        Ok(mut c) => {
            let n = c.entry(peer).or_insert(0);
            *n += 1;
            *n
        }
        Err(_) => 0,
    }
}

impl<C: CommBackend> CommBackend for Checked<C>
where
    C::B: ForeignBackend,
{
    type B = C::B;
    const NAME: &'static str = C::NAME;

    crate::forward_to_inner!(inner);

    fn capabilities(&self) -> Capabilities {
        let enabled = self.enabled();
        let mut caps = self.inner.capabilities();
        caps.detects_mismatch |= enabled;
        caps.names_missing_ranks |= enabled;
        caps
    }

    fn launch(&self, calls: Vec<Call<'_, C::B>>, stream: &<C::B as Backend>::Stream) -> Result<()> {
        if self.enabled() {
            let op = if calls.len() == 1 { calls[0].kind().kind().name() } else { "group" };
            if let Err(e) = self.check(&calls) {
                // Every rank reached the same verdict and issues nothing:
                // the wrapped communicator stays in step.
                return self.fail_stream(stream, op, e);
            }
        }
        self.inner.launch(calls, stream)
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Self>> {
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let child = self.inner.split(color, key)?;
        Ok(child.map(|c| {
            let prefix = format!("{}/split{n}/color{}", self.prefix, color.unwrap_or(u32::MAX));
            Checked::with_switch(c, self.store.clone(), prefix, self.timeout, self.enabled.clone())
        }))
    }
}
