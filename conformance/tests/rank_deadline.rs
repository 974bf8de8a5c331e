//! The harnesses start a world's ranks on threads with a deadline
//! ([`start_ranks`]): a rank that hangs while making its communicator is an
//! error naming it, and the other ranks' communicators are aborted. With the
//! scoped threads the harnesses used before, the scope's join waited for the
//! hung rank forever; each test here bounds its own wait, so that would fail
//! it rather than hang it.

use std::sync::mpsc;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::bail;
use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::{CommError, Communicator};
use chorus_conformance::rank_threads::{start_ranks, RanksDidNotStart};
use chorus_conformance::Failure;
use chorus_devices::cpu::CpuConfig;

/// How long a test waits for [`start_ranks`] to return: far past the
/// deadlines given to it, so only a hang reaches it.
const HANG: Duration = Duration::from_secs(30);

fn world(size: usize) -> SimWorld {
    let config = SimConfig { timeout: Duration::from_secs(10), device: CpuConfig::default() };
    SimWorld::new(size, config).unwrap()
}

/// Runs `start_ranks` on a thread of the test's and waits at most [`HANG`]
/// for it: the result and how long it took.
fn bounded<F>(size: usize, deadline: Duration, start: F) -> (Result<Vec<Communicator<SimComm>>, Failure>, Duration)
where
    F: Fn(usize) -> Result<Communicator<SimComm>, Failure> + Send + Sync + 'static,
{
    let began = Instant::now();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || tx.send(start_ranks("test", size, deadline, start)));
    match rx.recv_timeout(HANG) {
        Ok(result) => (result, began.elapsed()),
        Err(_) => panic!("start_ranks did not return within {HANG:?}: it waits for the hung rank"),
    }
}

/// Waits (at most 10 s) until `comm`'s world reports an abort, and returns why.
fn abort_reason(comm: &Communicator<SimComm>) -> String {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match comm.async_error() {
            Some(CommError::Aborted { reason }) => return reason,
            Some(other) => panic!("expected Aborted, got {other}"),
            None if Instant::now() < until => thread::sleep(Duration::from_millis(10)),
            None => panic!("never aborted"),
        }
    }
}

/// Rank 1 hangs while making its communicator (until the test releases it,
/// and then makes it): the error names rank 1 at the deadline, rank 0's
/// communicator is aborted, and so is rank 1's once it is made after all.
#[test]
fn a_rank_that_hangs_while_starting_is_an_error_naming_it_at_the_deadline() {
    // Each rank's communicator is rank 0 of a world of its own; the test
    // watches rank 1 of each, which an abort of the world reaches.
    let (worlds, watchers): (Vec<SimWorld>, Vec<Communicator<SimComm>>) = (0..2)
        .map(|_| {
            let w = world(2);
            let watcher = w.communicator(1).unwrap();
            (w, watcher)
        })
        .unzip();
    let (release, released) = mpsc::channel::<()>();
    let released = Mutex::new(released);
    let deadline = Duration::from_millis(500);
    let (result, took) = bounded(2, deadline, move |rank| {
        if rank == 1 {
            // Stands for an initialisation that never returns.
            let _ = released.lock().unwrap().recv();
        }
        Ok(worlds[rank].communicator(0)?)
    });
    let Err(err) = result else { panic!("a hung rank is an error") };
    let late = err.downcast_ref::<RanksDidNotStart>().unwrap_or_else(|| panic!("not a RanksDidNotStart: {err:#}"));
    assert_eq!(late, &RanksDidNotStart { ranks: vec![1], waited: deadline });
    assert!(err.to_string().contains("ranks [1]"), "{err}");
    assert!(took >= deadline && took < deadline + Duration::from_secs(10), "returned after {took:?}");
    assert!(abort_reason(&watchers[0]).contains("ranks [1] did not make their communicator"));
    drop(release);
    assert!(abort_reason(&watchers[1]).contains("given up"), "the late communicator is aborted once made");
}

/// A rank that fails while another hangs is the error at once, with its
/// rank and its own message, not the deadline's.
#[test]
fn a_rank_that_fails_is_the_error_at_once_while_another_hangs() {
    let (release, released) = mpsc::channel::<()>();
    let released = Mutex::new(released);
    let (result, took) = bounded(2, Duration::from_secs(20), move |rank| -> Result<Communicator<SimComm>, Failure> {
        if rank == 1 {
            let _ = released.lock().unwrap().recv();
        }
        bail!("no device for rank {rank}")
    });
    let Err(err) = result else { panic!("a failing rank is an error") };
    assert!(err.downcast_ref::<RanksDidNotStart>().is_none(), "{err:#}");
    assert_eq!(format!("{err:#}"), "rank 0: no device for rank 0");
    assert!(took < Duration::from_secs(10), "returned after {took:?}");
    drop(release);
}

/// A panicking rank is an error naming it, too.
#[test]
fn a_rank_that_panics_is_an_error_naming_it() {
    let w = world(2);
    let (result, _) = bounded(2, Duration::from_secs(20), move |rank| {
        if rank == 1 {
            panic!("rank 1's device is gone");
        }
        Ok(w.communicator(rank)?)
    });
    let Err(err) = result else { panic!("a panicking rank is an error") };
    assert!(format!("{err:#}").starts_with("rank 1: panicked while making its communicator: rank 1's device is gone"));
}

/// Every rank started: the communicators in rank order.
#[test]
fn the_communicators_come_in_rank_order() {
    let w = world(3);
    let (result, _) = bounded(3, Duration::from_secs(20), move |rank| Ok(w.communicator(rank)?));
    let comms = result.unwrap();
    assert_eq!(comms.iter().map(|c| c.rank()).collect::<Vec<_>>(), [0, 1, 2]);
}
