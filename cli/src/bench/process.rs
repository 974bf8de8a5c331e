//! `chorus bench` with one rank per process: `--backend ucx` (always) and
//! `nccl`/`rccl` under a launcher.
//!
//! Every rank joins the job once and measures each (operation, size) with
//! [`measure_rank`], waiting at the communicator's own
//! barrier before each iteration (the processes have no shared clock, so
//! an iteration's time is the slowest rank's, from its barrier to its
//! stream synchronize). Each rank publishes its iteration times and wrong
//! counts in the job's store; rank 0 takes the median over iterations of
//! the slowest rank's time, measures the memcpy reference (in its own
//! process, with as many threads as ranks), and prints the table.

use std::time::Duration;

use anyhow::Context;
use chorus_collectives::{CommBackend, CommError, Communicator};
use chorus_devices::with_element;
use chorus_devices::{Device, Priority, Stream};

use super::args::{print_rounding_note, sizes, BenchArgs};
use super::geometry::{Geometry, Measured};
use super::memcpy;
use super::rank::measure_rank;
use super::table::{Row, Table};
use super::timing::IterBarrier;
use crate::process::RankProcess;
use crate::size::format_bytes;
use crate::Outcome;

/// Deadline of initialization and of every wait.
const DEADLINE: Duration = Duration::from_secs(600);

/// The communicator's barrier, synchronized on the host.
struct CommBarrier<'a, C: CommBackend> {
    comm: &'a Communicator<C>,
    stream: <C::B as chorus_devices::Backend>::Stream,
}

impl<C: CommBackend> IterBarrier for CommBarrier<'_, C> {
    fn wait(&self) -> anyhow::Result<()> {
        self.comm.barrier(&self.stream)?;
        self.stream.synchronize().map_err(CommError::from)?;
        Ok(())
    }
    fn cancel(&self) {
        self.comm.abort("a rank of the benchmark failed");
    }
}

/// `chorus bench --backend ucx`.
#[cfg(feature = "ucx")]
pub fn run_ucx(args: &BenchArgs, p: RankProcess) -> anyhow::Result<Outcome> {
    use chorus_collectives::ucx::UcxComm;
    use chorus_devices::cpu::{CpuConfig, CpuDevice};
    p.check_world_size(args.world_size)?;
    // SAFETY: each rank's collectives run on one stream and the host
    // synchronizes it before touching the buffers again.
    let timeout = RankProcess::ucx_timeout(DEADLINE);
    let device = CpuDevice::new(unsafe {
        CpuConfig::default()
            .with_ordinal(p.env.rank)
            .with_timeout(timeout * 2 + Duration::from_secs(10))
            .without_sanitizer()
    });
    let config = p.ucx_config("bench/ucx", timeout);
    let comm = UcxComm::init(p.store(), p.env.rank, p.env.world_size, device, config)?;
    if args.raw_ucx {
        raw_ucx(args, &p)?;
    }
    run_with(args, &p, comm)
}

/// `--raw-ucx`: the raw UCX tag round trip of each size between ranks 0 and
/// 1 (median over `--iters`), printed by rank 0 before the table.
#[cfg(feature = "ucx")]
fn raw_ucx(args: &BenchArgs, p: &RankProcess) -> anyhow::Result<()> {
    use std::io::Write;
    let store = p.store();
    let mut out = std::io::stdout();
    let leader = p.env.rank == 0;
    if leader && !args.json {
        writeln!(
            out,
            "# raw UCX tag round trip, rank 0 -> rank 1 -> rank 0, the same processes, a UCP worker of their own progressed on the calling thread without pause; median of {} after {}",
            args.iters, args.warmup
        )?;
        writeln!(out, "{:>12} {:>14}", "size", "round trip")?;
    }
    for bytes in sizes(args.min_bytes, args.max_bytes) {
        let prefix = format!("{}/{bytes}", p.prefix("bench/raw-ucx"));
        let times = chorus_collectives::ucx::raw_round_trips(
            &*store,
            &prefix,
            p.env.rank,
            p.env.world_size,
            usize::try_from(bytes)?,
            args.warmup as usize,
            args.iters as usize,
            DEADLINE,
        )
        .with_context(|| format!("rank {}: raw UCX round trip of {bytes} bytes", p.env.rank))?;
        let Some(mut times) = times else { continue };
        times.sort();
        let median = times[times.len() / 2];
        if args.json {
            writeln!(out, "{{\"raw_ucx_round_trip\":true,\"size\":{bytes},\"time_s\":{:.9}}}", median.as_secs_f64())?;
        } else {
            writeln!(out, "{:>12} {:>11.1} us", format_bytes(bytes), median.as_secs_f64() * 1e6)?;
        }
    }
    Ok(())
}

/// `chorus bench --backend nccl|rccl` under a launcher: `LOCAL_RANK` picks the GPU.
pub fn run_vendor<L>(args: &BenchArgs, p: RankProcess) -> anyhow::Result<Outcome>
where
    L: chorus_collectives::nccl_family::VendorLib,
    L::B: chorus_conformance::vendor::HarnessDevice,
{
    use chorus_collectives::nccl_family::{VendorComm, VendorConfig};
    use chorus_conformance::vendor::HarnessDevice;
    p.check_world_size(args.world_size)?;
    let device = L::B::make(p.env.local_rank, DEADLINE)?;
    let config = VendorConfig {
        timeout: DEADLINE,
        store_key: format!("{}/unique_id", p.prefix("bench/nccl")),
        ..VendorConfig::default()
    };
    let comm = VendorComm::<L>::init(&*p.store(), p.env.rank, p.env.world_size, device, config)?;
    run_with(args, &p, comm)
}

fn encode(times: &[f64], wrong: u64) -> Vec<u8> {
    let mut out = wrong.to_le_bytes().to_vec();
    for t in times {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out
}

fn decode(bytes: &[u8]) -> anyhow::Result<(Vec<f64>, u64)> {
    if bytes.len() < 8 || bytes.len() % 8 != 0 {
        anyhow::bail!("a rank's timings are {} bytes", bytes.len());
    }
    let word = |c: &[u8]| {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        b
    };
    let wrong = u64::from_le_bytes(word(&bytes[..8]));
    Ok((bytes[8..].chunks_exact(8).map(|c| f64::from_le_bytes(word(c))).collect(), wrong))
}

fn run_with<C: CommBackend>(args: &BenchArgs, p: &RankProcess, comm: Communicator<C>) -> anyhow::Result<Outcome> {
    use std::io::Write;
    let (n, rank) = (p.env.world_size, p.env.rank);
    let (warmup, iters) = (args.warmup as usize, args.iters as usize);
    let leader = rank == 0;
    let store = p.store();
    let prefix = p.prefix("bench");
    let mut out = std::io::stdout();
    if leader && !args.json {
        writeln!(
            out,
            "# chorus bench: backend {}, {n} ranks, one per process ({}), dtype {}, out-of-place, sizes {}..{}, {iters} timed iterations after {warmup} warm-up",
            args.backend,
            p.env.launcher,
            args.dtype,
            format_bytes(args.min_bytes),
            format_bytes(args.max_bytes)
        )?;
        writeln!(out, "# stream sanitizer off; time = median over iterations of the slowest rank's (communicator barrier → its stream synchronize)")?;
        writeln!(
            out,
            "# memcpy = {n} threads of rank 0 each copying `size` bytes between private buffers (read+write rate);"
        )?;
        writeln!(out, "# efficiency = (bytes the collective must read+write, all ranks) / time / memcpy rate — docs/benchmarks.md")?;
    }
    if leader {
        print_rounding_note(args, &mut out)?;
    }
    let barrier = CommBarrier { comm: &comm, stream: comm.device().create_stream(Priority::Normal)? };
    let mut table = Table::new(args.json);
    for op in args.op.ops() {
        if leader {
            table.op_head(&mut out, op)?;
        }
        for requested in sizes(args.min_bytes, args.max_bytes) {
            let g = Geometry::new(op, n, args.dtype, requested);
            let memcpy_rate = match (leader, g.size) {
                (true, bytes) if bytes > 0 => memcpy::measure(n, usize::try_from(bytes)?, warmup, iters)?,
                _ => 0.0,
            };
            let measured = with_element!(g.dtype, T => measure_rank::<C, T>(&comm, g, &barrier, warmup, iters));
            let (spans, wrong) = measured.with_context(|| format!("rank {rank}: {} of {} bytes", op.name(), g.size))?;
            let times: Vec<f64> = spans.iter().map(|(s, e)| e.saturating_duration_since(*s).as_secs_f64()).collect();
            let key = |r: usize| format!("{prefix}/{}/{}/r{r}", op.name(), g.size);
            store.set(&key(rank), &encode(&times, wrong))?;
            if !leader {
                continue;
            }
            let mut slowest = vec![0.0f64; times.len()];
            let mut wrong_here = 0;
            for r in 0..n {
                let (t, w) = decode(&store.get(&key(r), DEADLINE)?).with_context(|| format!("rank {r}"))?;
                if t.len() != slowest.len() {
                    anyhow::bail!("rank {r} timed {} iterations, rank 0 {}", t.len(), slowest.len());
                }
                for (s, v) in slowest.iter_mut().zip(t) {
                    *s = s.max(v);
                }
                wrong_here += w;
            }
            slowest.sort_by(|a, b| a.total_cmp(b));
            let mid = slowest.len() / 2;
            let median = if slowest.len() % 2 == 1 {
                slowest[mid]
            } else {
                (slowest[mid.saturating_sub(1)] + slowest[mid]) / 2.0
            };
            let time = Duration::from_secs_f64(median);
            table
                .row(&mut out, &Row::new(args.backend, &g, Measured { time, wrong: wrong_here }, memcpy_rate, args))?;
        }
    }
    p.finish("bench", DEADLINE)?;
    if leader {
        table.foot(&mut out)?;
    }
    let wrong_total = table.wrong;
    // Every rank exits alike: rank 0 publishes whether any value was wrong.
    let verdict = format!("{prefix}/verdict");
    if leader {
        store.set(&verdict, if wrong_total == 0 { b"ok" } else { b"wrong" })?;
    }
    let ok = store.get(&verdict, DEADLINE)? == b"ok";
    Ok(if ok { Outcome::Passed } else { Outcome::Failed })
}
