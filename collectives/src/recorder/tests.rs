//! The ring and its states, on the sim backend (its cpu events are real
//! stream-ordered events, so every state can be held and observed).

use super::*;

#[test]
fn ring_sizes_parse_and_are_bounded() {
    assert_eq!(RecorderOptions::parse_entries("0"), Ok(0));
    assert_eq!(RecorderOptions::parse_entries(" 64 "), Ok(64));
    assert!(RecorderOptions::parse_entries("-1").unwrap_err().contains("not a count"));
    assert!(RecorderOptions::parse_entries(&(MAX_ENTRIES + 1).to_string()).unwrap_err().contains("at most"));
}

#[test]
fn dump_files_name_rank_and_host() {
    assert_eq!(RankDump::file_name(3, "node-1.example"), "rank00003-node-1.example.json");
    assert_eq!(RankDump::file_name(12, "a/b c"), "rank00012-a_b_c.json");
}

#[cfg(feature = "sim")]
mod sim {
    use std::path::Path;
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use chorus_devices::{Buffer, DType, Device, Priority, Stream};

    use super::super::*;
    use crate::sim::{SimComm, SimConfig, SimWorld};
    use crate::{Communicator, ReduceOp};

    fn world(n: usize, entries: usize, dir: Option<PathBuf>) -> Vec<Communicator<SimComm>> {
        let config = SimConfig { timeout: Duration::from_secs(2), ..SimConfig::default() };
        let world = SimWorld::new(n, config).unwrap();
        let options = RecorderOptions { entries, dump_dir: dir, track_starts: true };
        (0..n).map(|r| Communicator::with_recorder(world.communicator(r).unwrap().into_backend(), &options)).collect()
    }

    /// Runs `rank` on every communicator, each on a thread of its own (the
    /// ranks of a collective must run at once); the results in rank order.
    fn on_every_rank<T: Send + 'static>(
        comms: Vec<Communicator<SimComm>>,
        rank: fn(Communicator<SimComm>) -> T,
    ) -> Vec<T> {
        let handles: Vec<_> = comms.into_iter().map(|c| std::thread::spawn(move || rank(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Polls `comm`'s last entry until `done` holds (at most 10 s).
    fn wait_for(comm: &Communicator<SimComm>, done: impl Fn(&EntryRecord) -> bool) -> EntryRecord {
        let start = Instant::now();
        loop {
            let record = comm.flight_record().unwrap();
            let last = record.entries.last().cloned().unwrap();
            if done(&last) {
                return last;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "still {last:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for rank 0's dump in `dir` (at most 10 s) and reads it.
    fn wait_for_dump(dir: &Path) -> RankDump {
        let path = dir.join(RankDump::file_name(0, &monitor::host_name()));
        let start = Instant::now();
        while !path.exists() {
            assert!(start.elapsed() < Duration::from_secs(10), "no dump in {}", dir.display());
            std::thread::sleep(Duration::from_millis(10));
        }
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
    }

    #[test]
    fn the_ring_keeps_the_last_n_launches_with_their_sizes() {
        let comms = world(1, 3, None);
        let c = &comms[0];
        let s = c.device().create_stream(Priority::Normal).unwrap();
        let buf = c.device().alloc(DType::F64, 64).unwrap();
        for n in 1..=5usize {
            c.all_reduce_in_place(buf.slice(0, n * 10).unwrap(), ReduceOp::Max, &s).unwrap();
        }
        s.synchronize().unwrap();
        let record = c.flight_record().unwrap();
        assert_eq!((record.id.as_str(), record.rank, record.size, record.capacity), ("root", 0, 1, 3));
        assert_eq!(record.launches, 5);
        let ids: Vec<u64> = record.entries.iter().map(|e| e.id).collect();
        assert_eq!(ids, [2, 3, 4]);
        for (e, n) in record.entries.iter().zip(3u64..) {
            let call = &e.calls[0];
            assert_eq!((call.op.as_str(), call.seq, call.dtype.as_str()), ("all_reduce", Some(n - 1), "f64"));
            assert_eq!((call.count, call.bytes, call.reduce.as_deref()), (n * 10, n * 80, Some("max")));
            assert_eq!(e.state, CallState::Completed, "{e:?}");
            let (started, finished) = (e.started_us.unwrap(), e.finished_us.unwrap());
            assert!(e.enqueued_us <= started && started <= finished, "{e:?}");
        }
    }

    #[test]
    fn states_follow_the_stream_enqueued_started_completed() {
        let comms = world(2, 8, None);
        let (a, b) = (&comms[0], &comms[1]);
        let sa = a.device().create_stream(Priority::Normal).unwrap();
        let sb = b.device().create_stream(Priority::Normal).unwrap();
        let (ba, bb) = (a.device().alloc(DType::F32, 4).unwrap(), b.device().alloc(DType::F32, 4).unwrap());
        // Rank 0's stream is held by a host function until the test lets it go.
        let (release, held) = mpsc::channel::<()>();
        sa.launch_host_fn(Box::new(move |_| {
            let _ = held.recv_timeout(Duration::from_secs(20));
        }))
        .unwrap();
        a.all_reduce_in_place(ba.view(), ReduceOp::Sum, &sa).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(a.flight_record().unwrap().entries[0].state, CallState::Enqueued);
        release.send(()).unwrap();
        // Rank 0 is inside the all-reduce, waiting for rank 1.
        let e = wait_for(a, |e| e.state != CallState::Enqueued);
        assert_eq!(e.state, CallState::Started, "{e:?}");
        b.all_reduce_in_place(bb.view(), ReduceOp::Sum, &sb).unwrap();
        sa.synchronize().unwrap();
        sb.synchronize().unwrap();
        assert_eq!(wait_for(a, |e| e.state == CallState::Completed).error, None);
    }

    /// The monitor polls from the first unfinished launch on: a launch held
    /// on one stream while later ones on another finish, and the ring
    /// wrapping past both, still end with every state read from its events.
    #[test]
    fn launches_finishing_out_of_order_and_a_wrapping_ring_keep_their_states() {
        let comms = world(1, 4, None);
        let c = &comms[0];
        let (held_stream, free_stream) =
            (c.device().create_stream(Priority::Normal).unwrap(), c.device().create_stream(Priority::Normal).unwrap());
        let (held_buf, buf) = (c.device().alloc(DType::F32, 4).unwrap(), c.device().alloc(DType::F32, 4).unwrap());
        let (release, held) = mpsc::channel::<()>();
        held_stream
            .launch_host_fn(Box::new(move |_| {
                let _ = held.recv_timeout(Duration::from_secs(20));
            }))
            .unwrap();
        c.all_reduce_in_place(held_buf.view(), ReduceOp::Sum, &held_stream).unwrap();
        for _ in 0..2 {
            c.all_reduce_in_place(buf.view(), ReduceOp::Sum, &free_stream).unwrap();
        }
        free_stream.synchronize().unwrap();
        let start = Instant::now();
        let states = loop {
            let states: Vec<CallState> = c.flight_record().unwrap().entries.iter().map(|e| e.state).collect();
            if states[1..].iter().all(|s| *s == CallState::Completed) || start.elapsed() > Duration::from_secs(10) {
                break states;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(states, [CallState::Enqueued, CallState::Completed, CallState::Completed], "the held launch first");
        release.send(()).unwrap();
        held_stream.synchronize().unwrap();
        let first = loop {
            let r = c.flight_record().unwrap();
            if r.entries[0].state == CallState::Completed || start.elapsed() > Duration::from_secs(10) {
                break r.entries[0].state;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(first, CallState::Completed, "the held launch, once let go");
        // Past the ring's 4 entries: the oldest leave, the newest complete.
        for _ in 0..5 {
            c.all_reduce_in_place(buf.view(), ReduceOp::Sum, &free_stream).unwrap();
        }
        free_stream.synchronize().unwrap();
        let last = wait_for(c, |e| e.state == CallState::Completed);
        let record = c.flight_record().unwrap();
        assert_eq!((record.launches, record.entries.len(), last.id), (8, 4, 7));
        assert!(record.entries.iter().all(|e| e.state == CallState::Completed), "{:?}", record.entries);
    }

    #[test]
    fn a_mismatch_fails_the_entry_on_every_rank_with_the_error() {
        let entries = on_every_rank(world(2, 8, None), |c| {
            let s = c.device().create_stream(Priority::Normal).unwrap();
            let buf = c.device().alloc(DType::F32, 8).unwrap();
            let n = if c.rank() == 0 { 8 } else { 4 };
            c.all_reduce_in_place(buf.slice(0, n).unwrap(), ReduceOp::Sum, &s).unwrap();
            assert!(s.synchronize().is_err());
            wait_for(&c, |e| e.state == CallState::Failed)
        });
        for e in entries {
            assert!(e.error.as_deref().unwrap().contains("mismatched collective #0"), "{e:?}");
        }
    }

    #[test]
    fn a_group_keeps_every_call_and_p2p_names_its_peer() {
        let entries = on_every_rank(world(2, 8, None), |c| {
            let s = c.device().create_stream(Priority::Normal).unwrap();
            let (x, y) = (c.device().alloc(DType::I32, 6).unwrap(), c.device().alloc(DType::I32, 6).unwrap());
            let peer = 1 - c.rank();
            c.group(&s, |g| {
                g.send(x.view(), peer)?;
                g.recv(y.view(), peer)?;
                g.broadcast(x.view(), x.view(), 1)
            })
            .unwrap();
            s.synchronize().unwrap();
            wait_for(&c, |e| e.state == CallState::Completed)
        });
        for e in entries {
            let sig: Vec<String> = e.calls.iter().map(CallRecord::signature).collect();
            let peer = e.calls[0].peer.unwrap();
            assert_eq!(
                sig,
                [
                    format!("send(6 x i32, peer {peer})"),
                    format!("recv(6 x i32, peer {peer})"),
                    "broadcast(6 x i32, root 1)".into()
                ]
            );
            assert_eq!((e.calls[0].seq, e.calls[2].seq, e.seq()), (None, Some(0), Some(0)));
        }
    }

    #[test]
    fn splits_are_named_after_their_parent_and_recording_can_be_off() {
        let records =
            on_every_rank(world(2, 4, None), |c| c.split(Some(7), 0).unwrap().unwrap().flight_record().unwrap());
        for (r, record) in records.into_iter().enumerate() {
            assert_eq!((record.id.as_str(), record.rank, record.size), ("root/split0:color7", r as u64, 2));
        }
        assert!(world(1, 0, None)[0].flight_record().is_none());
    }

    #[test]
    fn a_failure_dumps_every_rank_of_the_directory_once() {
        let dir = std::env::temp_dir().join(format!("chorus-recorder-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let comms = world(2, 8, Some(dir.clone()));
        // Rank 0 calls, rank 1 never does: rank 0 times out (2 s).
        let c = &comms[0];
        let s = c.device().create_stream(Priority::Normal).unwrap();
        let buf = c.device().alloc(DType::F32, 8).unwrap();
        c.barrier(&s).unwrap();
        c.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s).unwrap();
        assert!(s.synchronize().is_err());
        let start = Instant::now();
        // Finished dumps only (one being written is a dot-file until renamed).
        let files = |d: &std::path::Path| {
            std::fs::read_dir(d).map_or(0, |r| {
                r.filter(|e| e.as_ref().is_ok_and(|e| !e.file_name().to_string_lossy().starts_with('.'))).count()
            })
        };
        while files(&dir) < 2 {
            assert!(start.elapsed() < Duration::from_secs(10), "no dumps in {}", dir.display());
            std::thread::sleep(Duration::from_millis(10));
        }
        let host = monitor::host_name();
        let read = |r: u64| -> RankDump {
            serde_json::from_slice(&std::fs::read(dir.join(RankDump::file_name(r, &host))).unwrap()).unwrap()
        };
        let (d0, d1) = (read(0), read(1));
        assert!(
            d0.reason.contains("barrier #0 of communicator root failed") && d0.reason.contains("timed out"),
            "{}",
            d0.reason
        );
        assert_eq!((d0.rank, d0.world_size, d0.version), (0, 2, FORMAT_VERSION));
        assert_eq!(d0.communicators[0].entries.len(), 2);
        assert_eq!(d0.communicators[0].entries[0].state, CallState::Failed);
        assert!(d1.communicators[0].entries.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_abort_dumps_with_its_reason() {
        let dir = std::env::temp_dir().join(format!("chorus-recorder-abort-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let comms = world(1, 8, Some(dir.clone()));
        comms[0].abort("the test gives up");
        let dump = wait_for_dump(&dir);
        assert_eq!(dump.reason, "abort of communicator root: the test gives up");
        assert_eq!(dump.communicators[0].aborted.as_deref(), Some("the test gives up"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_launch_refused_at_issue_is_recorded_and_dumped() {
        let dir = std::env::temp_dir().join(format!("chorus-recorder-refused-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let comm = Arc::new(world(1, 8, Some(dir.clone())).remove(0));
        let (s, t) = (
            comm.device().create_stream(Priority::Normal).unwrap(),
            comm.device().create_stream(Priority::Normal).unwrap(),
        );
        let buf = comm.device().alloc(DType::F32, 8).unwrap();
        // A collective issued from inside a host function: the cpu stream
        // refuses it at issue, before anything is enqueued.
        let (tx, rx) = mpsc::channel();
        let c = comm.clone();
        s.launch_host_fn(Box::new(move |_| {
            let _ = tx.send(c.all_reduce_in_place(buf.view(), ReduceOp::Sum, &t).map_err(|e| e.to_string()));
        }))
        .unwrap();
        let error = rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap_err();
        let record = comm.flight_record().unwrap();
        assert_eq!(record.launches, 1);
        let entry = &record.entries[0];
        assert_eq!((entry.state, entry.calls[0].op.as_str(), entry.seq()), (CallState::Failed, "all_reduce", Some(0)));
        assert_eq!(entry.error.as_deref(), Some(error.as_str()));
        assert!(entry.finished_us.is_some());
        // Like any backend error, it makes the rank dump.
        let dump = wait_for_dump(&dir);
        assert!(dump.reason.starts_with("all_reduce #0 of communicator root failed at issue: "), "{}", dump.reason);
        assert_eq!(dump.communicators[0].entries[0].state, CallState::Failed);
        // The next call takes the same sequence number: the refused one took no part.
        s.synchronize().unwrap();
        let buf = comm.device().alloc(DType::F32, 8).unwrap();
        comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s).unwrap();
        s.synchronize().unwrap();
        let last = wait_for(&comm, |e| e.state == CallState::Completed);
        assert_eq!(last.seq(), Some(0));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
