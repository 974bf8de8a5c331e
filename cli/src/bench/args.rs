//! The arguments of `chorus bench` and their checks: the collectives and
//! sizes asked for, whole elements in every size, and buffers the host can
//! hold.

use std::io::Write;

use chorus_devices::DType;
use clap::{Args, ValueEnum};

use super::geometry::Geometry;
use super::op::Op;
use crate::backends::{parse_backend, Backend};
use crate::conformance::parse_world_size;
use crate::size::{format_bytes, parse_nonzero_bytes};
use crate::UsageError;

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
    /// The operations this value names.
    pub(super) fn ops(self) -> Vec<Op> {
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
pub(super) fn check_sizes(args: &BenchArgs) -> Result<(), UsageError> {
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

/// Refuses sizes whose buffers the machine cannot hold, before anything is
/// allocated: the ranks whose buffers live in this host's memory (all of
/// them for sim and simnccl, this node's for ucx) each hold a send and a
/// receive buffer of the largest size, and the memcpy reference as much
/// again (budgeted as 3 × ranks × the largest size). GPU backends allocate
/// on their devices and are not checked here.
pub(super) fn check_host_memory(args: &BenchArgs) -> anyhow::Result<()> {
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn sizes_double_from_min_to_max() {
        assert_eq!(sizes(1024, 8192), vec![1024, 2048, 4096, 8192]);
        assert_eq!(sizes(1000, 5000), vec![1000, 2000, 4000]);
        assert_eq!(sizes(16 << 20, 16 << 20), vec![16 << 20]);
    }

    pub(in crate::bench) fn args(
        op: OpArg,
        world_size: usize,
        min_bytes: u64,
        max_bytes: u64,
        dtype: DType,
    ) -> BenchArgs {
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
}
