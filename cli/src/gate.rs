//! A start gate for rank threads whose start-up waits for every rank with
//! no deadline (a vendor library's communicator initialisation): all are
//! started before any begins, and when one cannot be started the others
//! are told to stop instead of waiting for it forever.

use std::sync::{Condvar, Mutex};

/// Holds threads until it is opened: to go on, or to stop.
#[derive(Default)]
pub struct StartGate {
    state: Mutex<Option<bool>>,
    opened: Condvar,
}

impl StartGate {
    /// Lets every waiting thread through, going on where `go`.
    pub fn open(&self, go: bool) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(go);
        self.opened.notify_all();
    }

    /// Waits until the gate is opened; whether to go on. The thread that
    /// starts the waiters opens it once the last has started, or at once
    /// when one cannot start, so no deadline is needed.
    pub fn wait(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(go) = *state {
                return go;
            }
            state = self.opened.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Runs `rank(r)` for every `r` in `0..n` on a thread of its own, every
/// thread started before any calls `rank` (behind a [`StartGate`]); a thread
/// that cannot be started stops the ones already started, and is the error.
/// Returns each rank's result in rank order (a panic as an error).
pub fn run_gated<T: Send>(
    n: usize,
    rank: impl Fn(usize) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<anyhow::Result<T>>> {
    let gate = StartGate::default();
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(n);
        for r in 0..n {
            let (gate, rank) = (&gate, &rank);
            let spawned = std::thread::Builder::new().name(format!("rank{r}")).spawn_scoped(s, move || {
                if !gate.wait() {
                    anyhow::bail!("rank {r}: not started, as another rank's thread could not start");
                }
                rank(r)
            });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    gate.open(false);
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(anyhow::anyhow!("rank {r}'s thread could not start: {e}"));
                }
            }
        }
        gate.open(true);
        Ok(handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank panicked")))).collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_go_on_or_stop_as_the_gate_is_opened() {
        for go in [true, false] {
            let gate = StartGate::default();
            let seen = std::thread::scope(|s| {
                let waiters: Vec<_> = (0..3).map(|_| s.spawn(|| gate.wait())).collect();
                gate.open(go);
                waiters.into_iter().map(|w| w.join().unwrap()).collect::<Vec<_>>()
            });
            assert_eq!(seen, vec![go; 3]);
        }
    }
}
