//! A world's ranks started on threads of their own, each making its
//! communicator (the initialisation is collective: every rank at once), with
//! a deadline: a rank that has not made its communicator by then is an error
//! naming it, instead of the harness waiting on it forever (a scoped
//! thread's join has no deadline).
//!
//! A rank's thread still running at the deadline is left behind (a thread
//! cannot be stopped from outside); the communicators made before the
//! world is given up, and any made after, are aborted, so no rank waits on
//! the ones missing.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use chorus_collectives::{CommBackend, Communicator};

use crate::Failure;

/// Ranks that had not made their communicator when the deadline passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RanksDidNotStart {
    /// The ranks, in rank order.
    pub ranks: Vec<usize>,
    /// The deadline.
    pub waited: Duration,
}

impl std::fmt::Display for RanksDidNotStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ranks {:?} did not make their communicator within {:?}; the other ranks' were aborted",
            self.ranks, self.waited
        )
    }
}

impl std::error::Error for RanksDidNotStart {}

/// How long the ranks of a world whose calls give up on a missing peer
/// after `timeout` may take to make their communicators: a few of those
/// timeouts (an initialisation waits on its peers through the store, and a
/// GPU's device is created first), and never under a minute, so that a slow
/// start on a busy machine is not taken for a hang.
pub fn start_deadline(timeout: Duration) -> Duration {
    (timeout * 3).max(Duration::from_secs(60))
}

/// Runs `start(rank)` for every rank of a world of `size` ranks, each on a
/// thread of its own (named `{name}-start{rank}`), and returns the
/// communicators in rank order.
///
/// The first rank to fail (an error, a panic, a thread that cannot be
/// started) is the error at once, with its rank; a rank that has not
/// returned within `deadline` is a [`RanksDidNotStart`] naming it. Either
/// way, every communicator made is aborted, and so is any made later by a
/// rank still starting.
pub fn start_ranks<C, F>(name: &str, size: usize, deadline: Duration, start: F) -> Result<Vec<Communicator<C>>, Failure>
where
    C: CommBackend,
    F: Fn(usize) -> Result<Communicator<C>, Failure> + Send + Sync + 'static,
{
    let began = Instant::now();
    let start = Arc::new(start);
    // Why the world was given up, once it was: a rank that makes its
    // communicator afterwards aborts it rather than sending it. Sends happen
    // under this lock, so once it is set nothing more arrives.
    let given_up: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let (tx, rx) = mpsc::channel::<(usize, Result<Communicator<C>, Failure>)>();
    let mut made: Vec<Option<Communicator<C>>> = (0..size).map(|_| None).collect();
    for rank in 0..size {
        let (start, stop, tx) = (start.clone(), given_up.clone(), tx.clone());
        let spawned = std::thread::Builder::new().name(format!("{name}-start{rank}")).spawn(move || {
            let result = catch_unwind(AssertUnwindSafe(|| start(rank)))
                .unwrap_or_else(|panic| Err(anyhow!("panicked while making its communicator: {}", message(&*panic))));
            let given_up = stop.lock().unwrap_or_else(|p| p.into_inner());
            match (&*given_up, result) {
                (Some(reason), Ok(comm)) => comm.abort(reason),
                (Some(_), Err(_)) => {}
                // The receiver outlives every send made before the world is given up.
                (None, result) => drop(tx.send((rank, result))),
            }
        });
        if let Err(e) = spawned {
            let e = anyhow!("rank {rank}'s thread could not be started: {e}");
            give_up(&given_up, &rx, made, &format!("{e}"));
            return Err(e);
        }
    }
    drop(tx);
    let mut left = size;
    while left > 0 {
        match rx.recv_timeout(deadline.saturating_sub(began.elapsed())) {
            Ok((rank, Ok(comm))) => {
                if let Some(slot) = made.get_mut(rank) {
                    *slot = Some(comm);
                    left -= 1;
                }
            }
            Ok((rank, Err(e))) => {
                give_up(&given_up, &rx, made, &format!("rank {rank} could not make its communicator: {e:#}"));
                return Err(e.context(format!("rank {rank}")));
            }
            Err(RecvTimeoutError::Timeout) => {
                let ranks: Vec<usize> = (0..size).filter(|r| made.get(*r).is_some_and(Option::is_none)).collect();
                let late = RanksDidNotStart { ranks, waited: deadline };
                give_up(&given_up, &rx, made, &late.to_string());
                return Err(late.into());
            }
            // Every thread sends before it ends unless the world was given
            // up; a thread that ended without a word is reported as late.
            Err(RecvTimeoutError::Disconnected) => {
                let ranks: Vec<usize> = (0..size).filter(|r| made.get(*r).is_some_and(Option::is_none)).collect();
                let lost = anyhow!("ranks {ranks:?} ended without making their communicator");
                give_up(&given_up, &rx, made, &format!("{lost}"));
                return Err(lost);
            }
        }
    }
    Ok(made.into_iter().flatten().collect())
}

/// Gives the world up with `reason`: no rank sends its communicator after
/// this, and every one made (received or still in the channel) is aborted.
fn give_up<C: CommBackend>(
    given_up: &Mutex<Option<String>>,
    rx: &mpsc::Receiver<(usize, Result<Communicator<C>, Failure>)>,
    made: Vec<Option<Communicator<C>>>,
    reason: &str,
) {
    let reason = format!("the world was given up while its ranks started: {reason}");
    given_up.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| reason.clone());
    let arrived = rx.try_iter().filter_map(|(_, r)| r.ok());
    for comm in made.into_iter().flatten().chain(arrived) {
        comm.abort(&reason);
    }
}

/// A panic's message, where it is text.
fn message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
