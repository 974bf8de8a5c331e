//! What `chorus bench` prints: one [`Row`] per collective and size, as a
//! table line (nccl-tests' columns and chorus's efficiency) or a JSON
//! object, and the totals of a [`Table`].

use std::io::Write;

use serde::Serialize;

use super::args::BenchArgs;
use super::geometry::{Geometry, Measured};
use super::op::Op;
use crate::backends::Backend;

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
    pub(super) fn new(backend: Backend, g: &Geometry, m: Measured, memcpy_rate: f64, args: &BenchArgs) -> Row {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use chorus_devices::DType;

    use super::super::args::OpArg;
    use super::*;

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
