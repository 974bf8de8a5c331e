//! `chorus bench`: nccl-tests-style tables for the collectives of a backend.
//!
//! Columns and formulas follow nccl-tests (`doc/PERFORMANCE.md` there):
//! `size` is the bytes of the largest buffer a rank holds (the all-gather
//! output, the reduce-scatter input), `algbw = size / time`, and
//! `busbw = algbw · factor` with factor `2(n−1)/n` for all_reduce, `(n−1)/n`
//! for all_gather, reduce_scatter and all_to_all, and 1 for broadcast.
//!
//! chorus adds an **efficiency**: the bytes that any algorithm must read and
//! write in one address space for the collective, summed over ranks, per
//! second, divided by the read+write rate of `n` threads doing plain memcpys
//! of `size` bytes, measured in the same run ([`memcpy`]). See
//! `docs/benchmarks.md`.

mod memcpy;
mod pattern;
mod process;
#[cfg(feature = "sim")]
mod sim;
mod timing;
mod vendor;

use std::io::Write;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Serialize;

use chorus_collectives::{CommBackend, CommError, Communicator};
use chorus_devices::{Buffer, DType, Device, Element, Priority, Stream, StreamExt};
use pattern::{Expectation, Pattern};
use timing::{timed_loop, Spans};

use crate::backends::{parse_backend, Backend};
use crate::conformance::parse_world_size;
use crate::size::{format_bytes, parse_nonzero_bytes};
use crate::{Outcome, UsageError};

/// Arguments of `chorus bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The communication backend to measure: sim or simnccl (ranks as threads of this process), ucx (one rank per
    /// process under a launcher), nccl or rccl (one rank per GPU); ucx, nccl and rccl in builds with those features.
    #[arg(long, default_value = "sim", value_parser = parse_backend)]
    pub backend: Backend,
    /// The collective, or `all` for every one in turn.
    #[arg(long, value_enum, default_value_t = OpArg::AllReduce)]
    pub op: OpArg,
    /// Number of ranks.
    #[arg(long, default_value_t = 8, value_parser = parse_world_size)]
    pub world_size: usize,
    /// Smallest size (bytes; suffixes K, M, G are powers of 1024). Sizes double up to --max-bytes.
    #[arg(long, default_value = "1K", value_parser = parse_nonzero_bytes)]
    pub min_bytes: u64,
    /// Largest size.
    #[arg(long, default_value = "256M", value_parser = parse_nonzero_bytes)]
    pub max_bytes: u64,
    /// Element type.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Untimed iterations before them.
    #[arg(long, default_value_t = 5)]
    pub warmup: u32,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
    /// With `--backend ucx`: first time a raw UCX tag round trip of each size between ranks 0 and 1 of the
    /// same processes (a worker of their own, progressed on the calling thread): the floor the backend's own
    /// cost is measured against (docs/benchmarks.md).
    #[arg(long)]
    pub raw_ucx: bool,
}

fn parse_dtype(text: &str) -> Result<DType, String> {
    text.parse()
}

/// `--op`: one collective or all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OpArg {
    /// all_reduce (sum).
    #[value(name = "all_reduce", alias = "all-reduce")]
    AllReduce,
    /// all_gather.
    #[value(name = "all_gather", alias = "all-gather")]
    AllGather,
    /// reduce_scatter (sum).
    #[value(name = "reduce_scatter", alias = "reduce-scatter")]
    ReduceScatter,
    /// broadcast from rank 0.
    #[value(name = "broadcast")]
    Broadcast,
    /// all_to_all.
    #[value(name = "all_to_all", alias = "all-to-all", alias = "alltoall")]
    AllToAll,
    /// Every collective above, one table each.
    #[value(name = "all")]
    All,
}

impl OpArg {
    fn ops(self) -> Vec<Op> {
        match self {
            OpArg::AllReduce => vec![Op::AllReduce],
            OpArg::AllGather => vec![Op::AllGather],
            OpArg::ReduceScatter => vec![Op::ReduceScatter],
            OpArg::Broadcast => vec![Op::Broadcast],
            OpArg::AllToAll => vec![Op::AllToAll],
            OpArg::All => Op::ALL.to_vec(),
        }
    }
}

/// A collective the bench measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Sum over ranks, result on every rank.
    AllReduce,
    /// Every rank's input, concatenated in rank order, on every rank.
    AllGather,
    /// Sum over ranks, chunk r on rank r.
    ReduceScatter,
    /// Rank 0's buffer on every rank.
    Broadcast,
    /// Chunk j of rank r's input to chunk r of rank j's output.
    AllToAll,
}

impl Op {
    /// Every operation, in the order `--op all` runs them.
    pub const ALL: [Op; 5] = [Op::AllReduce, Op::AllGather, Op::ReduceScatter, Op::Broadcast, Op::AllToAll];

    /// The name, as in the table.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
        }
    }

    /// The reduce operator (`none` for data movement only).
    pub fn redop(self) -> &'static str {
        match self {
            Op::AllReduce | Op::ReduceScatter => "sum",
            Op::AllGather | Op::Broadcast | Op::AllToAll => "none",
        }
    }

    /// The root, for rooted collectives.
    pub fn root(self) -> Option<usize> {
        (self == Op::Broadcast).then_some(0)
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }

    /// Bytes any algorithm must read and write in one address space, summed
    /// over the `n` ranks, for a collective of nccl-tests size `size`:
    /// - all_reduce (`size` per rank): each rank's output is written (`size`)
    ///   and each rank's input read (`size`): `2·size·n`;
    /// - all_gather (output `size` per rank): `size` read and `size` written per rank: `2·size·n`;
    /// - reduce_scatter (input `size` per rank): `size` read, `size/n` written per rank: `size·n + size`;
    /// - broadcast: each non-root reads `size` (of the root) and writes `size`: `2·size·(n−1)`;
    /// - all_to_all (`size` per rank): `size` read, `size` written per rank: `2·size·n`.
    pub fn required_bytes(self, size: u64, n: usize) -> f64 {
        let (s, n) = (size as f64, n as f64);
        match self {
            Op::AllReduce | Op::AllGather | Op::AllToAll => 2.0 * s * n,
            Op::ReduceScatter => s * n + s,
            Op::Broadcast => 2.0 * s * (n - 1.0),
        }
    }
}

/// The buffers of one measurement.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// The operation.
    pub op: Op,
    /// Ranks.
    pub n: usize,
    /// Element type.
    pub dtype: DType,
    /// nccl-tests' `count`: elements in `size`.
    pub count: usize,
    /// nccl-tests' `size` in bytes.
    pub size: u64,
    /// Elements of each rank's send buffer.
    pub send_len: usize,
    /// Elements of each rank's receive buffer.
    pub recv_len: usize,
    /// Elements per chunk (see [`pattern::Expectation::chunk`]).
    pub chunk: usize,
    /// The inputs.
    pub pattern: Pattern,
}

impl Geometry {
    /// The geometry for a requested size: the element count is rounded down to
    /// whole elements, and to a multiple of `n` where the op splits buffers in
    /// `n` chunks (as nccl-tests does).
    pub fn new(op: Op, n: usize, dtype: DType, requested: u64) -> Geometry {
        let mut count = usize::try_from(requested).unwrap_or(usize::MAX) / dtype.size();
        let chunked = matches!(op, Op::AllGather | Op::ReduceScatter | Op::AllToAll);
        if chunked {
            count -= count % n;
        }
        let chunk = if chunked { count / n } else { count };
        let (send_len, recv_len) = match op {
            Op::AllReduce | Op::Broadcast | Op::AllToAll => (count, count),
            Op::ReduceScatter => (count, chunk),
            Op::AllGather => (chunk, count),
        };
        Geometry {
            op,
            n,
            dtype,
            count,
            size: (count * dtype.size()) as u64,
            send_len,
            recv_len,
            chunk,
            pattern: Pattern::new(dtype, n),
        }
    }
}

/// What a backend measured for one geometry.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// Median iteration time.
    pub time: Duration,
    /// Output elements, over all ranks, that differ from the expected values.
    pub wrong: u64,
}

/// One row of the table (and one JSON object with `--json`).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The backend.
    pub backend: String,
    /// The collective.
    pub op: &'static str,
    /// Ranks.
    pub world_size: usize,
    /// nccl-tests' size, bytes.
    pub size_bytes: u64,
    /// nccl-tests' count, elements.
    pub count: usize,
    /// Element type.
    pub dtype: &'static str,
    /// Reduce operator or `none`.
    pub redop: &'static str,
    /// Root of rooted collectives.
    pub root: Option<usize>,
    /// Median time of one iteration, microseconds.
    pub time_us: f64,
    /// `size / time`, GB/s (10⁹ bytes).
    pub algbw_gbps: f64,
    /// `algbw · bus factor`, GB/s.
    pub busbw_gbps: f64,
    /// Wrong output elements after the timed iterations, over all ranks.
    pub wrong: u64,
    /// Read+write rate of `world_size` threads copying `size` bytes each, GB/s.
    pub memcpy_gbps: f64,
    /// Required bytes per second ÷ memcpy rate.
    pub efficiency: f64,
    /// Timed iterations.
    pub iters: u32,
    /// Warm-up iterations.
    pub warmup: u32,
}

impl Row {
    fn new(backend: Backend, g: &Geometry, m: Measured, memcpy_rate: f64, args: &BenchArgs) -> Row {
        let secs = m.time.as_secs_f64();
        let per_sec = |bytes: f64| if secs > 0.0 { bytes / secs } else { 0.0 };
        let algbw = per_sec(g.size as f64) / 1e9;
        let required_rate = per_sec(g.op.required_bytes(g.size, g.n));
        Row {
            backend: backend.to_string(),
            op: g.op.name(),
            world_size: g.n,
            size_bytes: g.size,
            count: g.count,
            dtype: g.dtype.name(),
            redop: g.op.redop(),
            root: g.op.root(),
            time_us: secs * 1e6,
            algbw_gbps: algbw,
            busbw_gbps: algbw * g.op.bus_factor(g.n),
            wrong: m.wrong,
            memcpy_gbps: memcpy_rate / 1e9,
            efficiency: if memcpy_rate > 0.0 { required_rate / memcpy_rate } else { 0.0 },
            iters: args.iters,
            warmup: args.warmup,
        }
    }
}

const TABLE_HEAD: [&str; 2] = [
    "#        size         count   type   redop  root      time    algbw    busbw  #wrong    memcpy  efficiency",
    "#         (B)    (elements)                          (us)   (GB/s)   (GB/s)            (GB/s)",
];

fn table_line(r: &Row) -> String {
    let root = r.root.map_or("-1".to_string(), |x| x.to_string());
    format!(
        "{:>13} {:>13} {:>6} {:>7} {:>5} {:>9.1} {:>8.2} {:>8.2} {:>7} {:>9.2} {:>11.2}",
        r.size_bytes,
        r.count,
        r.dtype,
        r.redop,
        root,
        r.time_us,
        r.algbw_gbps,
        r.busbw_gbps,
        r.wrong,
        r.memcpy_gbps,
        r.efficiency
    )
}

/// The sizes from `min` doubling while at most `max`.
pub fn sizes(min: u64, max: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        match s.checked_mul(2) {
            Some(next) => s = next,
            None => break,
        }
    }
    out
}

/// Bytes of the smallest buffer `op` can measure: one element, or one per
/// rank where the op splits its buffer into `n` chunks.
fn smallest_size(op: Op, n: usize, dtype: DType) -> u64 {
    let chunked = matches!(op, Op::AllGather | Op::ReduceScatter | Op::AllToAll);
    (dtype.size() as u64).saturating_mul(if chunked { n as u64 } else { 1 })
}

/// Refuses a `--min-bytes` that holds no whole element (one per rank where
/// the op splits its buffer): such a size would time an empty collective.
fn check_sizes(args: &BenchArgs) -> Result<(), UsageError> {
    for op in args.op.ops() {
        let smallest = smallest_size(op, args.world_size, args.dtype);
        if args.min_bytes < smallest {
            let per_rank = if smallest > args.dtype.size() as u64 { ", at least one per rank" } else { "" };
            return Err(UsageError(format!(
                "--min-bytes {}: {} on {} ranks measures whole {} elements ({} bytes){per_rank}: give at least {smallest}",
                format_bytes(args.min_bytes),
                op.name(),
                args.world_size,
                args.dtype,
                args.dtype.size()
            )));
        }
    }
    Ok(())
}

/// What the output says when a requested size is not what was measured:
/// sizes are rounded down to whole elements, and to a multiple of the
/// world size where the op splits its buffer (as nccl-tests does).
fn rounding_note(args: &BenchArgs) -> Option<String> {
    let rounded = args.op.ops().into_iter().any(|op| {
        sizes(args.min_bytes, args.max_bytes)
            .into_iter()
            .any(|s| Geometry::new(op, args.world_size, args.dtype, s).size != s)
    });
    rounded.then(|| {
        format!(
            "# sizes are rounded down to whole {} elements ({} bytes; for all_gather, reduce_scatter and all_to_all \
             to a multiple of {} elements): the size column is the size measured",
            args.dtype,
            args.dtype.size(),
            args.world_size
        )
    })
}

/// Prints the [`rounding_note`], if any: a header line of the table, or a
/// line on stderr next to JSON rows.
pub(crate) fn print_rounding_note(args: &BenchArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    match rounding_note(args) {
        Some(note) if args.json => eprintln!("{}", note.trim_start_matches("# ")),
        Some(note) => writeln!(out, "{note}")?,
        None => {}
    }
    Ok(())
}

// Without a backend feature the enum is empty and the arguments go unused.
#[cfg_attr(not(feature = "sim"), allow(unused_variables))]
fn measure(backend: Backend, g: Geometry, warmup: usize, iters: usize) -> anyhow::Result<Measured> {
    crate::with_backend!(
        backend,
        sim => sim::measure(g, warmup, iters),
        ucx => Err(anyhow::anyhow!("the ucx backend measures one rank per process (bench/process.rs)")),
        vendor<L> => vendor::measure::<L>(g, warmup, iters)
    )
}

/// Refuses sizes whose buffers the machine cannot hold, before anything is
/// allocated: the ranks whose buffers live in this host's memory (all of
/// them for sim and simnccl, this node's for ucx) each hold a send and a
/// receive buffer of the largest size, and the memcpy reference as much
/// again (budgeted as 3 × ranks × the largest size). GPU backends allocate
/// on their devices and are not checked here.
fn check_host_memory(args: &BenchArgs) -> anyhow::Result<()> {
    let host_ranks: u128 = match args.backend.name() {
        "sim" | "simnccl" => args.world_size as u128,
        "ucx" => chorus_collectives::bootstrap::LaunchEnv::from_process_env().map_or(1, |e| e.local_world_size) as u128,
        _ => return Ok(()),
    };
    let largest = sizes(args.min_bytes, args.max_bytes).last().copied().unwrap_or(0) as u128;
    crate::size::check_memory(
        host_ranks.saturating_mul(3).saturating_mul(largest),
        &format!("--max-bytes {} on {host_ranks} ranks of this host", format_bytes(args.max_bytes)),
        "lower --max-bytes or --world-size",
    )
    .map_err(|m| UsageError(m).into())
}

/// `chorus bench`.
pub fn run(args: &BenchArgs) -> anyhow::Result<Outcome> {
    if args.min_bytes > args.max_bytes {
        return Err(UsageError(format!(
            "--min-bytes ({}) is larger than --max-bytes ({})",
            format_bytes(args.min_bytes),
            format_bytes(args.max_bytes)
        ))
        .into());
    }
    check_sizes(args)?;
    check_host_memory(args)?;
    if args.raw_ucx && args.backend.name() != "ucx" {
        return Err(
            UsageError(format!("--raw-ucx measures UCX itself: it needs --backend ucx, not {}", args.backend)).into()
        );
    }
    if args.backend.runs_as_processes() {
        #[cfg(feature = "ucx")]
        if args.backend == Backend::Ucx {
            let p = crate::process::RankProcess::require("ucx")?;
            return process::run_ucx(args, p);
        }
        if let Some(p) = crate::process::RankProcess::detect()? {
            return crate::with_backend!(
                args.backend,
                sim => unreachable_backend(),
                ucx => unreachable_backend(),
                vendor<L> => process::run_vendor::<L>(args, p)
            );
        }
    }
    run_threads(args)
}

/// A backend that never reaches this dispatch (handled above).
#[allow(dead_code)]
fn unreachable_backend() -> anyhow::Result<Outcome> {
    anyhow::bail!("this backend runs its ranks as threads")
}

/// `chorus bench` with the ranks as threads of this process.
fn run_threads(args: &BenchArgs) -> anyhow::Result<Outcome> {
    crate::backends::check_thread_world(args.backend, args.world_size).map_err(UsageError)?;
    let (n, warmup, iters) = (args.world_size, args.warmup as usize, args.iters as usize);
    let mut out = std::io::stdout();
    if !args.json {
        writeln!(
            out,
            "# chorus bench: backend {}, {n} ranks, dtype {}, out-of-place, sizes {}..{}, {iters} timed iterations after {warmup} warm-up",
            args.backend,
            args.dtype,
            format_bytes(args.min_bytes),
            format_bytes(args.max_bytes)
        )?;
        writeln!(out, "# stream sanitizer off; time = median over iterations of (host barrier → slowest rank's stream synchronize)")?;
        writeln!(out, "# memcpy = {n} threads each copying `size` bytes between private buffers (read+write rate);")?;
        writeln!(out, "# efficiency = (bytes the collective must read+write, all ranks) / time / memcpy rate — docs/benchmarks.md")?;
    }
    print_rounding_note(args, &mut out)?;
    let mut table = Table::new(args.json);
    for op in args.op.ops() {
        table.op_head(&mut out, op)?;
        for requested in sizes(args.min_bytes, args.max_bytes) {
            let g = Geometry::new(op, n, args.dtype, requested);
            // Measured next to each collective, not once per size, so that both
            // see the same load on a shared machine.
            let memcpy_rate = match g.size {
                0 => 0.0,
                bytes => memcpy::measure(n, usize::try_from(bytes)?, warmup, iters)?,
            };
            let m = measure(args.backend, g, warmup, iters)
                .map_err(|e| e.context(format!("{} of {} bytes on {n} ranks", op.name(), g.size)))?;
            table.row(&mut out, &Row::new(args.backend, &g, m, memcpy_rate, args))?;
        }
    }
    table.foot(&mut out)?;
    Ok(if table.wrong == 0 { Outcome::Passed } else { Outcome::Failed })
}

/// What a run prints per collective and size (a table line or a JSON
/// object), and the totals its last lines report.
pub(crate) struct Table {
    json: bool,
    /// Wrong elements over every row.
    pub(crate) wrong: u64,
    busbw_sum: f64,
    rows: usize,
}

impl Table {
    pub(crate) fn new(json: bool) -> Table {
        Table { json, wrong: 0, busbw_sum: 0.0, rows: 0 }
    }

    /// The head of one collective's table.
    pub(crate) fn op_head(&self, out: &mut dyn Write, op: Op) -> anyhow::Result<()> {
        if !self.json {
            writeln!(out, "#\n# {}", op.name())?;
            for line in TABLE_HEAD {
                writeln!(out, "{line}")?;
            }
        }
        Ok(())
    }

    pub(crate) fn row(&mut self, out: &mut dyn Write, row: &Row) -> anyhow::Result<()> {
        self.wrong += row.wrong;
        self.busbw_sum += row.busbw_gbps;
        self.rows += 1;
        if self.json {
            writeln!(out, "{}", serde_json::to_string(row)?)?;
        } else {
            writeln!(out, "{}", table_line(row))?;
        }
        Ok(out.flush()?)
    }

    pub(crate) fn foot(&self, out: &mut dyn Write) -> anyhow::Result<()> {
        if !self.json {
            let wrong = self.wrong;
            writeln!(out, "# wrong values: {wrong} {}", if wrong == 0 { "OK" } else { "FAILED" })?;
            if self.rows > 0 {
                writeln!(
                    out,
                    "# average busbw: {:.2} GB/s over {} rows",
                    self.busbw_sum / self.rows as f64,
                    self.rows
                )?;
            }
        }
        Ok(())
    }
}

/// Elements per host staging piece when filling inputs and checking outputs:
/// whole-buffer host copies would double the memory of the largest sizes.
const PIECE: usize = 1 << 22;

/// One rank's part, on any backend: set up, time, check. Returns its spans and its wrong-element count.
pub(crate) fn measure_rank<C: CommBackend, T: Element>(
    comm: &Communicator<C>,
    g: Geometry,
    barrier: &dyn timing::IterBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)> {
    let me = comm.rank();
    let stream = comm.device().create_stream(Priority::Normal)?;
    let send = stream.alloc(T::DTYPE, g.send_len)?;
    let mut start = 0;
    while start < g.send_len {
        let len = PIECE.min(g.send_len - start);
        let piece: Vec<T> = (start..start + len).map(|i| T::from_f64(g.pattern.value(me, i))).collect();
        stream.upload(&piece, send.slice(start, len)?)?;
        stream.synchronize()?;
        start += len;
    }
    let recv = stream.alloc(T::DTYPE, g.recv_len)?;
    stream.synchronize()?;

    let spans = timed_loop(barrier, warmup, iters, || {
        launch(comm, g.op, send.view(), recv.view(), &stream)?;
        stream.synchronize().map_err(CommError::from)?;
        Ok(())
    })?;

    let expect = Expectation { op: g.op, n: g.n, chunk: g.chunk, pattern: g.pattern };
    let mut wrong = 0;
    start = 0;
    while start < recv.len() {
        let len = PIECE.min(recv.len() - start);
        let got: Vec<T> = stream.read_vec(recv.slice(start, len)?)?;
        wrong += expect.count_wrong(me, start, got.iter().map(|v| v.to_f64()));
        start += len;
    }
    Ok((spans, wrong))
}

/// Enqueues one `op` (sum for the reducing ones, root 0 for broadcast) on any backend.
fn launch<C: chorus_collectives::CommBackend>(
    comm: &chorus_collectives::Communicator<C>,
    op: Op,
    send: chorus_devices::View<'_, C::B>,
    recv: chorus_devices::View<'_, C::B>,
    stream: &<C::B as chorus_devices::Backend>::Stream,
) -> Result<(), chorus_collectives::CommError> {
    use chorus_collectives::ReduceOp;
    match op {
        Op::AllReduce => comm.all_reduce(send, recv, ReduceOp::Sum, stream),
        Op::AllGather => comm.all_gather(send, recv, stream),
        Op::ReduceScatter => comm.reduce_scatter(send, recv, ReduceOp::Sum, stream),
        Op::Broadcast => comm.broadcast(send, recv, 0, stream),
        Op::AllToAll => comm.all_to_all(send, recv, stream),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_double_from_min_to_max() {
        assert_eq!(sizes(1024, 8192), vec![1024, 2048, 4096, 8192]);
        assert_eq!(sizes(1000, 5000), vec![1000, 2000, 4000]);
        assert_eq!(sizes(16 << 20, 16 << 20), vec![16 << 20]);
    }

    #[test]
    fn geometry_follows_nccl_tests_size_conventions() {
        // all_gather: size is the output; each rank sends size/n.
        let g = Geometry::new(Op::AllGather, 8, DType::F32, 1024);
        assert_eq!((g.count, g.size, g.send_len, g.recv_len, g.chunk), (256, 1024, 32, 256, 32));
        // reduce_scatter: size is the input; each rank keeps size/n.
        let g = Geometry::new(Op::ReduceScatter, 8, DType::F32, 1024);
        assert_eq!((g.send_len, g.recv_len, g.chunk), (256, 32, 32));
        // Counts are rounded down to a multiple of n where buffers are chunked.
        let g = Geometry::new(Op::AllToAll, 3, DType::F32, 1024);
        assert_eq!((g.count, g.size, g.chunk), (255, 1020, 85));
        let g = Geometry::new(Op::AllReduce, 3, DType::F64, 1028);
        assert_eq!((g.count, g.size, g.send_len, g.recv_len), (128, 1024, 128, 128));
    }

    #[test]
    fn bus_factors_and_required_bytes() {
        assert_eq!(Op::AllReduce.bus_factor(8), 1.75);
        assert_eq!(Op::AllGather.bus_factor(8), 0.875);
        assert_eq!(Op::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Op::AllReduce.required_bytes(100, 4), 800.0);
        assert_eq!(Op::ReduceScatter.required_bytes(100, 4), 500.0);
        assert_eq!(Op::Broadcast.required_bytes(100, 4), 600.0);
    }

    fn args(op: OpArg, world_size: usize, min_bytes: u64, max_bytes: u64, dtype: DType) -> BenchArgs {
        BenchArgs {
            backend: crate::backends::Backend::compiled()[0],
            op,
            world_size,
            min_bytes,
            max_bytes,
            dtype,
            iters: 1,
            warmup: 0,
            json: false,
            raw_ucx: false,
        }
    }

    #[test]
    fn sizes_below_one_element_are_refused() {
        // The case: 3, 6 and 12 bytes of f64 were timed as 0, 0 and 8 bytes.
        let e = check_sizes(&args(OpArg::AllReduce, 8, 3, 13, DType::F64)).unwrap_err().0;
        assert!(e.contains("--min-bytes 3") && e.contains("at least 8"), "{e}");
        assert!(check_sizes(&args(OpArg::AllReduce, 8, 8, 13, DType::F64)).is_ok());
        // Chunked ops need one element per rank: 8 ranks of f32 is 32 bytes.
        let e = check_sizes(&args(OpArg::All, 8, 16, 1024, DType::F32)).unwrap_err().0;
        assert!(e.contains("all_gather") && e.contains("per rank") && e.contains("at least 32"), "{e}");
        assert!(check_sizes(&args(OpArg::All, 8, 32, 1024, DType::F32)).is_ok());
        // No size that passes the check measures an empty buffer.
        for (op, n, min) in [(Op::AllReduce, 8, 8u64), (Op::AllToAll, 3, 24), (Op::ReduceScatter, 5, 41)] {
            for s in sizes(min, 1 << 12) {
                assert!(Geometry::new(op, n, DType::F64, s).count > 0, "{op:?} {n} {s}");
            }
        }
    }

    #[test]
    fn rounded_sizes_are_announced() {
        assert_eq!(rounding_note(&args(OpArg::All, 8, 1024, 1 << 20, DType::F32)), None);
        let note = rounding_note(&args(OpArg::AllReduce, 8, 9, 40, DType::F64)).expect("9 bytes is not whole f64s");
        assert!(note.contains("rounded down to whole f64 elements"), "{note}");
        assert!(
            rounding_note(&args(OpArg::AllGather, 3, 1024, 1024, DType::F32)).is_some(),
            "256 is not a multiple of 3"
        );
    }

    #[test]
    fn raw_ucx_without_the_ucx_backend_is_a_usage_error() {
        let mut a = args(OpArg::AllReduce, 2, 4096, 4096, DType::F32);
        a.backend = crate::backends::Backend::Sim;
        a.raw_ucx = true;
        let e = run(&a).unwrap_err();
        let usage = e.downcast_ref::<UsageError>().unwrap_or_else(|| panic!("not a usage error: {e}"));
        assert!(usage.0.contains("--raw-ucx"), "{usage}");
    }

    #[test]
    fn rows_compute_bandwidths_and_efficiency() {
        let args = BenchArgs {
            backend: crate::backends::Backend::compiled()[0],
            op: OpArg::AllReduce,
            world_size: 4,
            min_bytes: 1,
            max_bytes: 1,
            dtype: DType::F32,
            iters: 1,
            warmup: 0,
            json: true,
            raw_ucx: false,
        };
        let g = Geometry::new(Op::AllReduce, 4, DType::F32, 1_000_000);
        let m = Measured { time: Duration::from_millis(1), wrong: 0 };
        let r = Row::new(args.backend, &g, m, 16e9, &args);
        assert!((r.algbw_gbps - 1.0).abs() < 1e-9);
        assert!((r.busbw_gbps - 1.5).abs() < 1e-9);
        // 8 MB required in 1 ms = 8 GB/s, half of the 16 GB/s memcpy rate.
        assert!((r.efficiency - 0.5).abs() < 1e-9);
        let json: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        for key in ["world_size", "memcpy_gbps", "efficiency", "busbw_gbps", "wrong", "size_bytes"] {
            assert!(json.get(key).is_some(), "{key}");
        }
    }
}
