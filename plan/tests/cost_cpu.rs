//! The cpu device's model: rates by thread count, cache-resident versus
//! streaming element-wise traffic, and the sim communicator's costs.

use chorus_collectives::OpKind;
use chorus_plan::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};
use chorus_plan::cpu_model::{CpuModel, CACHE_BYTES, ONE_THREAD, SIM_BUSBW, SIM_CALL_S, TWO_THREADS};

fn kernel(kind: KernelKind, flops: f64, bytes: f64) -> KernelCost {
    KernelCost::new("k", kind, flops, bytes)
}

#[test]
fn ranks_get_the_threads_chorus_train_gives_them() {
    assert_eq!(CpuModel::for_ranks(1).rates, TWO_THREADS);
    assert_eq!(CpuModel::for_ranks(2).rates, ONE_THREAD);
    // Four ranks on two cores: one thread each at half the speed.
    let four = CpuModel::for_ranks(4).rates;
    assert_eq!(four.gemm_flops_per_s, ONE_THREAD.gemm_flops_per_s / 2.0);
    assert_eq!(four.op_overhead_s, ONE_THREAD.op_overhead_s * 2.0);
    assert_eq!(CpuModel::for_ranks(0), CpuModel::for_ranks(1));
}

#[test]
fn kernels_pay_the_overhead_and_the_slower_of_arithmetic_and_traffic() {
    let m = CpuModel::for_ranks(2);
    let r = ONE_THREAD;
    let gemm = kernel(KernelKind::Gemm, 1e9, 1e3);
    assert_eq!(m.kernel_seconds(&gemm), r.op_overhead_s + 1e9 / r.gemm_flops_per_s);
    let small = kernel(KernelKind::MemoryBound, 0.0, 1e6);
    assert_eq!(m.kernel_seconds(&small), r.op_overhead_s + 1e6 / r.cached_bytes_per_s);
    let big = kernel(KernelKind::MemoryBound, 0.0, 2.0 * CACHE_BYTES);
    assert_eq!(m.kernel_seconds(&big), r.op_overhead_s + 2.0 * CACHE_BYTES / r.memory_bytes_per_s);
    assert_eq!(m.peak_flops(), None);
}

#[test]
fn sim_collectives_cost_a_call_and_their_bytes() {
    let m = CpuModel::for_ranks(2);
    let ag = CollectiveShape { op: OpKind::AllGather, bytes: 1 << 20, ranks: vec![0, 1] };
    assert_eq!(m.collective_seconds(&ag), SIM_CALL_S + 0.5 * (1u64 << 20) as f64 / SIM_BUSBW);
    let alone = CollectiveShape { op: OpKind::AllReduce, bytes: 1 << 20, ranks: vec![0] };
    assert_eq!(m.collective_seconds(&alone), 0.0);
}
