//! Quick checks of the sim backend's plumbing; the full suite lives in `conformance/`.

use std::time::Duration;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::{CommError, ReduceOp};
use chorus_devices::{Buffer, Device, Priority, Stream, StreamExt};

#[test]
fn all_reduce_all_gather_and_p2p_on_four_ranks() -> anyhow::Result<()> {
    let results = SimWorld::run(4, SimConfig::default(), |comm| -> anyhow::Result<()> {
        let (r, n) = (comm.rank(), comm.size());
        let s = comm.device().create_stream(Priority::Normal)?;
        let x: Vec<f32> = (0..10).map(|i| (i + r) as f32).collect();
        let send = s.buffer_from(&x)?;
        let recv = s.alloc(chorus_devices::DType::F32, 10)?;
        comm.all_reduce(send.view(), recv.view(), ReduceOp::Sum, &s)?;
        let got: Vec<f32> = s.read_vec(recv.view())?;
        let want: Vec<f32> = (0..10).map(|i| (n * i + n * (n - 1) / 2) as f32).collect();
        assert_eq!(got, want);

        let gathered = s.alloc(chorus_devices::DType::F32, 10 * n)?;
        comm.all_gather(send.view(), gathered.view(), &s)?;
        let got: Vec<f32> = s.read_vec(gathered.view())?;
        let want: Vec<f32> = (0..n).flat_map(|q| (0..10).map(move |i| (i + q) as f32)).collect();
        assert_eq!(got, want);

        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let inbox = s.alloc(chorus_devices::DType::F32, 10)?;
        comm.group(&s, |g| {
            g.send(send.view(), next)?;
            g.recv(inbox.view(), prev)
        })?;
        let got: Vec<f32> = s.read_vec(inbox.view())?;
        assert_eq!(got, (0..10).map(|i| (i + prev) as f32).collect::<Vec<_>>());
        Ok(())
    })?;
    for r in results {
        r??;
    }
    Ok(())
}

#[test]
fn a_missing_rank_times_out_everywhere() -> anyhow::Result<()> {
    let config = SimConfig { timeout: Duration::from_millis(300), ..SimConfig::default() };
    let results = SimWorld::run(3, config, |comm| -> anyhow::Result<Option<CommError>> {
        let s = comm.device().create_stream(Priority::Normal)?;
        let b = s.buffer_from(&[1.0f32; 4])?;
        if comm.rank() != 2 {
            comm.all_reduce_in_place(b.view(), ReduceOp::Sum, &s)?;
        }
        Ok(s.synchronize().err().map(CommError::from))
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        let e = r??;
        if rank == 2 {
            assert!(e.is_none());
        } else {
            assert!(matches!(e, Some(CommError::Timeout { ref missing, .. }) if missing == &vec![2]), "{e:?}");
        }
    }
    Ok(())
}
