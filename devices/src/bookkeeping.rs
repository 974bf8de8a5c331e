//! The host-side bookkeeping every device keeps, written once: the streams
//! still alive (what a device synchronize waits for) and the errors that
//! drops parked for the next synchronize. Neither holds a driver handle, so
//! host functions may use both.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use crate::{DeviceError, Result};

/// A device's streams, held weakly: a dropped stream leaves the list.
pub(crate) struct StreamList<S>(Mutex<Vec<Weak<S>>>);

impl<S> Default for StreamList<S> {
    fn default() -> Self {
        StreamList(Mutex::new(Vec::new()))
    }
}

impl<S> fmt::Debug for StreamList<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamList({})", self.live().len())
    }
}

impl<S> StreamList<S> {
    /// Adds a new stream, forgetting those dropped since.
    pub(crate) fn add(&self, stream: &Arc<S>) {
        if let Ok(mut list) = self.0.lock() {
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(stream));
        }
    }

    /// The streams still alive, oldest first.
    pub(crate) fn live(&self) -> Vec<Arc<S>> {
        match self.0.lock() {
            Ok(list) => list.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// Errors that arose where no caller could take them (a `Drop`, a host
/// function), oldest first, until a synchronize reports them.
#[derive(Debug, Default)]
pub(crate) struct Parked(Mutex<Vec<DeviceError>>);

impl Parked {
    /// Keeps `e` for the next synchronize.
    pub(crate) fn park(&self, e: DeviceError) {
        if let Ok(mut p) = self.0.lock() {
            p.push(e);
        }
    }

    /// Every parked error, oldest first, leaving none.
    pub(crate) fn take_all(&self) -> Vec<DeviceError> {
        self.0.lock().map(|mut p| std::mem::take(&mut *p)).unwrap_or_default()
    }

    /// The oldest parked error, leaving the others.
    #[cfg(feature = "rocm")]
    pub(crate) fn take_oldest(&self) -> Option<DeviceError> {
        let mut p = self.0.lock().ok()?;
        (!p.is_empty()).then(|| p.remove(0))
    }
}

/// The first error among `results`, every one of them evaluated (each is a
/// wait that must happen even after one has failed).
pub(crate) fn first_error(results: impl IntoIterator<Item = Result<()>>) -> Result<()> {
    let mut first = Ok(());
    for r in results {
        if first.is_ok() {
            first = r;
        }
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_streams_leave_the_list() {
        let list = StreamList::default();
        let (a, b) = (Arc::new(1), Arc::new(2));
        list.add(&a);
        list.add(&b);
        drop(a);
        assert_eq!(list.live().iter().map(|s| **s).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn the_first_error_wins_and_every_result_is_evaluated() {
        let mut seen = 0;
        let results = (0..3).map(|i| {
            seen += 1;
            if i == 0 {
                Ok(())
            } else {
                Err(DeviceError::invalid("test", format!("wait {i}")))
            }
        });
        let first = first_error(results);
        assert_eq!(seen, 3);
        assert!(first.unwrap_err().to_string().contains("wait 1"));
    }
}
