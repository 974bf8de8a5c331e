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

mod args;
mod geometry;
mod memcpy;
mod op;
mod pattern;
mod process;
mod rank;
#[cfg(feature = "sim")]
mod sim;
mod table;
mod timing;
mod vendor;

use std::io::Write;

pub use args::BenchArgs;
use args::{check_host_memory, check_sizes, print_rounding_note, sizes};
use geometry::{Geometry, Measured};
use table::{Row, Table};

use crate::backends::Backend;
use crate::size::format_bytes;
use crate::{Outcome, UsageError};

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

#[cfg(test)]
mod tests {
    use chorus_devices::DType;

    use super::args::{tests::args, OpArg};
    use super::*;

    #[test]
    fn raw_ucx_without_the_ucx_backend_is_a_usage_error() {
        let mut a = args(OpArg::AllReduce, 2, 4096, 4096, DType::F32);
        a.backend = crate::backends::Backend::Sim;
        a.raw_ucx = true;
        let e = run(&a).unwrap_err();
        let usage = e.downcast_ref::<UsageError>().unwrap_or_else(|| panic!("not a usage error: {e}"));
        assert!(usage.0.contains("--raw-ucx"), "{usage}");
    }
}
