//! How long NCCL takes for one collective: its own analytic model, the one
//! NCCL uses to choose an algorithm and a protocol (`src/graph/tuning.cc`),
//! on a two-level topology (NVLink inside a node, one NIC per GPU across
//! nodes).
//!
//! For each algorithm (ring; for all-reduce also tree) and protocol (LL,
//! LL128, Simple) the time is
//!
//! ```text
//! t = latency + bytes_moved / busbw
//! latency = base[algo][proto]
//!         + (steps − inter_steps) · hop_intra[algo][proto] + inter_steps · hop_net[algo][proto]   (ring)
//!         + 2 · ((ppn − 1) · hop_intra + log2(nodes) · hop_net)                                 (tree)
//! ```
//!
//! and NCCL runs the fastest, so the model takes the minimum. `bytes_moved`
//! follows nccl-tests' bus-bandwidth definitions (`doc/PERFORMANCE.md` in
//! NVIDIA/nccl-tests): with `S` the larger of the per-rank input and output
//! buffers (an all-gather's output, a reduce-scatter's input), a ring
//! all-gather or reduce-scatter moves `(n−1)/n · S` per rank, an all-reduce
//! `2(n−1)/n · S`, all-to-all `(n−1)/n · S`, broadcast and reduce `S`.
//! `busbw` is the bottleneck level's: NVLink's inside one node; across nodes
//! the smaller of NVLink's and the NICs', each node reaching the others
//! through as many NICs as the group has GPUs on it (NCCL runs one ring
//! channel per NIC, so a ring crosses each node boundary once per channel).

use chorus_collectives::OpKind;

use crate::cost::CollectiveShape;

/// NCCL's three protocols.
const PROTOCOLS: usize = 3;

/// One algorithm's latencies per protocol (LL, LL128, Simple), in seconds,
/// and the fraction of the link's bus bandwidth each protocol reaches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlgorithmTable {
    /// Fixed cost of a call (`baseLat`).
    pub base: [f64; PROTOCOLS],
    /// Cost of one step over NVLink (`hwLat[NVLINK]`).
    pub hop_nvlink: [f64; PROTOCOLS],
    /// Cost of one step over the network (`hwLat[NET]`).
    pub hop_net: [f64; PROTOCOLS],
    /// Fraction of the bus bandwidth each protocol reaches.
    pub bandwidth_factor: [f64; PROTOCOLS],
}

/// NCCL's ring, from `src/graph/tuning.cc` of NVIDIA/nccl (commit
/// 01afd20a77b5804e0ecf1042509dd9d20ebf9e93): `baseLat` ring {3.6, 10.0,
/// 8.4} µs, `hwLat` NVLink ring {0.47, 1.9, 3.4} µs and network ring {2.7,
/// 4.0, 9.6} µs; LL carries 8 bytes of data per 16 on the wire and runs at
/// a quarter of the bus bandwidth for all-reduce and across nodes (a third
/// otherwise, not modelled: it only matters for messages LL wins anyway),
/// LL128 at 120/128 of it (NCCL's 0.92).
pub const NCCL_RING: AlgorithmTable = AlgorithmTable {
    base: [3.6e-6, 10.0e-6, 8.4e-6],
    hop_nvlink: [0.47e-6, 1.9e-6, 3.4e-6],
    hop_net: [2.7e-6, 4.0e-6, 9.6e-6],
    bandwidth_factor: [0.25, 0.92, 1.0],
};

/// NCCL's tree (all-reduce only), same file: `baseLat` tree {4.4, 4.4, 0}
/// µs, `hwLat` NVLink tree {0.52, 1.2, 28} µs, network tree {5.0, 8.5, 50}
/// µs; bus bandwidth × 0.9, LL a further 1/3.8, LL128 a further 0.915.
pub const NCCL_TREE: AlgorithmTable = AlgorithmTable {
    base: [4.4e-6, 4.4e-6, 0.0],
    hop_nvlink: [0.52e-6, 1.2e-6, 28e-6],
    hop_net: [5.0e-6, 8.5e-6, 50e-6],
    bandwidth_factor: [0.9 / 3.8, 0.9 * 0.915, 0.9],
};

/// The links of one GPU kind's systems.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fabric {
    /// GPUs per node (one NVLink domain).
    pub gpus_per_node: usize,
    /// Bus bandwidth of a ring inside a node, bytes/s (nccl-tests `busbw`).
    pub nvlink_busbw: f64,
    /// One GPU's NIC, bytes/s per direction, as NCCL reaches it.
    pub nic_bytes_per_s: f64,
    /// The ring's latencies and protocol factors.
    pub ring: AlgorithmTable,
    /// The tree's.
    pub tree: AlgorithmTable,
}

/// How a communicator's ranks sit on the nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Ranks.
    pub ranks: usize,
    /// Nodes they span.
    pub nodes: usize,
    /// The fewest of them on one node (the node with the fewest NICs in use bounds the ring).
    pub min_per_node: usize,
    /// The most of them on one node (the tree's chain inside a node).
    pub max_per_node: usize,
}

impl Placement {
    /// Where `ranks` (global ranks, node = rank / `gpus_per_node`) sit.
    pub fn of(ranks: &[usize], gpus_per_node: usize) -> Placement {
        let per = gpus_per_node.max(1);
        let mut nodes: Vec<usize> = ranks.iter().map(|r| r / per).collect();
        nodes.sort_unstable();
        let mut counts = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            if i == 0 || nodes[i - 1] != *n {
                counts.push(0usize);
            }
            if let Some(c) = counts.last_mut() {
                *c += 1;
            }
        }
        Placement {
            ranks: ranks.len(),
            nodes: counts.len(),
            min_per_node: counts.iter().copied().min().unwrap_or(0),
            max_per_node: counts.iter().copied().max().unwrap_or(0),
        }
    }
}

/// Bytes each rank moves over its bottleneck link for `op` on `n` ranks with
/// buffer size `bytes` (nccl-tests' bus-bandwidth factors).
pub fn bytes_moved(op: OpKind, bytes: u64, n: usize) -> f64 {
    let (s, n) = (bytes as f64, n.max(1) as f64);
    match op {
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => s * (n - 1.0) / n,
        OpKind::AllReduce => 2.0 * s * (n - 1.0) / n,
        OpKind::Broadcast | OpKind::Reduce | OpKind::Send | OpKind::Recv => s,
        OpKind::Barrier => 0.0,
    }
}

/// Ring steps and the steps of them that cross nodes (`nsteps`, `nInterSteps`
/// in NCCL's tuning model).
fn ring_steps(op: OpKind, p: &Placement) -> (f64, f64) {
    let (n, nodes) = (p.ranks as f64, p.nodes as f64);
    match op {
        // A barrier is an all-reduce of one element in NCCL.
        OpKind::AllReduce | OpKind::Barrier => (2.0 * (n - 1.0), 2.0 * (nodes - 1.0)),
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => (n - 1.0, nodes - 1.0),
        OpKind::Broadcast | OpKind::Reduce => (n, nodes),
        // Point to point: one hop, over the network if the group spans nodes.
        OpKind::Send | OpKind::Recv => (1.0, if p.nodes > 1 { 1.0 } else { 0.0 }),
    }
}

impl Fabric {
    /// The bottleneck bus bandwidth for a group placed as `p`, bytes/s.
    pub fn busbw(&self, p: &Placement) -> f64 {
        if p.nodes <= 1 {
            return self.nvlink_busbw;
        }
        self.nvlink_busbw.min(p.min_per_node as f64 * self.nic_bytes_per_s)
    }

    /// Seconds for the ring algorithm with the best protocol.
    pub fn ring_seconds(&self, op: OpKind, bytes: u64, p: &Placement) -> f64 {
        let (steps, inter) = ring_steps(op, p);
        let moved = bytes_moved(op, bytes, p.ranks);
        let bw = self.busbw(p);
        (0..PROTOCOLS)
            .map(|k| {
                let t = &self.ring;
                let latency = t.base[k] + (steps - inter) * t.hop_nvlink[k] + inter * t.hop_net[k];
                latency + moved / (bw * t.bandwidth_factor[k])
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Seconds for NCCL's tree all-reduce with the best protocol: a chain
    /// inside each node and a double binary tree across nodes; NCCL counts
    /// its algorithm bandwidth as half the bus bandwidth (`ratio = .5`).
    pub fn tree_all_reduce_seconds(&self, bytes: u64, p: &Placement) -> f64 {
        let depth = (p.nodes.max(1) as f64).log2().ceil();
        let chain = p.max_per_node.saturating_sub(1) as f64;
        let bw = self.busbw(p);
        (0..PROTOCOLS)
            .map(|k| {
                let t = &self.tree;
                let latency = t.base[k] + 2.0 * (chain * t.hop_nvlink[k] + depth * t.hop_net[k]);
                latency + bytes as f64 / (0.5 * bw * t.bandwidth_factor[k])
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Seconds for `shape`: the ring, or for an all-reduce across nodes the
    /// faster of ring and tree, as NCCL's tuner picks. A one-rank
    /// communicator takes no time (nothing crosses a link).
    pub fn collective_seconds(&self, shape: &CollectiveShape) -> f64 {
        if shape.ranks.len() <= 1 {
            return 0.0;
        }
        let p = Placement::of(&shape.ranks, self.gpus_per_node);
        let ring = self.ring_seconds(shape.op, shape.bytes, &p);
        if shape.op == OpKind::AllReduce && p.nodes > 1 {
            ring.min(self.tree_all_reduce_seconds(shape.bytes, &p))
        } else {
            ring
        }
    }
}
