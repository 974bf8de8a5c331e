//! The root state and the param-group state machine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_collectives::{CommBackend, Communicator, ReduceOp};
use chorus_devices::{Backend, Buffer, DType, Device, Priority, Scalar, Stream, StreamExt, View};

use crate::config::{DataParallel, FsdpConfig, MixedPrecision, Reshard};
use crate::layout::{normalize_dim, GroupLayout};
use crate::{FsdpError, Result};

pub(crate) type B<C> = <C as CommBackend>::B;
pub(crate) type Buf<C> = <B<C> as Backend>::Buffer;
pub(crate) type Strm<C> = <B<C> as Backend>::Stream;
pub(crate) type Ev<C> = <B<C> as Backend>::Event;

/// Where a group is in the training step (FSDP2's `TrainingState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainingState {
    /// Between hooks.
    Idle,
    /// Between pre-forward and post-forward.
    Forward,
    /// Between pre-backward and post-backward.
    PreBackward,
    /// After post-backward, until the root finalizes backward.
    PostBackward,
}

/// Where a group's parameters are (FSDP2's `ShardedState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardedState {
    /// Only the shards exist.
    Sharded,
    /// A copy sharded over the smaller post-forward world exists (reshard-after-forward = K).
    ShardedPostForward,
    /// The unsharded parameters exist.
    Unsharded,
}

/// A parameter to put under FSDP: its name, shape and full initial values
/// (every rank passes the same values and keeps its shard).
#[derive(Clone, Debug)]
pub struct ParamInit {
    /// Fully qualified name (`layers.0.weight`).
    pub name: String,
    /// Unsharded shape.
    pub shape: Vec<usize>,
    /// Row-major values of the whole parameter.
    pub values: Vec<f32>,
}

/// Collectives issued, by kind (FSDP's own count; tests also count at the communicator).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommCounts {
    /// All-gathers of parameters.
    pub all_gathers: usize,
    /// Reduce-scatters of gradients.
    pub reduce_scatters: usize,
    /// All-reduces of gradients (HSDP, replicated parameters).
    pub all_reduces: usize,
}

/// Host time spent inside FSDP's hooks (they only enqueue, so this is FSDP's overhead).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostOverhead {
    /// Total time in hooks.
    pub total: Duration,
    /// Number of hook calls.
    pub calls: usize,
}

pub(crate) struct Param<C: CommBackend> {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) numel: usize,
    /// Index into the group layout, or `None` when replicated.
    pub(crate) layout: Option<usize>,
    /// f32 master: the padded shard, or the whole parameter when replicated.
    pub(crate) master: Buf<C>,
    /// f32 gradient of the master, once reduced.
    pub(crate) grad: Option<Buf<C>>,
    unsharded: Option<Buf<C>>,
    unsharded_grad: Option<Buf<C>>,
    /// Accumulated unsharded gradient in the reduce dtype (no-sync micro-batches).
    acc_grad: Option<Buf<C>>,
}

struct AllGatherResult<C: CommBackend> {
    buffer: Buf<C>,
    event: Ev<C>,
    post_forward: bool,
}

pub(crate) struct Group<C: CommBackend> {
    pub(crate) name: String,
    pub(crate) params: Vec<Param<C>>,
    layout: GroupLayout,
    post_forward: Option<(Arc<Communicator<C>>, GroupLayout)>,
    training: TrainingState,
    sharded: ShardedState,
    reshard_after_forward: Reshard,
    reshard_after_backward: bool,
    requires_gradient_sync: bool,
    requires_all_reduce: bool,
    mp: MixedPrecision,
    pending: Option<AllGatherResult<C>>,
    post_forward_buffer: Option<Buf<C>>,
    post_forward_event: Option<Ev<C>>,
    post_reduce_event: Option<Ev<C>>,
    reduce_outputs: Vec<Buf<C>>,
    partial_reduce: Option<Buf<C>>,
    post_forward_indices: Vec<usize>,
    forward_prefetch: Vec<usize>,
    backward_prefetch: Option<Vec<usize>>,
}

/// The four communication streams and the compute stream (FSDP2's comm context).
pub(crate) struct Streams<C: CommBackend> {
    pub(crate) compute: Strm<C>,
    copy_in: Strm<C>,
    all_gather: Strm<C>,
    reduce_scatter: Strm<C>,
    all_reduce: Strm<C>,
}

/// FSDP for one rank: the root state, its groups, streams and policies.
///
/// A model calls, per group and step: [`Fsdp::pre_forward`] /
/// [`Fsdp::post_forward`] around the group's forward (or [`Fsdp::forward`]
/// with a closure), [`Fsdp::pre_backward`] / [`Fsdp::post_backward`] around
/// its backward (or [`Fsdp::backward`]), and once per step
/// [`Fsdp::finalize_backward`]. Model compute goes on
/// [`Fsdp::compute_stream`]; unsharded parameters and gradients are reached
/// with [`Fsdp::param`] and [`Fsdp::grad`] while the group is unsharded.
pub struct Fsdp<C: CommBackend> {
    dp: DataParallel<C>,
    device: <B<C> as Backend>::Device,
    pub(crate) streams: Streams<C>,
    pub(crate) groups: Vec<Group<C>>,
    config: FsdpConfig,
    post_forward_comms: HashMap<usize, Arc<Communicator<C>>>,
    post_forward_order: Vec<usize>,
    all_gather_state: Option<(Buf<C>, Ev<C>)>,
    reduce_scatter_state: Option<(Buf<C>, Ev<C>)>,
    root_ready: bool,
    counts: CommCounts,
    overhead: HostOverhead,
}

/// Handle of an asynchronous unshard; see [`Fsdp::unshard`].
#[derive(Debug)]
#[must_use = "wait on the handle (Fsdp::wait_unshard) before using the parameters"]
pub struct UnshardHandle {
    group: usize,
}

fn state_err<C: CommBackend>(g: &Group<C>, event: &'static str) -> FsdpError {
    FsdpError::State { group: g.name.clone(), event, state: g.training }
}

impl<C: CommBackend> Fsdp<C> {
    /// FSDP over `dp` with `config`; creates the compute stream and the four
    /// communication streams (high priority) on the communicator's device.
    pub fn new(dp: DataParallel<C>, config: FsdpConfig) -> Result<Self> {
        let device = dp.shard.device().clone();
        let mp = config.mixed_precision;
        for d in [Some(mp.param()), Some(mp.reduce()), mp.output_dtype].into_iter().flatten() {
            if !d.is_float() {
                return Err(FsdpError::InvalidArgument(format!("mixed-precision dtypes must be floats, got {d}")));
            }
        }
        let streams = Streams {
            compute: device.create_stream(Priority::Normal)?,
            copy_in: device.create_stream(Priority::High)?,
            all_gather: device.create_stream(Priority::High)?,
            reduce_scatter: device.create_stream(Priority::High)?,
            all_reduce: device.create_stream(Priority::Normal)?,
        };
        Ok(Fsdp {
            dp,
            device,
            streams,
            groups: Vec::new(),
            config,
            post_forward_comms: HashMap::new(),
            post_forward_order: Vec::new(),
            all_gather_state: None,
            reduce_scatter_state: None,
            root_ready: false,
            counts: CommCounts::default(),
            overhead: HostOverhead::default(),
        })
    }

    /// Adds a param group (FSDP2's `fully_shard` on one module). Every rank
    /// must add the same groups in the same order. `is_root` groups do not
    /// reshard after forward (FSDP2's root default). Returns the group's index.
    pub fn add_group(&mut self, name: &str, params: Vec<ParamInit>, is_root: bool) -> Result<usize> {
        let reshard = if is_root { Reshard::No } else { self.config.reshard_after_forward };
        self.add_group_with(name, params, reshard)
    }

    /// Like [`Fsdp::add_group`] with this group's own reshard-after-forward.
    pub fn add_group_with(&mut self, name: &str, params: Vec<ParamInit>, reshard: Reshard) -> Result<usize> {
        let t0 = Instant::now();
        let world = self.dp.shard.size();
        let rank = self.dp.shard.rank();
        let mut sharded_specs = Vec::new();
        let mut is_sharded = Vec::new();
        for p in &params {
            let numel: usize = p.shape.iter().product();
            if p.values.len() != numel {
                return Err(FsdpError::InvalidArgument(format!(
                    "{}: {} values for shape {:?}",
                    p.name,
                    p.values.len(),
                    p.shape
                )));
            }
            let shard = numel >= self.config.replicate_below && !p.shape.is_empty();
            is_sharded.push(shard);
            if shard {
                let dim = match &self.config.shard_placement {
                    Some(f) => f(&p.name, &p.shape),
                    None => 0,
                };
                sharded_specs.push((p.shape.clone(), normalize_dim(dim, p.shape.len())?));
            }
        }
        let layout = GroupLayout::new(&sharded_specs, world)?;
        let post_forward = match reshard {
            Reshard::To(k) if k == world => None,
            Reshard::To(k) => {
                if k == 0 || world % k != 0 {
                    return Err(FsdpError::InvalidArgument(format!(
                        "reshard-after-forward to {k} ranks must divide the shard world of {world}"
                    )));
                }
                let comm = match self.post_forward_comms.get(&k) {
                    Some(c) => c.clone(),
                    None => {
                        let c = self.dp.shard.split(Some((rank / k) as u32), (rank % k) as i64)?.ok_or_else(|| {
                            FsdpError::InvalidArgument("split for the post-forward world returned nothing".into())
                        })?;
                        let c = Arc::new(c);
                        self.post_forward_comms.insert(k, c.clone());
                        c
                    }
                };
                Some((comm, GroupLayout::new(&sharded_specs, k)?))
            }
            _ => None,
        };
        let reshard = match reshard {
            Reshard::To(k) if k == world => Reshard::Yes,
            r => r,
        };
        let stream = &self.streams.compute;
        let mut out = Vec::with_capacity(params.len());
        let mut next = 0;
        for (p, shard) in params.into_iter().zip(is_sharded) {
            let numel = p.values.len();
            let (master, layout_index) = if shard {
                let values = layout.params[next].shard_of(&p.values, rank);
                next += 1;
                (stream.buffer_from(&values)?, Some(next - 1))
            } else {
                (stream.buffer_from(&p.values)?, None)
            };
            out.push(Param {
                name: p.name,
                shape: p.shape,
                numel,
                layout: layout_index,
                master,
                grad: None,
                unsharded: None,
                unsharded_grad: None,
                acc_grad: None,
            });
        }
        self.groups.push(Group {
            name: name.to_string(),
            params: out,
            layout,
            post_forward,
            training: TrainingState::Idle,
            sharded: ShardedState::Sharded,
            reshard_after_forward: reshard,
            reshard_after_backward: true,
            requires_gradient_sync: true,
            requires_all_reduce: true,
            mp: self.config.mixed_precision,
            pending: None,
            post_forward_buffer: None,
            post_forward_event: None,
            post_reduce_event: None,
            reduce_outputs: Vec::new(),
            partial_reduce: None,
            post_forward_indices: Vec::new(),
            forward_prefetch: Vec::new(),
            backward_prefetch: None,
        });
        self.note_overhead(t0);
        Ok(self.groups.len() - 1)
    }

    fn note_overhead(&mut self, t0: Instant) {
        self.overhead.total += t0.elapsed();
        self.overhead.calls += 1;
    }

    fn group(&self, g: usize) -> Result<&Group<C>> {
        self.groups.get(g).ok_or_else(|| FsdpError::InvalidArgument(format!("no group {g}")))
    }

    /// The stream the model computes on.
    pub fn compute_stream(&self) -> &Strm<C> {
        &self.streams.compute
    }
    /// The device.
    pub fn device(&self) -> &<B<C> as Backend>::Device {
        &self.device
    }
    /// The data-parallel layout.
    pub fn data_parallel(&self) -> &DataParallel<C> {
        &self.dp
    }
    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    /// A group's name.
    pub fn group_name(&self, g: usize) -> Result<&str> {
        Ok(&self.group(g)?.name)
    }
    /// Names and shapes of a group's parameters.
    pub fn group_params(&self, g: usize) -> Result<Vec<(String, Vec<usize>)>> {
        Ok(self.group(g)?.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect())
    }
    /// The group's training state.
    pub fn training_state(&self, g: usize) -> Result<TrainingState> {
        Ok(self.group(g)?.training)
    }
    /// The group's sharded state.
    pub fn sharded_state(&self, g: usize) -> Result<ShardedState> {
        Ok(self.group(g)?.sharded)
    }
    /// The group's mixed-precision policy.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.config.mixed_precision
    }
    /// Collectives issued so far.
    pub fn comm_counts(&self) -> CommCounts {
        self.counts
    }
    /// Host time spent in hooks so far.
    pub fn host_overhead(&self) -> HostOverhead {
        self.overhead
    }
    /// Whether parameter `i` of group `g` is replicated (below the threshold).
    pub fn is_replicated(&self, g: usize, i: usize) -> Result<bool> {
        Ok(self.param_ref(g, i)?.layout.is_none())
    }

    fn param_ref(&self, g: usize, i: usize) -> Result<&Param<C>> {
        let grp = self.group(g)?;
        grp.params
            .get(i)
            .ok_or_else(|| FsdpError::InvalidArgument(format!("group `{}` has no parameter {i}", grp.name)))
    }

    /// The unsharded parameter `i` of group `g` (param dtype); an error unless
    /// the group is unsharded.
    pub fn param(&self, g: usize, i: usize) -> Result<View<'_, B<C>>> {
        let p = self.param_ref(g, i)?;
        p.unsharded.as_ref().map(|b| b.view()).ok_or_else(|| state_err(&self.groups[g], "parameter access"))
    }

    /// The unsharded gradient of parameter `i` of group `g` (param dtype),
    /// which the model's backward accumulates into; exists from pre-backward
    /// to post-backward.
    pub fn grad(&self, g: usize, i: usize) -> Result<View<'_, B<C>>> {
        let p = self.param_ref(g, i)?;
        p.unsharded_grad.as_ref().map(|b| b.view()).ok_or_else(|| state_err(&self.groups[g], "gradient access"))
    }

    // ---- switches (FSDPModule's setters) ----

    /// Whether backward reduces gradients (false: accumulate unsharded gradients locally).
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.groups.iter_mut().for_each(|g| g.requires_gradient_sync = sync);
    }
    /// HSDP: whether backward all-reduces over the replicate group (false: keep partial sums).
    pub fn set_requires_all_reduce(&mut self, all_reduce: bool) {
        self.groups.iter_mut().for_each(|g| g.requires_all_reduce = all_reduce);
    }
    /// Whether groups reshard after backward.
    pub fn set_reshard_after_backward(&mut self, reshard: bool) {
        self.groups.iter_mut().for_each(|g| g.reshard_after_backward = reshard);
    }
    /// Groups to unshard (prefetch) when group `g`'s forward starts.
    pub fn set_forward_prefetch(&mut self, g: usize, targets: Vec<usize>) -> Result<()> {
        self.check_targets(&targets)?;
        self.groups.get_mut(g).ok_or_else(|| FsdpError::InvalidArgument(format!("no group {g}")))?.forward_prefetch =
            targets;
        Ok(())
    }
    /// Groups to unshard when group `g`'s backward starts (replaces the default
    /// reverse-post-forward prefetch).
    pub fn set_backward_prefetch(&mut self, g: usize, targets: Vec<usize>) -> Result<()> {
        self.check_targets(&targets)?;
        self.groups.get_mut(g).ok_or_else(|| FsdpError::InvalidArgument(format!("no group {g}")))?.backward_prefetch =
            Some(targets);
        Ok(())
    }
    fn check_targets(&self, targets: &[usize]) -> Result<()> {
        match targets.iter().find(|t| **t >= self.groups.len()) {
            Some(t) => Err(FsdpError::InvalidArgument(format!("no group {t} to prefetch"))),
            None => Ok(()),
        }
    }

    // ---- unshard / reshard ----

    /// All-gathers group `g`'s parameters. With `async_op` the returned
    /// handle must be waited on ([`Fsdp::wait_unshard`]); otherwise this
    /// waits (copy-out enqueued) before returning.
    pub fn unshard(&mut self, g: usize, async_op: bool) -> Result<UnshardHandle> {
        let t0 = Instant::now();
        self.group(g)?;
        if !self.root_ready {
            // Outside a step (FSDP2's explicit `unshard()`), order after the compute stream.
            self.all_gather_streams_follow_compute()?;
        }
        self.issue_all_gather(g)?;
        if !async_op {
            self.wait_for_unshard(g)?;
        }
        self.note_overhead(t0);
        Ok(UnshardHandle { group: g })
    }

    /// Finishes an asynchronous unshard: the copy-out into the unsharded
    /// parameters is enqueued on the compute stream.
    pub fn wait_unshard(&mut self, handle: UnshardHandle) -> Result<()> {
        let t0 = Instant::now();
        self.wait_for_unshard(handle.group)?;
        self.note_overhead(t0);
        Ok(())
    }

    fn issue_all_gather(&mut self, g: usize) -> Result<()> {
        let grp = &mut self.groups[g];
        if grp.pending.is_some() || grp.sharded == ShardedState::Unsharded {
            return Ok(());
        }
        let s = &self.streams;
        if let Some(e) = grp.post_forward_event.take() {
            // The post-forward copy was written on the compute stream.
            s.copy_in.wait(&e)?;
            s.all_gather.wait(&e)?;
        }
        let from_post_forward = grp.sharded == ShardedState::ShardedPostForward;
        let (comm, layout) = match (&grp.post_forward, from_post_forward) {
            (Some((c, l)), true) => (c.clone(), l),
            _ => (self.dp.shard.clone(), &grp.layout),
        };
        if layout.params.is_empty() {
            return Ok(());
        }
        let dtype = grp.mp.param();
        let n = layout.shard_numel;
        let out = s.copy_in.alloc(dtype, comm.size() * n)?;
        let own = out.slice(comm.rank() * n, n)?;
        if from_post_forward {
            let src = grp.post_forward_buffer.as_ref().ok_or_else(|| state_err(grp, "post-forward unshard"))?;
            s.copy_in.copy(src.view(), own)?;
        } else {
            for p in &grp.params {
                if let Some(i) = p.layout {
                    let l = &layout.params[i];
                    cast_or_copy(&s.copy_in, p.master.view(), own.slice(l.offset, l.shard_numel)?)?;
                }
            }
        }
        let copied = self.device.create_event()?;
        s.copy_in.record(&copied)?;
        s.all_gather.wait(&copied)?;
        comm.all_gather_in_place(out.view(), &s.all_gather)?;
        self.counts.all_gathers += 1;
        let event = self.device.create_event()?;
        s.all_gather.record(&event)?;
        grp.pending = Some(AllGatherResult { buffer: out, event, post_forward: from_post_forward });
        Ok(())
    }

    fn wait_for_unshard(&mut self, g: usize) -> Result<()> {
        let s = &self.streams;
        let grp = &mut self.groups[g];
        if grp.sharded == ShardedState::Unsharded {
            return Ok(());
        }
        let pending = grp.pending.take();
        if grp.training == TrainingState::Forward {
            // Implicit prefetch: the previous group's all-gather output is
            // freed only now, after this group's copy-in has been issued.
            if let Some((_, e)) = self.all_gather_state.take() {
                s.copy_in.wait(&e)?;
                s.all_gather.wait(&e)?;
            }
        }
        let dtype = grp.mp.param();
        if let Some(res) = &pending {
            s.compute.wait(&res.event)?;
        }
        let (world, layout) = match (&grp.post_forward, pending.as_ref().is_some_and(|p| p.post_forward)) {
            (Some((c, l)), true) => (c.size(), l),
            _ => (self.dp.shard.size(), &grp.layout),
        };
        for p in grp.params.iter_mut() {
            let full = s.compute.alloc(dtype, p.numel)?;
            match (p.layout, &pending) {
                (Some(i), Some(res)) => {
                    let l = &layout.params[i];
                    for j in 0..world {
                        s.compute.copy_2d(res.buffer.view(), full.view(), l.chunk_to_full(j, layout.shard_numel))?;
                    }
                }
                (None, _) => cast_or_copy(&s.compute, p.master.view(), full.view())?,
                (Some(_), None) => return Err(state_err(grp, "unshard without an all-gather")),
            }
            p.unsharded = Some(full);
        }
        grp.sharded = ShardedState::Unsharded;
        grp.post_forward_buffer = None;
        if let Some(res) = pending {
            let copied_out = self.device.create_event()?;
            s.compute.record(&copied_out)?;
            if grp.training == TrainingState::Forward {
                self.all_gather_state = Some((res.buffer, copied_out));
            } else {
                s.copy_in.wait(&copied_out)?;
                s.all_gather.wait(&copied_out)?;
            }
        }
        Ok(())
    }

    fn reshard(&mut self, g: usize) -> Result<()> {
        let s = &self.streams;
        let grp = &mut self.groups[g];
        if grp.training == TrainingState::Forward {
            match grp.reshard_after_forward {
                Reshard::No => return Ok(()),
                Reshard::To(_) if grp.sharded == ShardedState::Unsharded => {
                    let (comm, layout) =
                        grp.post_forward.as_ref().ok_or_else(|| state_err(grp, "post-forward reshard"))?;
                    let buf = s.compute.alloc(grp.mp.param(), layout.shard_numel)?;
                    s.compute.fill(buf.view(), Scalar::Float(0.0))?;
                    for p in &grp.params {
                        if let (Some(i), Some(full)) = (p.layout, &p.unsharded) {
                            s.compute.copy_2d(
                                full.view(),
                                buf.view(),
                                layout.params[i].full_to_chunk(comm.rank(), 0),
                            )?;
                        }
                    }
                    let e = self.device.create_event()?;
                    s.compute.record(&e)?;
                    grp.post_forward_buffer = Some(buf);
                    grp.post_forward_event = Some(e);
                    grp.params.iter_mut().for_each(|p| p.unsharded = None);
                    grp.sharded = ShardedState::ShardedPostForward;
                    return Ok(());
                }
                _ => {}
            }
        }
        grp.params.iter_mut().for_each(|p| p.unsharded = None);
        grp.post_forward_buffer = None;
        grp.post_forward_event = None;
        grp.sharded = ShardedState::Sharded;
        Ok(())
    }

    // ---- hooks ----

    /// Makes the all-gather streams wait for the compute stream, so copy-ins
    /// see the shards as the optimizer (or the initial upload) left them.
    fn all_gather_streams_follow_compute(&self) -> Result<()> {
        let e = self.device.create_event()?;
        self.streams.compute.record(&e)?;
        self.streams.copy_in.wait(&e)?;
        self.streams.all_gather.wait(&e)?;
        Ok(())
    }

    fn root_pre_forward(&mut self) -> Result<()> {
        if self.root_ready {
            return Ok(());
        }
        self.all_gather_streams_follow_compute()?;
        self.post_forward_order.clear();
        self.root_ready = true;
        Ok(())
    }

    /// Before group `g`'s forward: unshards it (waits for a prefetch if one
    /// was issued) and prefetches the explicit forward targets.
    pub fn pre_forward(&mut self, g: usize) -> Result<()> {
        let t0 = Instant::now();
        let grp = self.group(g)?;
        if grp.training != TrainingState::Idle {
            return Err(state_err(grp, "pre_forward"));
        }
        self.root_pre_forward()?;
        self.groups[g].training = TrainingState::Forward;
        self.issue_all_gather(g)?;
        self.wait_for_unshard(g)?;
        for t in self.groups[g].forward_prefetch.clone() {
            self.issue_all_gather(t)?;
        }
        self.note_overhead(t0);
        Ok(())
    }

    /// After group `g`'s forward: reshards per its policy and records the
    /// post-forward order used for backward prefetch.
    pub fn post_forward(&mut self, g: usize) -> Result<()> {
        let t0 = Instant::now();
        let grp = self.group(g)?;
        if grp.training != TrainingState::Forward {
            return Err(state_err(grp, "post_forward"));
        }
        self.reshard(g)?;
        let index = self.post_forward_order.len();
        self.post_forward_order.push(g);
        let grp = &mut self.groups[g];
        grp.post_forward_indices.push(index);
        grp.training = TrainingState::Idle;
        self.note_overhead(t0);
        Ok(())
    }

    /// Before group `g`'s backward: unshards it, makes zeroed unsharded
    /// gradients if there are none, and prefetches the next group of backward
    /// (the previous one in post-forward order, or the explicit targets).
    pub fn pre_backward(&mut self, g: usize) -> Result<()> {
        let t0 = Instant::now();
        let grp = self.group(g)?;
        match grp.training {
            TrainingState::PreBackward => return Ok(()),
            TrainingState::Idle => {}
            _ => return Err(state_err(grp, "pre_backward")),
        }
        // The last forward all-gather output is not needed in backward.
        if let Some((_, e)) = self.all_gather_state.take() {
            self.streams.copy_in.wait(&e)?;
            self.streams.all_gather.wait(&e)?;
        }
        self.groups[g].training = TrainingState::PreBackward;
        self.issue_all_gather(g)?;
        self.wait_for_unshard(g)?;
        let s = &self.streams;
        let grp = &mut self.groups[g];
        let dtype = grp.mp.param();
        for p in grp.params.iter_mut().filter(|p| p.unsharded_grad.is_none()) {
            let buf = s.compute.alloc(dtype, p.numel)?;
            s.compute.fill(buf.view(), Scalar::Float(0.0))?;
            p.unsharded_grad = Some(buf);
        }
        let targets = match &grp.backward_prefetch {
            Some(t) => t.clone(),
            None => {
                let index = grp.post_forward_indices.pop();
                index
                    .and_then(|i| i.checked_sub(1))
                    .and_then(|i| self.post_forward_order.get(i))
                    .copied()
                    .into_iter()
                    .collect()
            }
        };
        for t in targets {
            self.issue_all_gather(t)?;
        }
        self.note_overhead(t0);
        Ok(())
    }

    /// After group `g`'s backward: reshards (if so configured) and
    /// reduce-scatters its gradients (or accumulates them when gradient sync is off).
    pub fn post_backward(&mut self, g: usize) -> Result<()> {
        let t0 = Instant::now();
        let grp = self.group(g)?;
        if grp.training != TrainingState::PreBackward {
            return Err(state_err(grp, "post_backward"));
        }
        self.groups[g].training = TrainingState::PostBackward;
        self.post_backward_inner(g)?;
        self.note_overhead(t0);
        Ok(())
    }

    fn post_backward_inner(&mut self, g: usize) -> Result<()> {
        let s = &self.streams;
        let grp = &mut self.groups[g];
        let (param_dtype, reduce_dtype) = (grp.mp.param(), grp.mp.reduce());
        // Fold a fresh unsharded gradient into the reduce-dtype accumulator.
        for p in grp.params.iter_mut() {
            if let (Some(acc), Some(fresh)) = (&p.acc_grad, &p.unsharded_grad) {
                s.compute.accumulate(fresh.view(), acc.view())?;
                p.unsharded_grad = None;
            }
        }
        if !grp.requires_gradient_sync {
            if grp.reshard_after_backward {
                self.reshard(g)?;
            }
            let s = &self.streams;
            let grp = &mut self.groups[g];
            if reduce_dtype != param_dtype {
                for p in grp.params.iter_mut().filter(|p| p.acc_grad.is_none()) {
                    if let Some(fresh) = p.unsharded_grad.take() {
                        let acc = s.compute.alloc(reduce_dtype, p.numel)?;
                        s.compute.cast(fresh.view(), acc.view())?;
                        p.acc_grad = Some(acc);
                    }
                }
            }
            return Ok(());
        }
        // Gradients to reduce, in the reduce dtype, taken out of the params.
        let mut grads: Vec<(usize, Buf<C>)> = Vec::new();
        for (i, p) in grp.params.iter_mut().enumerate() {
            let g = match (p.acc_grad.take(), p.unsharded_grad.take()) {
                (Some(acc), _) => acc,
                (None, Some(fresh)) if param_dtype == reduce_dtype => fresh,
                (None, Some(fresh)) => {
                    let cast = s.compute.alloc(reduce_dtype, p.numel)?;
                    s.compute.cast(fresh.view(), cast.view())?;
                    cast
                }
                (None, None) => continue,
            };
            grads.push((i, g));
        }
        if self.groups[g].reshard_after_backward {
            self.reshard(g)?;
        }
        if grads.is_empty() {
            return Ok(());
        }
        self.reduce_gradients(g, grads)
    }

    /// The reduce ops for the shard and replicate groups, and a scale applied afterwards.
    fn reduce_plan(&self) -> (ReduceOp, ReduceOp, Option<f64>) {
        let caps = self.dp.shard.capabilities();
        let dp = self.dp.world_size() as f64;
        match (self.config.force_sum, self.config.divide_factor) {
            (true, f) => (ReduceOp::Sum, ReduceOp::Sum, Some(1.0 / f.unwrap_or(dp))),
            (false, Some(f)) if caps.premul_sum => (ReduceOp::PreMulSum(1.0 / f), ReduceOp::Sum, None),
            (false, Some(f)) => (ReduceOp::Sum, ReduceOp::Sum, Some(1.0 / f)),
            (false, None) if caps.avg => (ReduceOp::Avg, ReduceOp::Avg, None),
            (false, None) => (ReduceOp::Sum, ReduceOp::Sum, Some(1.0 / dp)),
        }
    }

    fn reduce_gradients(&mut self, g: usize, grads: Vec<(usize, Buf<C>)>) -> Result<()> {
        let (shard_op, replicate_op, post_scale) = self.reduce_plan();
        let s = &self.streams;
        // The compute stream waits for the previous reduce-scatter, bounding
        // memory to one reduce-scatter input in flight.
        if let Some((_, e)) = self.reduce_scatter_state.take() {
            s.compute.wait(&e)?;
        }
        let grp = &mut self.groups[g];
        let reduce_dtype = grp.mp.reduce();
        let world = self.dp.shard.size();
        let layout = &grp.layout;
        let n = layout.shard_numel;
        let sharded: Vec<&(usize, Buf<C>)> = grads.iter().filter(|(i, _)| grp.params[*i].layout.is_some()).collect();
        let replicated: Vec<&(usize, Buf<C>)> = grads.iter().filter(|(i, _)| grp.params[*i].layout.is_none()).collect();

        // Pack on the compute stream, where the gradients were produced (FSDP2 does the same).
        let packed = if sharded.is_empty() {
            None
        } else {
            let input = s.compute.alloc(reduce_dtype, world * n)?;
            s.compute.fill(input.view(), Scalar::Float(0.0))?;
            for (i, buf) in &sharded {
                let l = &layout.params[grp.params[*i].layout.unwrap_or_default()];
                for j in 0..world {
                    s.compute.copy_2d(buf.view(), input.view(), l.full_to_chunk(j, j * n))?;
                }
            }
            Some(input)
        };
        let flat_replicated = if replicated.is_empty() {
            None
        } else {
            let total: usize = replicated.iter().map(|(i, _)| grp.params[*i].numel).sum();
            let flat = s.compute.alloc(reduce_dtype, total)?;
            let mut off = 0;
            for (i, buf) in &replicated {
                let m = grp.params[*i].numel;
                s.compute.copy(buf.view(), flat.slice(off, m)?)?;
                off += m;
            }
            Some(flat)
        };
        let grads_ready = self.device.create_event()?;
        s.compute.record(&grads_ready)?;
        s.reduce_scatter.wait(&grads_ready)?;

        let mut outputs: Vec<(Buf<C>, bool)> = Vec::new();
        if let Some(input) = &packed {
            let out = s.reduce_scatter.alloc(reduce_dtype, n)?;
            self.dp.shard.reduce_scatter(input.view(), out.view(), shard_op, &s.reduce_scatter)?;
            self.counts.reduce_scatters += 1;
            outputs.push((out, true));
        }
        if let Some(flat) = &flat_replicated {
            self.dp.shard.all_reduce_in_place(flat.view(), shard_op, &s.reduce_scatter)?;
            self.counts.all_reduces += 1;
        }
        let rs_done = self.device.create_event()?;
        s.reduce_scatter.record(&rs_done)?;

        let mut post = &s.reduce_scatter;
        if let Some(replicate) = &self.dp.replicate {
            if let (Some(partial), Some((out, _))) = (grp.partial_reduce.take(), outputs.first()) {
                s.reduce_scatter.accumulate(partial.view(), out.view())?;
            }
            if !grp.requires_all_reduce {
                // Keep the sharded partial sums; their all-reduce happens on a
                // later backward. Replicated parameters are all-reduced anyway.
                grp.partial_reduce = outputs.pop().map(|(b, _)| b);
            }
            let e = self.device.create_event()?;
            s.reduce_scatter.record(&e)?;
            s.all_reduce.wait(&e)?;
            for (out, _) in &outputs {
                replicate.all_reduce_in_place(out.view(), replicate_op, &s.all_reduce)?;
                self.counts.all_reduces += 1;
            }
            if let Some(flat) = &flat_replicated {
                replicate.all_reduce_in_place(flat.view(), replicate_op, &s.all_reduce)?;
                self.counts.all_reduces += 1;
            }
            post = &s.all_reduce;
        }
        if let Some(f) = post_scale {
            for (out, _) in &outputs {
                post.scale(out.view(), f)?;
            }
            if let Some(flat) = &flat_replicated {
                post.scale(flat.view(), f)?;
            }
        }
        // Views out into the f32 sharded gradients.
        for (out, _) in &outputs {
            for (i, _) in &sharded {
                let p = &mut grp.params[*i];
                let l = &layout.params[p.layout.unwrap_or_default()];
                accumulate_into(post, out.slice(l.offset, l.shard_numel)?, &mut p.grad, l.shard_numel)?;
            }
        }
        if let Some(flat) = &flat_replicated {
            let mut off = 0;
            for (i, _) in &replicated {
                let p = &mut grp.params[*i];
                accumulate_into(post, flat.slice(off, p.numel)?, &mut p.grad, p.numel)?;
                off += p.numel;
            }
        }
        let done = self.device.create_event()?;
        post.record(&done)?;
        grp.post_reduce_event = Some(done);
        // Kept until finalize so their stream-ordered release follows the
        // streams that use them.
        grp.reduce_outputs.extend(outputs.into_iter().map(|(b, _)| b));
        grp.reduce_outputs.extend(flat_replicated);
        self.reduce_scatter_state = packed.map(|b| (b, rs_done));
        Ok(())
    }

    /// The root's end of backward: runs post-backward for groups whose
    /// backward started but did not finish, makes the compute stream wait for
    /// every reduction, and returns every group to idle.
    pub fn finalize_backward(&mut self) -> Result<()> {
        let t0 = Instant::now();
        for g in 0..self.groups.len() {
            if self.groups[g].training == TrainingState::PreBackward {
                self.post_backward(g)?;
            }
        }
        let s = &self.streams;
        for grp in self.groups.iter_mut() {
            if let Some(e) = grp.post_reduce_event.take() {
                s.compute.wait(&e)?;
            }
            grp.reduce_outputs.clear();
            grp.training = TrainingState::Idle;
            grp.post_forward_indices.clear();
        }
        if let Some((_, e)) = self.reduce_scatter_state.take() {
            s.compute.wait(&e)?;
        }
        if let Some((_, e)) = self.all_gather_state.take() {
            s.compute.wait(&e)?;
        }
        self.post_forward_order.clear();
        self.root_ready = false;
        self.note_overhead(t0);
        Ok(())
    }

    /// Runs `body` between [`Fsdp::pre_forward`] and [`Fsdp::post_forward`] of group `g`.
    pub fn forward<T>(&mut self, g: usize, body: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.pre_forward(g)?;
        let out = body(self)?;
        self.post_forward(g)?;
        Ok(out)
    }

    /// Runs `body` between [`Fsdp::pre_backward`] and [`Fsdp::post_backward`] of group `g`.
    pub fn backward<T>(&mut self, g: usize, body: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.pre_backward(g)?;
        let out = body(self)?;
        self.post_backward(g)?;
        Ok(out)
    }

    /// Drops every sharded gradient (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        for p in self.groups.iter_mut().flat_map(|g| g.params.iter_mut()) {
            p.grad = None;
        }
    }

    /// Blocks until all of this rank's FSDP work has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.device.synchronize()?)
    }

    /// Every parameter's full f32 values (padding removed), all-gathered from
    /// the shards; every rank must call it. Blocks.
    pub fn full_parameters(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let s = &self.streams.compute;
        let comm = &self.dp.shard;
        let mut out = Vec::new();
        for grp in &self.groups {
            let n = grp.layout.shard_numel;
            let gathered = if grp.layout.params.is_empty() {
                None
            } else {
                let buf = s.alloc(DType::F32, comm.size() * n)?;
                let own = buf.slice(comm.rank() * n, n)?;
                for p in &grp.params {
                    if let Some(i) = p.layout {
                        let l = &grp.layout.params[i];
                        s.copy(p.master.view(), own.slice(l.offset, l.shard_numel)?)?;
                    }
                }
                comm.all_gather_in_place(buf.view(), s)?;
                Some(buf)
            };
            for p in &grp.params {
                let values = match (p.layout, &gathered) {
                    (Some(i), Some(buf)) => {
                        let full = s.alloc(DType::F32, p.numel)?;
                        let l = &grp.layout.params[i];
                        for j in 0..comm.size() {
                            s.copy_2d(buf.view(), full.view(), l.chunk_to_full(j, n))?;
                        }
                        s.read_vec::<f32>(full.view())?
                    }
                    _ => s.read_vec::<f32>(p.master.view())?,
                };
                out.push((p.name.clone(), values));
            }
        }
        Ok(out)
    }

    /// Mean of a one-element f32 value over the data-parallel world (every
    /// rank must call it); blocks and returns it on every rank.
    pub fn mean_over_ranks(&self, value: View<'_, B<C>>) -> Result<f64> {
        let s = &self.streams.compute;
        let buf = s.alloc(DType::F32, 1)?;
        s.copy(value, buf.view())?;
        self.dp.shard.all_reduce_in_place(buf.view(), ReduceOp::Sum, s)?;
        if let Some(r) = &self.dp.replicate {
            r.all_reduce_in_place(buf.view(), ReduceOp::Sum, s)?;
        }
        let v = s.read_vec::<f32>(buf.view())?;
        Ok(v.first().copied().unwrap_or(0.0) as f64 / self.dp.world_size() as f64)
    }

    pub(crate) fn shard_comm(&self) -> &Arc<Communicator<C>> {
        &self.dp.shard
    }
}

fn cast_or_copy<S: Stream>(s: &S, src: View<'_, S::B>, dst: View<'_, S::B>) -> chorus_devices::Result<()> {
    if src.dtype() == dst.dtype() {
        s.copy(src, dst)
    } else {
        s.cast(src, dst)
    }
}

/// `grad += src` (cast to f32), allocating the f32 gradient on first use.
fn accumulate_into<S: Stream>(
    s: &S,
    src: View<'_, S::B>,
    grad: &mut Option<<S::B as Backend>::Buffer>,
    len: usize,
) -> chorus_devices::Result<()> {
    match grad {
        Some(g) => s.accumulate(src, g.view()),
        None => {
            let g = s.alloc(DType::F32, len)?;
            cast_or_copy(s, src, g.view())?;
            *grad = Some(g);
            Ok(())
        }
    }
}
