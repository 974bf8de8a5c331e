//! The store semantics every `Store` implementation passes, written once.
//!
//! Each case takes `handles`, a function that returns a new handle to one
//! fresh store (another clone, another open of the directory, another TCP
//! client of the same server), so cases can play several ranks.
//! `store_suite!(name, fresh)` instantiates every case as a `#[test]`.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::{PrefixStore, RoundBarrier, Store, StoreBarrier};
use chorus_collectives::CommError;

/// New handles to one fresh store.
pub type Handles = Arc<dyn Fn() -> Arc<dyn Store> + Send + Sync>;

const LONG: Duration = Duration::from_secs(20);
const SHORT: Duration = Duration::from_millis(60);

/// A timeout error whose op is `op` naming every key in `keys` (a prefix
/// store names them with their prefix).
fn assert_timeout<T: std::fmt::Debug>(r: Result<T, CommError>, op_name: &str, keys: &[&str]) {
    match r {
        Err(CommError::Timeout { op, .. }) => {
            assert!(op.starts_with(op_name), "timeout op {op:?} should start with {op_name:?}");
            for k in keys {
                assert!(op.contains(k), "timeout op {op:?} should name {k:?}");
            }
        }
        other => panic!("expected a timeout of {op_name}, got {other:?}"),
    }
}

pub fn set_get_overwrite_and_binary(h: &Handles) {
    let s = h();
    s.set("k", b"v1").unwrap();
    assert_eq!(s.get("k", LONG).unwrap(), b"v1");
    s.set("k", b"second").unwrap();
    assert_eq!(s.get("k", LONG).unwrap(), b"second");
    s.set("bin", &[0, 1, 0, 255]).unwrap();
    assert_eq!(s.get("bin", LONG).unwrap(), [0, 1, 0, 255]);
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty", LONG).unwrap(), b"");
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    s.set("big", &big).unwrap();
    assert_eq!(h().get("big", LONG).unwrap(), big);
}

pub fn get_times_out_on_a_missing_key(h: &Handles) {
    let s = h();
    let start = Instant::now();
    assert_timeout(s.get("absent", SHORT), "store get", &["absent"]);
    let waited = start.elapsed();
    assert!(waited >= SHORT && waited < Duration::from_secs(10), "waited {waited:?}");
    // The store is still usable after a timeout.
    s.set("after", b"x").unwrap();
    assert_eq!(s.get("after", LONG).unwrap(), b"x");
}

pub fn get_waits_for_another_rank(h: &Handles) {
    let reader = h();
    let t = thread::spawn(move || reader.get("late", LONG));
    thread::sleep(Duration::from_millis(30));
    h().set("late", b"here").unwrap();
    assert_eq!(t.join().unwrap().unwrap(), b"here");
}

/// Runs `body(rank, store)` on `ranks` threads, each with a handle of its
/// own, released together so that they race; the results in rank order.
fn race<T: Send + 'static>(
    h: &Handles,
    ranks: usize,
    body: impl Fn(usize, &dyn Store) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let start = Arc::new(Barrier::new(ranks));
    let body = Arc::new(body);
    let threads: Vec<_> = (0..ranks)
        .map(|r| {
            let (s, start, body) = (h(), start.clone(), body.clone());
            thread::spawn(move || {
                start.wait();
                body(r, &*s)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

pub fn add_counts_atomically(h: &Handles) {
    let s = h();
    assert_eq!(s.add("c", 5).unwrap(), 5);
    assert_eq!(s.add("c", -2).unwrap(), 3);
    assert_eq!(s.get("c", LONG).unwrap(), b"3");
    let (threads, per) = (4, 40);
    let results = race(h, threads, move |_, s| (0..per).map(|_| s.add("n", 1).unwrap()).collect::<Vec<_>>());
    let all: BTreeSet<i64> = results.into_iter().flatten().collect();
    assert_eq!(all, (1..=(threads * per) as i64).collect::<BTreeSet<_>>(), "every add saw a distinct count");
    s.set("text", b"not a number").unwrap();
    assert!(matches!(s.add("text", 1), Err(CommError::Store { .. })));
    // A failed add leaves the store usable (a TCP client reconnects).
    assert_eq!(s.add("c", 1).unwrap(), 4);
}

pub fn compare_set_has_pytorch_semantics(h: &Handles) {
    let s = h();
    assert_eq!(s.compare_set("cas", b"", b"first").unwrap(), b"first");
    assert_eq!(s.compare_set("cas", b"wrong", b"second").unwrap(), b"first");
    assert_eq!(s.compare_set("cas", b"first", b"second").unwrap(), b"second");
    assert_eq!(s.get("cas", LONG).unwrap(), b"second");
    assert_eq!(s.compare_set("missing", b"x", b"y").unwrap(), b"x");
    assert!(!s.check(&["missing"]).unwrap());
    // Ranks racing to claim a key: exactly one wins, all see the winner.
    let seen: BTreeSet<Vec<u8>> =
        race(h, 4, |r, s| s.compare_set("leader", b"", format!("rank {r}").as_bytes()).unwrap()).into_iter().collect();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(s.get("leader", LONG).unwrap(), *seen.iter().next().unwrap());
}

pub fn wait_and_check(h: &Handles) {
    let s = h();
    s.wait(&[], SHORT).unwrap();
    assert!(s.check(&[]).unwrap());
    s.set("a", b"1").unwrap();
    assert!(s.check(&["a"]).unwrap());
    assert!(!s.check(&["a", "b"]).unwrap());
    assert_timeout(s.wait(&["a", "b"], SHORT), "store wait", &["a", "b"]);
    let waiter = h();
    let t = thread::spawn(move || waiter.wait(&["a", "b", "c"], LONG));
    thread::sleep(Duration::from_millis(20));
    let setter = h();
    setter.set("b", b"2").unwrap();
    thread::sleep(Duration::from_millis(20));
    assert!(!t.is_finished(), "wait returned before c was set");
    setter.set("c", b"3").unwrap();
    t.join().unwrap().unwrap();
    assert!(s.check(&["a", "b", "c"]).unwrap());
}

pub fn delete_and_num_keys(h: &Handles) {
    let s = h();
    let before = s.num_keys().unwrap();
    assert!(!s.delete("nothing").unwrap());
    s.set("x", b"1").unwrap();
    s.set("y", b"2").unwrap();
    s.set("x", b"3").unwrap();
    assert_eq!(s.num_keys().unwrap(), before + 2);
    assert!(s.delete("x").unwrap());
    assert!(!s.delete("x").unwrap());
    assert!(!s.check(&["x"]).unwrap());
    assert_eq!(s.num_keys().unwrap(), before + 1);
    assert_timeout(s.get("x", SHORT), "store get", &["x"]);
}

pub fn multi_get_and_multi_set(h: &Handles) {
    let s = h();
    s.multi_set(&[("m1", b"a"), ("m2", b"bb"), ("m1", b"c")]).unwrap();
    assert_eq!(s.get("m1", LONG).unwrap(), b"c", "a later pair wins");
    assert_eq!(s.multi_get(&["m1", "m2"], LONG).unwrap(), [b"c".to_vec(), b"bb".to_vec()]);
    assert_eq!(s.multi_get(&[], LONG).unwrap(), Vec::<Vec<u8>>::new());
    assert_timeout(s.multi_get(&["m1", "m3"], SHORT), "store multi_get", &["m1", "m3"]);
    let reader = h();
    let t = thread::spawn(move || reader.multi_get(&["m2", "m3"], LONG));
    thread::sleep(Duration::from_millis(20));
    h().multi_set(&[("m3", b"late")]).unwrap();
    assert_eq!(t.join().unwrap().unwrap(), [b"bb".to_vec(), b"late".to_vec()]);
    s.multi_set(&[]).unwrap();
}

pub fn unusual_keys(h: &Handles) {
    let s = h();
    let before = s.num_keys().unwrap();
    let long = "k".repeat(1000);
    let keys = ["a/b/c", "spaces and ünïcode", "", "..", "/", long.as_str(), "x\ny"];
    for (i, k) in keys.iter().enumerate() {
        s.set(k, format!("{i}").as_bytes()).unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(h().get(k, LONG).unwrap(), format!("{i}").as_bytes(), "key {k:?}");
    }
    assert_eq!(s.num_keys().unwrap(), before + keys.len() as u64);
}

pub fn prefix_store_namespaces_keys(h: &Handles) {
    let s = h();
    let p = PrefixStore::new("job/attempt_0", h());
    p.set("k", b"v").unwrap();
    assert_eq!(s.get("job/attempt_0/k", LONG).unwrap(), b"v");
    assert!(!p.check(&["job/attempt_0/k"]).unwrap());
    assert_eq!(p.add("n", 2).unwrap(), 2);
    assert_eq!(p.compare_set("c", b"", b"x").unwrap(), b"x");
    p.multi_set(&[("m", b"1")]).unwrap();
    assert_eq!(p.multi_get(&["m", "k"], LONG).unwrap(), [b"1".to_vec(), b"v".to_vec()]);
    p.wait(&["k", "n"], LONG).unwrap();
    assert!(p.delete("k").unwrap());
    assert!(!s.check(&["job/attempt_0/k"]).unwrap());
    let nested = PrefixStore::new("outer", PrefixStore::new("inner", h()));
    nested.set("z", b"1").unwrap();
    assert!(s.check(&["inner/outer/z"]).unwrap());
    assert_eq!(p.num_keys().unwrap(), s.num_keys().unwrap());
}

pub fn barriers_release_together_time_out_and_cancel(h: &Handles) {
    // Four parties, three rounds: nobody leaves a round before the last arrives.
    let arrivals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = arrivals.clone();
    let handles = h.clone();
    let counts = race(h, 4, move |r, _| {
        let barrier = RoundBarrier::new(handles(), "rounds", 4).unwrap();
        let mut before = Vec::new();
        for round in 0..3 {
            if r == round {
                thread::sleep(Duration::from_millis(30));
            }
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            barrier.wait(LONG).unwrap();
            before.push(seen.load(std::sync::atomic::Ordering::SeqCst));
        }
        before
    });
    for (r, c) in counts.iter().enumerate() {
        for (round, n) in c.iter().enumerate() {
            assert!(*n >= 4 * (round + 1), "rank {r} left round {round} after {n} arrivals");
        }
    }
    assert_eq!(arrivals.load(std::sync::atomic::Ordering::SeqCst), 12);

    // A party that never comes: a timeout that says how many arrived.
    let lonely = StoreBarrier::new("lonely", 2).unwrap();
    let s = h();
    match lonely.arrive_and_wait(&*s, SHORT) {
        Err(CommError::Timeout { op, .. }) => assert!(op.contains("1 of 2 parties arrived"), "{op}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    // A cancel fails a waiter at once, long before its deadline.
    let waiting = h();
    let start = Instant::now();
    let t = thread::spawn(move || StoreBarrier::new("cancelled", 3).unwrap().arrive_and_wait(&*waiting, LONG));
    thread::sleep(Duration::from_millis(30));
    StoreBarrier::new("cancelled", 3).unwrap().cancel(&*h(), "rank 2 failed").unwrap();
    match t.join().unwrap() {
        Err(CommError::Aborted { reason }) => assert!(reason.contains("rank 2 failed"), "{reason}"),
        other => panic!("expected the cancel, got {other:?}"),
    }
    assert!(start.elapsed() < LONG / 2);
    // A cancel after the release changes nothing.
    let done = StoreBarrier::new("released", 1).unwrap();
    done.arrive_and_wait(&*s, LONG).unwrap();
    done.cancel(&*s, "late").unwrap();
    done.wait(&*s, LONG).unwrap();
}

/// One case of the suite.
pub type Case = fn(&Handles);

/// Every case as a `#[test]` in a module `$name`; `$fresh` is an expression
/// returning [`Handles`] to a new, empty store.
#[macro_export]
macro_rules! store_suite {
    ($name:ident, $fresh:expr) => {
        $crate::store_suite!(@each tests $name, $fresh);
    };
    // The one list of cases, handed to the rule `$rule` after its arguments,
    // so that the tests and `CASES` cannot drift apart.
    (@each $rule:ident $($arg:tt)*) => {
        $crate::store_suite!(@$rule $($arg)*;
            set_get_overwrite_and_binary,
            get_times_out_on_a_missing_key,
            get_waits_for_another_rank,
            add_counts_atomically,
            compare_set_has_pytorch_semantics,
            wait_and_check,
            delete_and_num_keys,
            multi_get_and_multi_set,
            unusual_keys,
            prefix_store_namespaces_keys,
            barriers_release_together_time_out_and_cancel
        );
    };
    (@tests $name:ident, $fresh:expr; $($case:ident),*) => {
        mod $name {
            use super::*;
            $(
                #[test]
                fn $case() {
                    common::$case(&$fresh);
                }
            )*
        }
    };
    (@table; $($case:ident),*) => {
        /// Every case, by name, for harnesses that run them in sequence.
        pub const CASES: &[(&str, Case)] = &[$((stringify!($case), $case)),*];
    };
}

store_suite!(@each table);
