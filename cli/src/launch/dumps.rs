//! Gathering the ranks' flight-recorder dumps of every node after a failed
//! job, so `chorus trace DIR` on any one host reads the whole job.
//!
//! Each launcher publishes the dumps of its own ranks through the job's
//! store (a file per key, then the list of names: the list marks the
//! node's publication complete), then fetches the other nodes' into its own
//! dump directory. A node publishes only once its ranks have ended, which
//! takes up to the launch's grace period when a rank ignores SIGTERM (a
//! stopped or stuck one), so a node still heard from is waited for that
//! long plus [`WAIT`]. A node that is dead or cut off publishes nothing; it
//! is found silent within the node timeout and then no longer waited for,
//! so a lost node delays the launcher's exit by at most the smaller of the
//! two. Nodes that share a file system
//! already see each other's files, which are kept as they are.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::Store;
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
const MAX_DUMP: u64 = 4 * 1024 * 1024;

/// What one launcher's gathering did.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Gathered {
    /// Dumps of this node's ranks published.
    pub published: usize,
    /// Dumps fetched from other nodes and written here.
    pub fetched: usize,
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
    let own = own_dumps(dir, here.ranks);
    for (name, bytes) in &own {
        store.set(&key(&format!("{node}/{name}")), bytes)?;
    }
    done.published = own.len();
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
                if path.exists() {
                    continue;
                }
                let bytes = store.get(&key(&format!("{other}/{name}")), FETCH)?;
                if write_new(&path, &bytes).is_ok() {
                    done.fetched += 1;
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

/// The dumps in `dir` of the ranks in `ranks`, with their bytes.
fn own_dumps(dir: &Path, ranks: &HashSet<usize>) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut own: Vec<(String, Vec<u8>)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rank: usize = name.strip_prefix("rank")?.split('-').next()?.parse().ok()?;
            let small = e.metadata().ok().is_some_and(|m| m.is_file() && m.len() <= MAX_DUMP);
            (is_dump_name(&name) && ranks.contains(&rank) && small).then_some(name)
        })
        .filter_map(|name| Some((name.clone(), std::fs::read(dir.join(&name)).ok()?)))
        .collect();
    own.sort();
    own
}

/// Writes `bytes` to `path` whole or not at all, never over a file that is
/// already there.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("dump");
    let tmp = path.with_file_name(format!(".{name}.{}.part", std::process::id()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&tmp, bytes)?;
    // A hard link fails if the name exists: no dump is ever replaced.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_collectives::bootstrap::MemStore;

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
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
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
        std::fs::write(a.path().join("rank00000-ha.json"), b"{\"r\":0}").unwrap();
        std::fs::write(a.path().join("rank00001-ha.json"), b"{\"r\":1}").unwrap();
        // Another node's file in a shared directory is not published as this node's.
        std::fs::write(a.path().join("rank00002-hb.json"), b"{\"old\":2}").unwrap();
        std::fs::write(b.path().join("rank00002-hb.json"), b"{\"r\":2}").unwrap();
        let ranks_a: HashSet<usize> = [0, 1].into();
        let ranks_b: HashSet<usize> = [2, 3].into();
        let got_b =
            exchange(&store, key, &Node { index: 1, count: 3, ranks: &ranks_b, dir: b.path() }, WAIT, || Ok(vec![2]))
                .unwrap();
        assert_eq!(got_b, Gathered { published: 1, fetched: 0, missing: vec![0, 2] });
        let got_a =
            exchange(&store, key, &Node { index: 0, count: 3, ranks: &ranks_a, dir: a.path() }, WAIT, || Ok(vec![2]))
                .unwrap();
        assert_eq!(got_a.published, 2);
        assert_eq!(got_a.fetched, 0, "a file already there is kept");
        assert_eq!(got_a.missing, vec![2]);
        assert_eq!(std::fs::read(a.path().join("rank00002-hb.json")).unwrap(), b"{\"old\":2}");
        // Node 1 again, once node 0 has published: it fetches both of node 0's dumps.
        let got_b =
            exchange(
                &store,
                key,
                &Node { index: 1, count: 2, ranks: &ranks_b, dir: b.path() },
                WAIT,
                || Ok(Vec::new()),
            )
            .unwrap();
        assert_eq!(got_b.fetched, 2);
        assert_eq!(std::fs::read(b.path().join("rank00001-ha.json")).unwrap(), b"{\"r\":1}");
        let left: Vec<_> = std::fs::read_dir(b.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 3, "no temporary file is left: {left:?}");
    }

    #[test]
    fn a_node_still_stopping_its_ranks_is_waited_for_until_the_wait_ends() {
        let store = MemStore::new();
        let key = |k: &str| format!("t/dumps/{k}");
        let (a, b) = (Scratch::new("late-a"), Scratch::new("late-b"));
        std::fs::write(b.path().join("rank00002-hb.json"), b"{\"r\":2}").unwrap();
        let ranks_a: HashSet<usize> = [0, 1].into();
        let ranks_b: HashSet<usize> = [2, 3].into();
        // Node 1 publishes 400 ms late (its stopped rank took the grace period).
        let (got_a, got_b) = std::thread::scope(|s| {
            let late = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(400));
                exchange(
                    &store,
                    key,
                    &Node { index: 1, count: 2, ranks: &ranks_b, dir: b.path() },
                    Duration::ZERO,
                    || Ok(Vec::new()),
                )
                .unwrap()
            });
            let got_a = exchange(
                &store,
                key,
                &Node { index: 0, count: 2, ranks: &ranks_a, dir: a.path() },
                Duration::from_secs(10),
                || Ok(Vec::new()),
            )
            .unwrap();
            (got_a, late.join().unwrap())
        });
        assert_eq!(got_b.published, 1);
        assert_eq!(got_a, Gathered { published: 0, fetched: 1, missing: vec![] });
        assert_eq!(std::fs::read(a.path().join("rank00002-hb.json")).unwrap(), b"{\"r\":2}");
        // A wait shorter than the delay gives up on it, naming the node.
        let c = Scratch::new("late-c");
        let started = Instant::now();
        let got_c = exchange(
            &MemStore::new(),
            key,
            &Node { index: 0, count: 2, ranks: &ranks_a, dir: c.path() },
            Duration::from_millis(100),
            || Ok(Vec::new()),
        )
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
        let here = Node { index: 0, count: 2, ranks: &ranks, dir: a.path() };
        let got = exchange(
            &store,
            |k: &str| format!("t/{k}"),
            &here,
            Duration::from_secs(10),
            || Err(CommError::Aborted { reason: "the store went away".into() }),
        );
        assert!(got.is_err(), "{got:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }
}
