//! The communicators the FSDP cases train on: the world under test split
//! (FSDP keeps its communicators, so the world's own sequence stays in
//! step), plain or wrapped so its calls are counted ([`super::counting`]).

use std::sync::Arc;

use anyhow::anyhow;
use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::ComputeBackend;

use super::counting::{Counting, Counts};
use crate::{Failure, RankCtx};

/// A communicator of the whole world that FSDP can own: split from the one under test.
pub(super) fn own_world<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<Arc<Communicator<C>>, Failure>
where
    C::B: ComputeBackend,
{
    let c = ctx.comm.split(Some(0), ctx.rank() as i64)?.ok_or_else(|| anyhow!("split returned no communicator"))?;
    Ok(Arc::new(c))
}

/// The world, split and wrapped so its calls are counted.
pub(super) type CountedWorld<C> = Arc<Communicator<Counting<C>>>;

pub(super) fn counted<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(CountedWorld<C>, Counts), Failure>
where
    C::B: ComputeBackend,
{
    let counts = Counts::default();
    let comm = ctx.comm.split(Some(0), ctx.rank() as i64)?.ok_or_else(|| anyhow!("split returned no communicator"))?;
    Ok((Arc::new(Communicator::new(Counting::new(comm.into_backend(), counts.clone()))), counts))
}
