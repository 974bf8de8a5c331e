//! Events: completion flags with acquire/release ordering.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::device::{next_id, CpuDevice};
use super::Cpu;
use crate::{DeviceError, Result};

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// One record of an event: set once, by the executor that reaches the marker.
#[derive(Debug)]
pub(crate) struct Completion {
    state: AtomicU8,
    error: Mutex<Option<DeviceError>>,
    /// Host threads waiting on `cv`: a completion nobody waits for makes no
    /// wake-up system call (most are only queried, by the flight recorder).
    waiters: Mutex<usize>,
    cv: Condvar,
}

impl Completion {
    pub(crate) fn new() -> Arc<Completion> {
        Arc::new(Completion {
            state: AtomicU8::new(PENDING),
            error: Mutex::new(None),
            waiters: Mutex::new(0),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn complete(&self, error: Option<DeviceError>) {
        let state = match error {
            Some(e) => {
                if let Ok(mut slot) = self.error.lock() {
                    *slot = Some(e);
                }
                FAILED
            }
            None => DONE,
        };
        // Release: everything the executor did before the marker is visible
        // to whoever observes the flag with acquire.
        let waiters = self.waiters.lock();
        self.state.store(state, Ordering::Release);
        if waiters.map_or(true, |w| *w > 0) {
            self.cv.notify_all();
        }
    }

    fn error(&self) -> DeviceError {
        self.error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_else(|| DeviceError::invalid("event", "failed without a recorded cause"))
    }

    pub(crate) fn query(&self) -> Result<bool> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(false),
            DONE => Ok(true),
            _ => Err(self.error()),
        }
    }

    pub(crate) fn wait(&self, timeout: Duration, what: &str) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.waiters.lock().map_err(|_| DeviceError::invalid("event", "lock poisoned"))?;
        loop {
            if self.query()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DeviceError::Timeout { what: what.to_string(), waited: timeout });
            }
            // Counted under the lock `complete` takes: it either sees this
            // waiter or stored its state before the query above.
            *guard += 1;
            guard = self
                .cv
                .wait_timeout(guard, deadline - now)
                .map_err(|_| DeviceError::invalid("event", "lock poisoned"))?
                .0;
            *guard -= 1;
        }
    }
}

/// An event of the cpu device.
#[derive(Debug)]
pub struct CpuEvent {
    pub(crate) id: u64,
    pub(crate) device: CpuDevice,
    current: Mutex<Option<Arc<Completion>>>,
}

impl CpuEvent {
    pub(crate) fn new(device: &CpuDevice) -> CpuEvent {
        CpuEvent { id: next_id(), device: device.clone(), current: Mutex::new(None) }
    }

    /// Starts a new record and returns its completion (set by the stream's marker).
    pub(crate) fn begin_record(&self) -> Arc<Completion> {
        let c = Completion::new();
        if let Ok(mut cur) = self.current.lock() {
            *cur = Some(c.clone());
        }
        c
    }

    pub(crate) fn current(&self) -> Option<Arc<Completion>> {
        self.current.lock().ok().and_then(|c| c.clone())
    }
}

impl crate::Event for CpuEvent {
    type B = Cpu;

    fn synchronize(&self) -> Result<()> {
        crate::host_fn::check("event synchronize")?;
        if let Some(c) = self.current() {
            c.wait(self.device.config().timeout, &format!("event #{}", self.id))?;
        }
        let id = self.id;
        self.device.with_sanitizer(|s| s.host_synced_event(id));
        Ok(())
    }

    fn query(&self) -> Result<bool> {
        crate::host_fn::check("event query")?;
        match self.current() {
            Some(c) => c.query(),
            None => Ok(true),
        }
    }
}

impl Drop for CpuEvent {
    fn drop(&mut self) {
        self.device.check_drop("a cpu event");
        let id = self.id;
        self.device.with_sanitizer(|s| s.forget_event(id));
    }
}
