//! Gathering the ranks' flight-recorder dumps of every node after a failed
//! job, so `chorus trace DIR` on any one host reads the whole job.
//!
//! Each launcher publishes the dumps of its own ranks of this run (the
//! run's start is in every dump: a file an earlier run left in the
//! directory is not this run's) through the job's store (a file per key,
//! then the list of names: the list marks the node's publication complete),
//! then fetches the other nodes' into its own dump directory. A node
//! publishes only once its ranks have ended, which takes up to the launch's
//! grace period when a rank ignores SIGTERM (a stopped or stuck one), so a
//! node still heard from is waited for that long plus [`WAIT`]. A node that
//! is dead or cut off publishes nothing; it is found silent within the node
//! timeout and then no longer waited for, so a lost node delays the
//! launcher's exit by at most the smaller of the two.
//!
//! The store holds the dumps of every node at once, so they are bounded:
//! a dump over [`MAX_DUMP`] is not published, nor one past the node's share
//! ([`node_share`]) of a quarter of the store's memory budget; each is named, by the node that kept
//! it and by the nodes that then lack it, and stays on its host. Node 0
//! deletes the keys once every node has finished ([`clean`]).
//!
//! Nodes that share a file system already see each other's files: a dump of
//! this run already there is kept; one of an earlier run under the same
//! name is replaced by this run's.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::{ServerOptions, Store};
use chorus_collectives::CommError;

/// How long a launcher waits for the other nodes' dumps beyond the grace
/// period their ranks may take to stop.
pub(super) const WAIT: Duration = Duration::from_secs(2);
/// How often it looks for them meanwhile.
const POLL: Duration = Duration::from_millis(50);
/// The bound of one fetch of a key known to exist.
const FETCH: Duration = Duration::from_secs(2);

/// Largest dump published (the store's value limit is 8 MiB; a ring of
/// 1024 calls takes a few hundred KiB).
pub(super) const MAX_DUMP: u64 = 4 * 1024 * 1024;

/// One node's share of what every node's dumps together may hold of node
/// 0's store: a quarter of its memory budget, so the job's other keys
/// always fit beside them.
pub(super) fn node_share(nnodes: usize) -> u64 {
    (ServerOptions::default().max_memory_bytes as u64 / 4) / nnodes.max(1) as u64
}

/// A dump not shared through the store, and why.
#[derive(Debug, PartialEq)]
pub(super) struct Withheld {
    /// The dump's file name.
    pub name: String,
    /// Its size.
    pub bytes: u64,
}

/// What one launcher's gathering did.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Gathered {
    /// Dumps of this node's ranks published.
    pub published: usize,
    /// Dumps of this node's ranks too large to publish (over [`MAX_DUMP`] or
    /// past the node's share of the store).
    pub withheld: Vec<Withheld>,
    /// Dumps fetched from other nodes and written here.
    pub fetched: usize,
    /// Dumps other nodes did not publish (too large), by node.
    pub not_shared: Vec<(usize, Withheld)>,
    /// Nodes whose dumps did not arrive in time.
    pub missing: Vec<usize>,
}

/// One node of the job as the exchange sees it.
pub(super) struct Node<'a> {
    /// This node's index.
    pub index: usize,
    /// Nodes in the job.
    pub count: usize,
    /// The global ranks this node ran.
    pub ranks: &'a HashSet<usize>,
    /// Its dump directory.
    pub dir: &'a Path,
    /// The run's start, as every dump of this run carries it.
    pub run: u64,
}

/// Publishes this node's dumps under `key(node)`, then fetches the other
/// nodes' into its directory, polling for at most `wait`. `gone()` is asked in
/// every round which nodes are known to be gone (found silent): they are
/// not waited for. A store error (here or in `gone()`) ends the exchange
/// with that error (the store is lost; the caller stops using it).
pub(super) fn exchange(
    store: &dyn Store,
    key: impl Fn(&str) -> String,
    here: &Node,
    wait: Duration,
    mut gone: impl FnMut() -> Result<Vec<usize>, CommError>,
) -> Result<Gathered, CommError> {
    let (dir, node, nnodes) = (here.dir, here.index, here.count);
    let mut done = Gathered::default();
    let (own, withheld) = own_dumps(dir, here.ranks, here.run, node_share(nnodes));
    for (name, bytes) in &own {
        store.set(&key(&format!("{node}/{name}")), bytes)?;
    }
    done.published = own.len();
    let kept: Vec<String> = withheld.iter().map(|w| format!("{} {}", w.name, w.bytes)).collect();
    store.set(&key(&format!("withheld/{node}")), kept.join("\n").as_bytes())?;
    done.withheld = withheld;
    let names: Vec<&str> = own.iter().map(|(n, _)| n.as_str()).collect();
    store.set(&key(&node.to_string()), names.join("\n").as_bytes())?;
    let deadline = Instant::now() + wait;
    let mut pending: Vec<usize> = (0..nnodes).filter(|n| *n != node).collect();
    let mut lost = Vec::new();
    loop {
        let now_gone = gone()?;
        lost.extend(pending.iter().copied().filter(|n| now_gone.contains(n)));
        pending.retain(|n| !now_gone.contains(n));
        for other in pending.clone() {
            let list_key = key(&other.to_string());
            if !store.check(&[&list_key])? {
                continue;
            }
            pending.retain(|n| *n != other);
            let list = store.get(&list_key, FETCH)?;
            for name in String::from_utf8_lossy(&list).lines().filter(|n| is_dump_name(n)) {
                let path = dir.join(name);
                if std::fs::symlink_metadata(&path).is_ok() {
                    match dump_run(&path) {
                        // This run's, already here (a shared file system).
                        Some(Some(run)) if run == here.run => continue,
                        // An earlier run's, under the same name: replaced below.
                        Some(_) => {}
                        // Not a dump: not the launcher's to replace.
                        None => continue,
                    }
                }
                let bytes = store.get(&key(&format!("{other}/{name}")), FETCH)?;
                if write_replacing(&path, &bytes).is_ok() {
                    done.fetched += 1;
                }
            }
            let withheld = store.get(&key(&format!("withheld/{other}")), FETCH)?;
            for line in String::from_utf8_lossy(&withheld).lines() {
                let (name, bytes) = line.split_once(' ').unwrap_or((line, "0"));
                if is_dump_name(name) {
                    done.not_shared
                        .push((other, Withheld { name: name.to_string(), bytes: bytes.parse().unwrap_or(0) }));
                }
            }
        }
        if pending.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL);
    }
    done.missing = lost;
    done.missing.extend(pending);
    done.missing.sort_unstable();
    Ok(done)
}

/// Deletes every key the exchange of `nnodes` nodes set (node 0, once every
/// node has finished); keys of a node that never published are not there.
pub(super) fn clean(store: &dyn Store, key: impl Fn(&str) -> String, nnodes: usize) -> Result<(), CommError> {
    for node in 0..nnodes {
        let list_key = key(&node.to_string());
        if store.check(&[&list_key])? {
            let list = store.get(&list_key, FETCH)?;
            for name in String::from_utf8_lossy(&list).lines() {
                store.delete(&key(&format!("{node}/{name}")))?;
            }
        }
        store.delete(&list_key)?;
        store.delete(&key(&format!("withheld/{node}")))?;
    }
    Ok(())
}

/// The recorder's name of a rank's dump, `rank<digits>-<host>.json`, with
/// nothing that could leave the directory (names come over the network).
pub(super) fn is_dump_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("rank").and_then(|r| r.strip_suffix(".json")) else {
        return false;
    };
    let Some((digits, host)) = rest.split_once('-') else {
        return false;
    };
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !host.is_empty()
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
        && !name.contains("..")
}

/// The run start a dump file carries: `None` when it is not a dump (not a
/// regular file, not the recorder's JSON), `Some(None)` for a dump without
/// a start (a process not started by `chorus launch`, or an older chorus).
/// Read as a stream: a large dump costs time, not memory.
pub(super) fn dump_run(path: &Path) -> Option<Option<u64>> {
    #[derive(serde::Deserialize)]
    struct Run {
        #[allow(dead_code)]
        version: u32,
        run_started_us: Option<u64>,
    }
    if !std::fs::symlink_metadata(path).ok()?.is_file() {
        return None;
    }
    let file = std::io::BufReader::new(std::fs::File::open(path).ok()?);
    serde_json::from_reader::<_, Run>(file).ok().map(|r| r.run_started_us)
}

/// How many dumps of the run that started at `run` are in `dir`.
pub(super) fn of_run(dir: &Path, run: u64) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(is_dump_name) && dump_run(&e.path()) == Some(Some(run)))
        .count()
}

/// The dumps in `dir` of this run's ranks in `ranks`: those to publish with
/// their bytes (in rank order, while they fit in `share`), and those kept
/// back for their size.
fn own_dumps(dir: &Path, ranks: &HashSet<usize>, run: u64, share: u64) -> (Vec<(String, Vec<u8>)>, Vec<Withheld>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (Vec::new(), Vec::new());
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rank: usize = name.strip_prefix("rank")?.split('-').next()?.parse().ok()?;
            (is_dump_name(&name) && ranks.contains(&rank)).then_some(name)
        })
        .collect();
    names.sort();
    let (mut own, mut withheld, mut used) = (Vec::new(), Vec::new(), 0u64);
    for name in names {
        let path = dir.join(&name);
        // An earlier run's file in the directory is not this run's dump.
        if dump_run(&path) != Some(Some(run)) {
            continue;
        }
        let Ok(bytes) = path.metadata().map(|m| m.len()) else { continue };
        if bytes > MAX_DUMP || used.saturating_add(bytes) > share {
            withheld.push(Withheld { name, bytes });
            continue;
        }
        let Ok(content) = std::fs::read(&path) else { continue };
        let len = content.len() as u64;
        if len > MAX_DUMP || used.saturating_add(len) > share {
            withheld.push(Withheld { name, bytes: len });
            continue;
        }
        used += len;
        own.push((name, content));
    }
    (own, withheld)
}

/// Writes `bytes` to `path` whole or not at all (aside, then renamed over
/// what is there: the caller replaces only an earlier run's dump).
fn write_replacing(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("dump");
    let tmp = path.with_file_name(format!(".{name}.{}.part", std::process::id()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_collectives::bootstrap::MemStore;

    /// The run of these tests' dumps.
    const RUN: u64 = 7;

    /// A fresh directory of this test, removed on drop.
    struct Scratch(std::path::PathBuf);
    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("chorus-dumps-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
        fn path(&self) -> &Path {
            &self.0
        }
        /// Writes a dump of `run` tagged `tag` (what the tests compare) as `name`.
        fn dump(&self, name: &str, run: u64, tag: &str) {
            std::fs::write(self.0.join(name), dump(run, tag)).unwrap();
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The part of a dump the exchange reads, with a tag.
    fn dump(run: u64, tag: &str) -> Vec<u8> {
        format!("{{\"version\":1,\"run_started_us\":{run},\"tag\":\"{tag}\"}}").into_bytes()
    }

    fn node<'a>(index: usize, count: usize, ranks: &'a HashSet<usize>, dir: &'a Path) -> Node<'a> {
        Node { index, count, ranks, dir, run: RUN }
    }

    #[test]
    fn only_the_recorders_names_are_accepted() {
        assert!(is_dump_name("rank00003-node-1.example.json"));
        assert!(is_dump_name("rank12-a_b_c.json"));
        for bad in
            ["rank-x.json", "rankx-h.json", "rank1-.json", "rank1-../x.json", "rank1-a/b.json", "x.json", "rank1-h"]
        {
            assert!(!is_dump_name(bad), "{bad}");
        }
    }

    #[test]
    fn two_nodes_end_with_every_dump_and_a_silent_one_is_named() {
        let store = MemStore::new();
        let key = |k: &str| format!("t/dumps/{k}");
        let (a, b) = (Scratch::new("a"), Scratch::new("b"));
        a.dump("rank00000-ha.json", RUN, "r0");
        a.dump("rank00001-ha.json", RUN, "r1");
        // Another node's file in a shared directory is not published as this node's.
        a.dump("rank00002-hb.json", RUN, "shared2");
        b.dump("rank00002-hb.json", RUN, "r2");
        let ranks_a: HashSet<usize> = [0, 1].into();
        let ranks_b: HashSet<usize> = [2, 3].into();
        let got_b = exchange(&store, key, &node(1, 3, &ranks_b, b.path()), WAIT, || Ok(vec![2])).unwrap();
        assert_eq!(got_b, Gathered { published: 1, missing: vec![0, 2], ..Gathered::default() });
        let got_a = exchange(&store, key, &node(0, 3, &ranks_a, a.path()), WAIT, || Ok(vec![2])).unwrap();
        assert_eq!(got_a.published, 2);
        assert_eq!(got_a.fetched, 0, "a dump of this run already there is kept");
        assert_eq!(got_a.missing, vec![2]);
        assert_eq!(std::fs::read(a.path().join("rank00002-hb.json")).unwrap(), dump(RUN, "shared2"));
        // Node 1 again, once node 0 has published: it fetches both of node 0's dumps.
        let got_b = exchange(&store, key, &node(1, 2, &ranks_b, b.path()), WAIT, || Ok(Vec::new())).unwrap();
        assert_eq!(got_b.fetched, 2);
        assert_eq!(std::fs::read(b.path().join("rank00001-ha.json")).unwrap(), dump(RUN, "r1"));
        let left: Vec<_> = std::fs::read_dir(b.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 3, "no temporary file is left: {left:?}");
        // Node 0 cleans up once every node has finished: no key is left.
        clean(&store, key, 3).unwrap();
        assert_eq!(store.num_keys().unwrap(), 0);
    }

    #[test]
    fn an_earlier_runs_dumps_are_neither_published_nor_kept_over_this_runs() {
        let store = MemStore::new();
        let key = |k: &str| format!("t/dumps/{k}");
        let (a, b) = (Scratch::new("runs-a"), Scratch::new("runs-b"));
        // Node 0's directory, used by an earlier run under the same run id.
        a.dump("rank00000-ha.json", RUN, "r0");
        a.dump("rank00001-ha.json", RUN - 1, "old1");
        a.dump("rank00002-hb.json", RUN - 1, "old2");
        std::fs::write(a.path().join("rank00003-hb.json"), b"the user's notes").unwrap();
        b.dump("rank00002-hb.json", RUN, "r2");
        b.dump("rank00003-hb.json", RUN, "r3");
        let ranks_a: HashSet<usize> = [0, 1].into();
        let ranks_b: HashSet<usize> = [2, 3].into();
        let got_b = exchange(&store, key, &node(1, 2, &ranks_b, b.path()), Duration::ZERO, || Ok(vec![])).unwrap();
        assert_eq!(got_b.published, 2);
        let got_a = exchange(&store, key, &node(0, 2, &ranks_a, a.path()), WAIT, || Ok(vec![])).unwrap();
        assert_eq!(got_a.published, 1, "rank 1's file is the earlier run's");
        assert!(got_a.withheld.is_empty(), "{:?}", got_a.withheld);
        assert_eq!(got_a.fetched, 1);
        assert_eq!(std::fs::read(a.path().join("rank00002-hb.json")).unwrap(), dump(RUN, "r2"), "replaced");
        assert_eq!(std::fs::read(a.path().join("rank00003-hb.json")).unwrap(), b"the user's notes", "left alone");
        let list = store.get(&key("0"), Duration::from_secs(1)).unwrap();
        assert_eq!(list, b"rank00000-ha.json");
    }

    #[test]
    fn dumps_too_large_for_the_store_are_kept_back_and_named_on_both_sides() {
        let store = MemStore::new();
        let key = |k: &str| format!("t/dumps/{k}");
        let (a, b) = (Scratch::new("big-a"), Scratch::new("big-b"));
        let padding = "x".repeat(MAX_DUMP as usize);
        b.dump("rank00002-hb.json", RUN, &padding);
        b.dump("rank00003-hb.json", RUN, "r3");
        let ranks_a: HashSet<usize> = [0, 1].into();
        let ranks_b: HashSet<usize> = [2, 3].into();
        let got_b = exchange(&store, key, &node(1, 2, &ranks_b, b.path()), Duration::ZERO, || Ok(vec![])).unwrap();
        assert_eq!(got_b.published, 1);
        assert_eq!(got_b.withheld.len(), 1);
        assert_eq!(got_b.withheld[0].name, "rank00002-hb.json");
        assert!(got_b.withheld[0].bytes > MAX_DUMP);
        let got_a = exchange(&store, key, &node(0, 2, &ranks_a, a.path()), WAIT, || Ok(vec![])).unwrap();
        assert_eq!(got_a.fetched, 1);
        assert_eq!(got_a.not_shared.len(), 1);
        assert_eq!((got_a.not_shared[0].0, got_a.not_shared[0].1.name.as_str()), (1, "rank00002-hb.json"));
        // A node's share of the store bounds what it publishes, in rank order.
        let (own, withheld) = own_dumps(b.path(), &ranks_b, RUN, 10);
        assert!(own.is_empty() && withheld.len() == 2, "{own:?} {withheld:?}");
        let small = dump(RUN, "r3").len() as u64;
        let (own, withheld) = own_dumps(b.path(), &ranks_b, RUN, small);
        assert_eq!((own.len(), withheld.len()), (1, 1));
        // Hundreds of nodes still leave the store three quarters of its budget.
        assert_eq!(node_share(1), (512 << 20) / 4);
        assert!(node_share(300) * 300 <= (512 << 20) / 4);
    }

    #[test]
    fn a_node_still_stopping_its_ranks_is_waited_for_until_the_wait_ends() {
        let store = MemStore::new();
        let key = |k: &str| format!("t/dumps/{k}");
        let (a, b) = (Scratch::new("late-a"), Scratch::new("late-b"));
        b.dump("rank00002-hb.json", RUN, "r2");
        let ranks_a: HashSet<usize> = [0, 1].into();
        let ranks_b: HashSet<usize> = [2, 3].into();
        // Node 1 publishes 400 ms late (its stopped rank took the grace period).
        let (got_a, got_b) = std::thread::scope(|s| {
            let late = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(400));
                exchange(&store, key, &node(1, 2, &ranks_b, b.path()), Duration::ZERO, || Ok(Vec::new())).unwrap()
            });
            let got_a =
                exchange(&store, key, &node(0, 2, &ranks_a, a.path()), Duration::from_secs(10), || Ok(Vec::new()))
                    .unwrap();
            (got_a, late.join().unwrap())
        });
        assert_eq!(got_b.published, 1);
        assert_eq!(got_a, Gathered { fetched: 1, ..Gathered::default() });
        assert_eq!(std::fs::read(a.path().join("rank00002-hb.json")).unwrap(), dump(RUN, "r2"));
        // A wait shorter than the delay gives up on it, naming the node.
        let c = Scratch::new("late-c");
        let started = Instant::now();
        let got_c =
            exchange(&MemStore::new(), key, &node(0, 2, &ranks_a, c.path()), Duration::from_millis(100), || {
                Ok(Vec::new())
            })
            .unwrap();
        assert_eq!(got_c.missing, vec![1]);
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }

    #[test]
    fn a_store_lost_while_watching_ends_the_exchange_at_once() {
        let store = MemStore::new();
        let a = Scratch::new("lost-a");
        let ranks: HashSet<usize> = [0].into();
        let started = Instant::now();
        let got = exchange(
            &store,
            |k: &str| format!("t/{k}"),
            &node(0, 2, &ranks, a.path()),
            Duration::from_secs(10),
            || Err(CommError::Aborted { reason: "the store went away".into() }),
        );
        assert!(got.is_err(), "{got:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }
}
