//! Starting worlds and running ranks: results in rank order, a failing or
//! panicking rank reported with its message while the others stop
//! promptly, deadlines, and launcher variables read.

use std::time::{Duration, Instant};

use chorus::collectives::sim::{Fault, FaultKind};
use chorus::testing::{run_ranks, SimRanks};
use chorus::{Error, ReduceOp, World};

#[test]
fn every_rank_returns_its_result_in_rank_order() {
    let ranks = run_ranks(4, |rank| Ok::<_, Error>((rank.rank(), rank.size()))).unwrap();
    assert_eq!(ranks, vec![(0, 4), (1, 4), (2, 4), (3, 4)]);
    let gathered = World::threads(3).run(|rank| rank.all_gather(&[rank.rank() as u8; 2])).unwrap();
    assert!(gathered.iter().all(|g| g == &[0, 0, 1, 1, 2, 2]), "{gathered:?}");
}

#[test]
fn host_collectives_match_their_closed_forms() {
    let n = 4usize;
    let out = run_ranks(n, move |rank| -> chorus::Result<_> {
        let r = rank.rank() as i64;
        let max = rank.all_reduce(&[r, -r], ReduceOp::Max)?;
        let from_two = rank.broadcast(&[r * 100], 2)?;
        // Rank r sends chunk c = [r + c]; it gets chunk r summed: Σ_s (s + r).
        let chunks: Vec<i64> = (0..n as i64).map(|c| r + c).collect();
        let mine = rank.reduce_scatter(&chunks, ReduceOp::Sum)?;
        rank.barrier()?;
        Ok((max, from_two, mine))
    })
    .unwrap();
    for (r, (max, from_two, mine)) in out.into_iter().enumerate() {
        assert_eq!(max, [3, 0]);
        assert_eq!(from_two, [200]);
        assert_eq!(mine, [(0..n as i64).sum::<i64>() + n as i64 * r as i64]);
    }
}

#[test]
fn a_rank_that_returns_an_error_is_named_and_the_others_stop_at_once() {
    let start = Instant::now();
    let err = SimRanks::new(3)
        .timeout(Duration::from_secs(60))
        .run(|rank| {
            if rank.rank() == 2 {
                return Err(format!("no data on rank {}", rank.rank()));
            }
            // The others wait in a collective rank 2 never joins: the abort ends it.
            rank.all_reduce(&[1.0f32], ReduceOp::Sum).map_err(|e| e.to_string())
        })
        .unwrap_err();
    assert_eq!(err.rank(), Some(2), "{err}");
    assert_eq!(err.to_string(), "rank 2 failed: no data on rank 2");
    assert!(start.elapsed() < Duration::from_secs(20), "the others waited {:?}", start.elapsed());
}

#[test]
fn a_panicking_rank_is_reported_with_its_message() {
    let err = run_ranks(2, |rank| -> chorus::Result<()> {
        if rank.rank() == 0 {
            panic!("bad shape on rank {}", rank.rank());
        }
        rank.barrier()
    })
    .unwrap_err();
    assert!(matches!(&err, Error::Panicked { rank: 0, message } if message == "bad shape on rank 0"), "{err}");
}

#[test]
fn a_rank_that_never_returns_ends_at_the_deadline() {
    let start = Instant::now();
    let err = SimRanks::new(2)
        .deadline(Duration::from_millis(500))
        .run(|rank| -> chorus::Result<()> {
            if rank.rank() == 1 {
                std::thread::sleep(Duration::from_secs(5));
            }
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(&err, Error::Deadline { ranks, .. } if ranks == &[1]), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
}

#[test]
fn an_injected_fault_fails_every_rank_with_the_first_failure() {
    let err = SimRanks::new(2)
        .fault(Fault { rank: 1, call: 1, kind: FaultKind::Fail })
        .run(|rank| -> chorus::Result<()> {
            for _ in 0..3 {
                rank.all_reduce(&[1i32], ReduceOp::Sum)?;
            }
            Ok(())
        })
        .unwrap_err();
    // A chorus error a rank returns comes back typed; whichever rank's
    // comes first (the faulty one's, or another's aborted by it), it names
    // the fault.
    assert!(matches!(err.rank_error::<Error>(), Some(Error::Comm(_) | Error::Device(_))), "{err:?}");
    assert!(err.to_string().contains("injected fault"), "{err}");
}

#[test]
fn an_empty_world_and_mismatched_chunks_are_argument_errors() {
    assert!(matches!(run_ranks(0, |_| Ok::<_, Error>(())), Err(Error::InvalidArgument(_))));
    let err = run_ranks(2, |rank| rank.reduce_scatter(&[1.0f32; 3], ReduceOp::Sum)).unwrap_err();
    assert!(err.to_string().contains("3 values do not split into 2 equal chunks"), "{err}");
}

/// Under a launcher's variables, the sim backend (ranks are threads) says
/// what to build instead; `World::threads` ignores the launcher. Run in a
/// child process, since the variables are process-wide.
#[test]
fn the_launchers_world_is_used_where_its_variables_are_set() {
    if std::env::var_os("CHORUS_WORLD_TEST_CHILD").is_some() {
        let err = chorus::run(2, |_| Ok::<_, Error>(())).unwrap_err();
        assert!(err.to_string().contains("the sim backend runs every rank as a thread"), "{err}");
        assert_eq!(World::threads(2).run(|rank| Ok::<_, Error>(rank.rank())).unwrap(), [0, 1]);
        let err = World::launched().run(|_| Ok::<_, Error>(())).unwrap_err();
        assert!(err.to_string().contains("sim backend"), "{err}");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &this_test!("the_launchers_world_is_used_where_its_variables_are_set"), "--nocapture"])
        .env("CHORUS_WORLD_TEST_CHILD", "1")
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("LOCAL_RANK", "0")
        .env("LOCAL_WORLD_SIZE", "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}
