//! Device→host copies that complete asynchronously.

use crate::{DType, DeviceError, Element};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Slot {
    state: Mutex<Option<Result<Vec<u8>, DeviceError>>>,
    ready: Condvar,
}

/// The host side of an enqueued device→host copy. It completes when the copy
/// has run on its stream; [`Readback::wait`] blocks the host for it.
#[derive(Debug)]
pub struct Readback {
    slot: Arc<Slot>,
    dtype: DType,
    len: usize,
    timeout: Duration,
}

/// The device side of a [`Readback`]: the backend fills it when the copy has
/// run, or fails it. Dropping it unfilled fails the readback, so a host wait
/// never outlives the work it waits for.
#[derive(Debug)]
pub struct ReadbackFiller {
    slot: Option<Arc<Slot>>,
}

impl Readback {
    /// A pending readback of `len` elements of `dtype`; host waits give up after `timeout`.
    pub fn pending(dtype: DType, len: usize, timeout: Duration) -> (Readback, ReadbackFiller) {
        let slot = Arc::new(Slot { state: Mutex::new(None), ready: Condvar::new() });
        (Readback { slot: slot.clone(), dtype, len, timeout }, ReadbackFiller { slot: Some(slot) })
    }

    /// The dtype of the data.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the copy has finished (or failed). Never blocks.
    pub fn is_ready(&self) -> bool {
        self.slot.state.lock().map(|s| s.is_some()).unwrap_or(true)
    }

    /// Blocks until the copy has run and returns its bytes, or the failure of
    /// the stream, or `Timeout`.
    pub fn wait(self) -> Result<Vec<u8>, DeviceError> {
        let deadline = Instant::now() + self.timeout;
        let poisoned = || DeviceError::invalid("readback", "a thread panicked while holding the readback");
        let mut state = self.slot.state.lock().map_err(|_| poisoned())?;
        loop {
            if let Some(result) = state.take() {
                return result;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DeviceError::Timeout { what: "a device-to-host copy".into(), waited: self.timeout });
            }
            state = self.slot.ready.wait_timeout(state, deadline - now).map_err(|_| poisoned())?.0;
        }
    }

    /// Like [`Readback::wait`], typed; `T` must match the dtype.
    pub fn wait_typed<T: Element>(self) -> Result<Vec<T>, DeviceError> {
        if T::DTYPE != self.dtype {
            return Err(DeviceError::DTypeMismatch { op: "readback", expected: self.dtype, found: T::DTYPE });
        }
        let len = self.len;
        let bytes = self.wait()?;
        // The byte vector's alignment is 1, so copy rather than cast in place.
        let mut out = vec![T::zeroed(); len];
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        if dst.len() != bytes.len() {
            return Err(DeviceError::invalid("readback", "the copy returned the wrong number of bytes"));
        }
        dst.copy_from_slice(&bytes);
        Ok(out)
    }
}

impl ReadbackFiller {
    fn finish(&mut self, result: Result<Vec<u8>, DeviceError>) {
        if let Some(slot) = self.slot.take() {
            if let Ok(mut state) = slot.state.lock() {
                *state = Some(result);
            }
            slot.ready.notify_all();
        }
    }
    /// Completes the readback with its data.
    pub fn fill(mut self, bytes: Vec<u8>) {
        self.finish(Ok(bytes));
    }
    /// Fails the readback.
    pub fn fail(mut self, error: DeviceError) {
        self.finish(Err(error));
    }
}

impl Drop for ReadbackFiller {
    fn drop(&mut self) {
        self.finish(Err(DeviceError::invalid("readback", "the copy was dropped before it ran")));
    }
}
