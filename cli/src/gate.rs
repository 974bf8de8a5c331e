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
