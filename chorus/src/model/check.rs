//! The ranks' initial weights compared before FSDP shards them: ranks that
//! start from different values would train a mix of them with no error
//! (what FSDP1's `sync_module_states` was for).

use candle_core::{DType, Tensor};
use chorus_collectives::CommBackend;

use super::init::fnv1a;
use crate::rank::Rank;
use crate::{Error, Result};

/// A fingerprint of each parameter's f32 values (FNV-1a of their bits).
fn fingerprints(params: &[(String, Tensor)]) -> Result<Vec<i64>> {
    params
        .iter()
        .map(|(_, t)| {
            let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
            Ok(fnv1a(&bytes) as i64)
        })
        .collect()
}

/// Fails on every rank, naming the first parameter that differs and the
/// lowest rank holding other values, unless every rank holds rank 0's
/// values of every parameter. A collective: every rank calls it with its
/// parameters in the same order.
pub(crate) fn same_on_every_rank<C: CommBackend>(rank: &Rank<C>, params: &[(String, Tensor)]) -> Result<()> {
    let mine = fingerprints(params)?;
    // The count first, so ranks with different parameter lists fail here
    // instead of gathering buffers of different lengths.
    let counts = rank.all_gather(&[mine.len() as i64])?;
    if let Some(r) = counts.iter().position(|c| *c != mine.len() as i64) {
        return Err(Error::InvalidArgument(format!(
            "rank {r} has {} parameters and rank {} has {}: every rank must build the same layers",
            counts[r],
            rank.rank(),
            mine.len()
        )));
    }
    let all = rank.all_gather(&mine)?;
    let theirs = |r: usize| &all[r * mine.len()..(r + 1) * mine.len()];
    for (p, (name, _)) in params.iter().enumerate() {
        if let Some(r) = (1..rank.size()).find(|r| theirs(*r)[p] != theirs(0)[p]) {
            return Err(Error::WeightsDiffer { param: name.clone(), rank: r });
        }
    }
    Ok(())
}

/// Every parameter replaced by rank 0's values. A collective.
pub(crate) fn from_rank0<C: CommBackend>(rank: &Rank<C>, params: &mut [(String, Tensor)]) -> Result<()> {
    for (_, t) in params.iter_mut() {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let values = rank.broadcast(&values, 0)?;
        *t = Tensor::from_vec(values, t.shape(), t.device())?.to_dtype(t.dtype())?;
    }
    Ok(())
}
