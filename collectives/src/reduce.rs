//! Reduction operators.

use std::fmt;

/// How `all_reduce`, `reduce` and `reduce_scatter` combine the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Sum divided by the number of ranks (integer division for integer dtypes).
    Avg,
    /// Each rank multiplies its input by its own scalar, then the results are
    /// summed (NCCL's `ncclRedOpCreatePreMulSum`). The scalar is converted to
    /// the buffer's dtype as NCCL does.
    PreMulSum(f64),
}

impl ReduceOp {
    /// The operators without a parameter, and a pre-multiplied sum by 0.5 (exact in every float dtype).
    pub const ALL: [ReduceOp; 6] =
        [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg, ReduceOp::PreMulSum(0.5)];

    /// The operator's name without its parameter.
    pub fn name(&self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premul_sum",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PreMulSum(s) => write!(f, "premul_sum({s})"),
            other => f.write_str(other.name()),
        }
    }
}
