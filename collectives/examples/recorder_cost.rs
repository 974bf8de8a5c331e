//! The flight recorder's cost per call, measured so that machine noise
//! cancels: three simulated worlds of 2 ranks in one process, whose
//! communicators record nothing, record with the default ring, and record
//! starts as well (`track_starts`), used in turn in blocks of `--block`
//! small all-reduces (4 KiB, f32, sum), each call waited for on its stream
//! as `chorus bench` does. A load spike hits neighbouring blocks alike, so
//! the median of the per-round differences from the unrecorded block
//! resolves far less than the run-to-run spread of separate runs. Then the
//! recorder in isolation: the same calls on a communicator whose backend
//! accepts every call and runs none, with and without the recorder, so the
//! difference is the recorder's own work per call (its bookkeeping and the
//! event it records after each launch, on an idle stream). Prints a table
//! and one JSON line.
//!
//! ```sh
//! cargo run --release -p chorus-collectives --example recorder_cost -- --rounds 200 --block 100
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::backend::{Call, Capabilities, CommBackend};
use chorus_collectives::recorder::RecorderOptions;
use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::{forward_to_inner, Communicator, ReduceOp};
use chorus_devices::cpu::{Cpu, CpuConfig, CpuStream};
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

/// A rank's endpoint that accepts every call and runs none: what is left of
/// a launch is the communicator's own work (validation, numbering) and its
/// flight recorder.
struct Accepting {
    inner: SimComm,
}

impl CommBackend for Accepting {
    type B = Cpu;
    const NAME: &'static str = "accepting";
    forward_to_inner!(inner);
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn launch(&self, _calls: Vec<Call<'_, Cpu>>, _stream: &CpuStream) -> chorus_collectives::Result<()> {
        Ok(())
    }
    fn split(&self, _color: Option<u32>, _key: i64) -> chorus_collectives::Result<Option<Self>> {
        Ok(None)
    }
}

/// The recorder alone: `rounds` rounds of `block` calls on a one-rank
/// communicator that runs nothing, without and with the recorder (the order
/// alternating by round); nanoseconds per call of each block.
fn isolated(
    config: &SimConfig,
    recording: &RecorderOptions,
    rounds: usize,
    block: usize,
) -> anyhow::Result<Vec<[f64; 2]>> {
    let make = |options: &RecorderOptions| -> anyhow::Result<Communicator<Accepting>> {
        let inner = SimWorld::new(1, config.clone())?.communicator(0)?.into_backend();
        Ok(Communicator::with_recorder(Accepting { inner }, options))
    };
    let comms = [make(&RecorderOptions::off())?, make(recording)?];
    let setup = comms
        .iter()
        .map(|c| Ok((c.device().create_stream(Priority::Normal)?, c.device().alloc(DType::F32, ELEMENTS)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut blocks = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        let mut per_call = [0.0; 2];
        for k in 0..2 {
            let which = (k + round) % 2;
            let (stream, buf) = &setup[which];
            let start = Instant::now();
            for _ in 0..block {
                comms[which].all_reduce_in_place(buf.view(), ReduceOp::Sum, stream)?;
            }
            per_call[which] = start.elapsed().as_secs_f64() * 1e9 / block as f64;
        }
        if round > 0 {
            blocks.push(per_call);
        }
    }
    for (stream, _) in &setup {
        stream.synchronize()?;
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
    let config_alone = config.clone();
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
    // The recorder alone, with ten times the calls per block (they are short).
    let alone = isolated(&config_alone, &recording, rounds, block * 10)?;
    let without_ns = median(alone.iter().map(|b| b[0]).collect());
    let with_ns = median(alone.iter().map(|b| b[1]).collect());
    let own_ns = median(alone.iter().map(|b| b[1] - b[0]).collect());
    let (q1, q3) = {
        let mut d: Vec<f64> = alone.iter().map(|b| b[1] - b[0]).collect();
        d.sort_by(f64::total_cmp);
        (d[d.len() / 4], d[d.len() * 3 / 4])
    };
    println!(
        "  the recorder alone (a backend that runs nothing, 1 rank): {without_ns:.0} ns per call without, \
         {with_ns:.0} ns with; its own work, median of the rounds: {own_ns:+.0} ns (quartiles {q1:+.0}..{q3:+.0} ns)"
    );
    json["alone_without_ns"] = without_ns.into();
    json["alone_with_ns"] = with_ns.into();
    json["alone_recorder_ns"] = own_ns.into();
    println!("{json}");
    Ok(())
}
