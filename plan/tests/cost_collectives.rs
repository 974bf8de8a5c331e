//! NCCL's cost model and the GPU kinds against hand computations from the
//! published constants.

use chorus_collectives::OpKind;
use chorus_devices::MemorySpace;
use chorus_plan::cost::{CollectiveShape, CostModel, KernelCost, KernelKind};
use chorus_plan::gpu::{cost_model, gpu_spec, GpuModel};
use chorus_plan::nccl::{Placement, NCCL_RING};

fn shape(op: OpKind, bytes: u64, ranks: impl IntoIterator<Item = usize>) -> CollectiveShape {
    CollectiveShape { op, bytes, ranks: ranks.into_iter().collect() }
}

fn h100(per_node: usize) -> GpuModel {
    GpuModel::new(gpu_spec("h100-sxm").expect("h100-sxm is known"), per_node)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

#[test]
fn an_8_gpu_all_gather_is_the_ring_formula() {
    let gib = 1u64 << 30;
    let t = h100(8).collective_seconds(&shape(OpKind::AllGather, gib, 0..8));
    // Simple protocol: 8.4 µs + 7 NVLink steps of 3.4 µs + 7/8 of 1 GiB at 370 GB/s.
    let expected = 8.4e-6 + 7.0 * 3.4e-6 + 7.0 / 8.0 * gib as f64 / 370e9;
    assert!(close(t, expected), "{t} vs {expected}");
    // All-reduce moves twice as much.
    let ar = h100(8).collective_seconds(&shape(OpKind::AllReduce, gib, 0..8));
    assert!(close(ar, 8.4e-6 + 14.0 * 3.4e-6 + 2.0 * 7.0 / 8.0 * gib as f64 / 370e9));
}

#[test]
fn a_replicate_group_across_nodes_runs_at_one_nic() {
    // HSDP's replicate group: rank 0 of node 0 and rank 0 of node 1.
    let bytes = 1u64 << 30;
    let m = h100(8);
    let t = m.collective_seconds(&shape(OpKind::AllReduce, bytes, [0, 8]));
    let nic = 50e9 * 0.92;
    // Ring: 2 steps, both crossing nodes; 2·(1/2)·S over one NIC.
    let ring = 8.4e-6 + 2.0 * 9.6e-6 + bytes as f64 / nic;
    assert!(close(t, ring), "{t} vs {ring}");
    // FSDP over 2 full nodes: 8 NICs per node, min(NVLink, 8 × NIC).
    let p = Placement::of(&(0..16).collect::<Vec<_>>(), 8);
    assert_eq!((p.nodes, p.min_per_node, p.max_per_node), (2, 8, 8));
    assert_eq!(m.fabric.busbw(&p), 370e9_f64.min(8.0 * nic));
}

#[test]
fn times_grow_with_bytes_and_ranks() {
    let m = h100(8);
    for op in [OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce] {
        let mut last = 0.0;
        for bytes in [1u64 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 30] {
            let t = m.collective_seconds(&shape(op, bytes, 0..64));
            assert!(t > last, "{op:?} {bytes}");
            last = t;
        }
        let mut last = 0.0;
        for n in [2usize, 4, 8, 16, 64, 256] {
            let t = m.collective_seconds(&shape(op, 1 << 26, 0..n));
            assert!(t > last, "{op:?} {n} ranks");
            last = t;
        }
    }
}

#[test]
fn small_messages_pay_the_latency_floor_and_trees_win_at_scale() {
    let m = h100(8);
    // One element over 8 GPUs: LL's 3.6 µs + 7 × 0.47 µs, about 7 µs.
    let t = m.collective_seconds(&shape(OpKind::AllGather, 8, 0..8));
    let ll = NCCL_RING.base[0] + 7.0 * NCCL_RING.hop_nvlink[0];
    assert!(t >= ll && t < ll * 1.01, "{t} vs {ll}");
    // A small all-reduce over 64 nodes: the tree's log2(64) network steps
    // beat the ring's 126.
    let ranks: Vec<usize> = (0..512).collect();
    let p = Placement::of(&ranks, 8);
    let ring = m.fabric.ring_seconds(OpKind::AllReduce, 4096, &p);
    let tree = m.fabric.tree_all_reduce_seconds(4096, &p);
    assert!(tree < ring);
    assert_eq!(m.collective_seconds(&shape(OpKind::AllReduce, 4096, ranks)), tree);
    assert_eq!(m.collective_seconds(&shape(OpKind::AllReduce, 1 << 30, [3])), 0.0);
}

#[test]
fn gpu_kinds_price_kernels_from_their_constants() {
    let m = cost_model("h100-sxm", 8).expect("known");
    assert_eq!(m.peak_flops(), Some(989e12));
    let gemm = KernelCost::new("mm", KernelKind::Gemm, 1e15, 1e6);
    // Every kernel's roofline time is divided by eager PyTorch's efficiency.
    let eager = chorus_plan::gpu::EAGER_EFFICIENCY;
    assert!(close(m.kernel_seconds(&gemm), 1e15 / (989e12 * 0.801) / eager));
    // Causal attention does half the counted FLOPs, at FlashAttention-2's 35 %.
    let attn = KernelCost { kind: KernelKind::Attention, ..gemm.clone() };
    assert!(close(m.kernel_seconds(&attn), 0.5e15 / (989e12 * 0.35) / eager));
    let copy = KernelCost { kind: KernelKind::MemoryBound, flops: 0.0, bytes: 3.35e9 * 0.9, ..gemm.clone() };
    assert!(close(m.kernel_seconds(&copy), 1e-3 / eager));
    // PCIe Gen5 x16 for host copies.
    assert!(close(
        m.copy_seconds(1 << 30, MemorySpace::Host, MemorySpace::Device),
        (1u64 << 30) as f64 / (63e9 * 0.85)
    ));
    // The 500 W part: the clock interpolated between NVL (400 W) and SXM (700 W).
    let capped = gpu_spec("h100-sxm-500w").expect("known");
    assert!(close(capped.clocked_flops, 835.5e12 + (989e12 - 835.5e12) / 3.0));
    assert_eq!(capped.peak_flops, 989e12);
    assert_eq!(capped.hbm_bytes_per_s, 2.4e12);
    for kind in ["h200", "a100-80gb", "cpu", "h100-sxm-500w"] {
        assert!(cost_model(kind, 8).is_ok(), "{kind}");
    }
    assert_eq!(cost_model("cpu", 8).expect("cpu").peak_flops(), None);
}

#[test]
fn bad_kinds_and_node_sizes_are_errors() {
    let e = cost_model("v100", 8).expect_err("unknown kind");
    assert!(e.contains("h100-sxm") && e.contains("v100"), "{e}");
    assert!(cost_model("h100-sxm", 0).is_err());
}
