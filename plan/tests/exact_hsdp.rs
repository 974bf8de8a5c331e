//! Same code, exact counts under HSDP: every communicator's collective
//! sequence — the world's and the mesh's replicate and shard communicators,
//! named as the flight recorder names them (`root/split0:color1`) — and the
//! FSDP peak equal the real run's on every rank. The real run's split
//! communicators are gone when its loop returns; the flight recorder keeps
//! their records for the dump written here (a test binary of its own: the
//! records it keeps of dropped communicators are shared by the process).

mod common;
#[path = "common/train.rs"]
mod train;

use std::path::PathBuf;

use chorus_train::decoder::TrainSpec;
use train::{check, gpt_spec, llama_spec};

/// A directory of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("chorus-plan-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn every_communicator_of_hsdp_2x2_and_2x4() {
    for (replicate, ranks) in [(2, 4), (2, 8)] {
        let dir = Scratch::new(&format!("hsdp-gpt-{ranks}"));
        let (groups, layers, spec) = gpt_spec(ranks);
        let (plans, _) = check(ranks, &groups, layers, TrainSpec { replicate: Some(replicate), ..spec }, Some(&dir.0));
        // Both of the mesh's communicators carry collectives (all-gathers and
        // reduce-scatters on the shard one, all-reduces on the replicate one).
        let ids: std::collections::BTreeSet<&str> = plans[0].collectives.iter().map(|c| c.group.as_str()).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        let dir = Scratch::new(&format!("hsdp-llama-{ranks}"));
        let (groups, layers, spec) = llama_spec(ranks, true);
        check(ranks, &groups, layers, TrainSpec { replicate: Some(replicate), ..spec }, Some(&dir.0));
    }
}
