//! The flight recorder's cost per call, measured so that machine noise
//! cancels: three simulated worlds of 2 ranks in one process, whose
//! communicators record nothing, record with the default ring, and record
//! starts as well (`track_starts`), used in turn in blocks of `--block`
//! small all-reduces (4 KiB, f32, sum), each call waited for on its stream
//! as `chorus bench` does. A load spike hits neighbouring blocks alike, so
//! the median of the per-round differences from the unrecorded block
//! resolves far less than the run-to-run spread of separate runs. Prints a
//! table and one JSON line.
//!
//! ```sh
//! cargo run --release -p chorus-collectives --example recorder_cost -- --rounds 200 --block 100
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::recorder::RecorderOptions;
use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::{Communicator, ReduceOp};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::{Buffer, DType, Device, Priority, Stream};

const RANKS: usize = 2;
const ELEMENTS: usize = 1024;

fn flag(args: &[String], name: &str, default: usize) -> anyhow::Result<usize> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args.get(i + 1).with_context(|| format!("{name} needs a value"))?;
            let n: usize = v.parse().with_context(|| format!("{name} {v:?}: not a count"))?;
            if n == 0 {
                bail!("{name} must be at least 1");
            }
            Ok(n)
        }
    }
}

/// The settings compared, in the order of a round's results.
const SETTINGS: [&str; 3] = ["off", "on", "on, starts tracked"];

/// One rank: `rounds` rounds of a block on each communicator (the order
/// rotating by round); the seconds per call of each block, by setting.
fn rank(comms: [Communicator<SimComm>; 3], rounds: usize, block: usize) -> anyhow::Result<Vec<[f64; 3]>> {
    let mut setup = Vec::new();
    for comm in &comms {
        let dev = comm.device();
        let stream = dev.create_stream(Priority::Normal)?;
        let buf = dev.alloc(DType::F32, ELEMENTS)?;
        setup.push((stream, buf));
    }
    let mut blocks = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        let mut per_call = [0.0; 3];
        for k in 0..3 {
            let which = (k + round) % 3;
            let (comm, (stream, buf)) = (&comms[which], &setup[which]);
            let start = Instant::now();
            for _ in 0..block {
                comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, stream)?;
                stream.synchronize()?;
            }
            per_call[which] = start.elapsed().as_secs_f64() / block as f64;
        }
        // Round 0 warms both up.
        if round > 0 {
            blocks.push(per_call);
        }
    }
    Ok(blocks)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds = flag(&args, "--rounds", 200)?;
    let block = flag(&args, "--block", 100)?;
    // As `chorus bench` runs: the stream sanitizer off.
    // SAFETY: each rank's buffer is touched only by collectives on its one
    // stream, and each call is waited for before the next is issued.
    let device = unsafe { CpuConfig::default().without_sanitizer() };
    let config = SimConfig { timeout: Duration::from_secs(30), device };
    let recording = RecorderOptions::default();
    let options =
        [RecorderOptions::off(), recording.clone(), RecorderOptions { track_starts: true, ..recording.clone() }];
    let worlds =
        [SimWorld::new(RANKS, config.clone())?, SimWorld::new(RANKS, config.clone())?, SimWorld::new(RANKS, config)?];
    let mut threads = Vec::new();
    for r in 0..RANKS {
        let comm = |i: usize| -> anyhow::Result<Communicator<SimComm>> {
            Ok(Communicator::with_recorder(worlds[i].communicator(r)?.into_backend(), &options[i]))
        };
        let comms = [comm(0)?, comm(1)?, comm(2)?];
        threads.push(std::thread::spawn(move || rank(comms, rounds, block)));
    }
    let mut per_rank = Vec::new();
    for t in threads {
        per_rank.push(t.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??);
    }
    // Rank 0's blocks (both ranks wait for each other in every call).
    let blocks = &per_rank[0];
    let us = |x: f64| x * 1e6;
    let off_us = us(median(blocks.iter().map(|b| b[0]).collect()));
    let spread: Vec<f64> = blocks.iter().map(|b| us(b[0])).collect();
    let (lo, hi) = (spread.iter().copied().fold(f64::MAX, f64::min), spread.iter().copied().fold(0.0, f64::max));
    println!(
        "flight recorder cost: sim, {RANKS} ranks, all_reduce of {} bytes, {rounds} rounds of {block} calls, ring of {} entries",
        ELEMENTS * 4,
        recording.entries
    );
    println!("  {:<20} median {off_us:.2} us per call (blocks {lo:.1}..{hi:.1} us)", SETTINGS[0]);
    let mut json = serde_json::json!({
        "backend": "sim", "ranks": RANKS, "bytes": ELEMENTS * 4, "rounds": rounds, "block": block, "off_us": off_us,
    });
    for (i, name) in SETTINGS.iter().enumerate().skip(1) {
        let at_us = us(median(blocks.iter().map(|b| b[i]).collect()));
        let diff_us = us(median(blocks.iter().map(|b| b[i] - b[0]).collect()));
        let percent = 100.0 * diff_us / off_us;
        println!(
            "  {name:<20} median {at_us:.2} us per call; minus off, median of the rounds: {diff_us:+.2} us ({percent:+.2}%)"
        );
        let key = if i == 1 { "on" } else { "starts" };
        json[format!("{key}_us")] = at_us.into();
        json[format!("{key}_paired_diff_us")] = diff_us.into();
        json[format!("{key}_paired_diff_percent")] = percent.into();
    }
    println!("{json}");
    Ok(())
}
