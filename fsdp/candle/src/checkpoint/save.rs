//! Saving: every rank writes its shard files into a temporary directory;
//! the first rank then writes the index, the training state and the
//! manifest, and renames the directory into place. The ranks agree after
//! each stage, so a failure on any rank fails the save on all of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{Buffer, ComputeBackend, StreamExt};
use chorus_fsdp::{Fsdp, ShardedOptimizer};

use super::files::{
    f32_bytes, fresh_dir, moment_names, safetensors_bytes, shard_file, state_key, sync_dir, write_index, write_json,
    write_synced, FileEntry, Manifest, TensorEntry, INDEX, LATEST, MANIFEST, TRAINING_STATE,
};
use super::geometry::{unpad, Region};
use super::{optimizer_json, TrainingState, FORMAT};
use crate::crc32::crc32;
use crate::{CheckpointError, Error, Result};

/// Every rank's success or failure, agreed on by all (a collective; blocks).
fn agree<C: CommBackend>(fsdp: &Fsdp<C>, ok: bool) -> Result<bool>
where
    C::B: ComputeBackend,
{
    let s = fsdp.compute_stream();
    let buf = s.buffer_from(&[if ok { 0.0f32 } else { 1.0 }]).map_err(chorus_fsdp::FsdpError::from)?;
    let dp = fsdp.data_parallel();
    dp.shard.all_reduce_in_place(buf.view(), ReduceOp::Sum, s).map_err(chorus_fsdp::FsdpError::from)?;
    if let Some(r) = &dp.replicate {
        r.all_reduce_in_place(buf.view(), ReduceOp::Sum, s).map_err(chorus_fsdp::FsdpError::from)?;
    }
    let v = s.read_vec::<f32>(buf.view()).map_err(chorus_fsdp::FsdpError::from)?;
    Ok(v.first().is_some_and(|x| *x == 0.0))
}

/// Ends a stage of the save on every rank ([`agree`]): `Ok` when it
/// succeeded on all of them; else this rank's own error, or, where its part
/// went well, `elsewhere` (what failed on another rank). `discard`, where
/// given, is removed first: the partial checkpoint the first rank abandons.
fn end_stage<C: CommBackend>(
    fsdp: &Fsdp<C>,
    stage: Result<()>,
    discard: Option<&Path>,
    elsewhere: impl FnOnce() -> String,
) -> Result<()>
where
    C::B: ComputeBackend,
{
    if agree(fsdp, stage.is_ok())? {
        return Ok(());
    }
    if let Some(dir) = discard {
        let _ = std::fs::remove_dir_all(dir);
    }
    Err(stage.err().unwrap_or_else(|| Error::InvalidArgument(elsewhere())))
}

fn is_first_replica<C: CommBackend>(fsdp: &Fsdp<C>) -> bool {
    fsdp.data_parallel().replicate.as_ref().is_none_or(|r| r.rank() == 0)
}

fn is_global_first<C: CommBackend>(fsdp: &Fsdp<C>) -> bool {
    is_first_replica(fsdp) && fsdp.data_parallel().shard.rank() == 0
}

/// Saves this rank's shards and optimizer state, and (on the first rank)
/// the index, the training state and the manifest, as
/// `root/step-{state.step:08}`, then points `root/latest` at it. Every rank
/// must call it (it synchronizes the ranks); returns the checkpoint's
/// directory. See the module docs for the layout and the crash safety.
pub fn save<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    root: &Path,
    state: &TrainingState,
) -> Result<PathBuf>
where
    C::B: ComputeBackend,
{
    let name = format!("step-{:08}", state.step);
    let dest = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}"));
    let first = is_global_first(fsdp);
    // The first rank prepares the temporary directory; the others wait for it.
    let prepared = if first { fresh_dir(&tmp).map_err(Error::from) } else { Ok(()) };
    end_stage(fsdp, prepared, None, || format!("{}: another rank could not prepare the checkpoint", tmp.display()))?;
    // From here a failed stage leaves a partial directory, which the first rank removes.
    let discard = first.then_some(tmp.as_path());
    let written = write_rank_files(fsdp, opt, &tmp);
    end_stage(fsdp, written, discard, || format!("{}: another rank failed to write its shards", tmp.display()))?;
    let finished = if first { finish_save(fsdp, opt, root, &tmp, &dest, &name, state) } else { Ok(()) };
    end_stage(fsdp, finished, discard, || {
        format!("{}: the first rank failed to complete the checkpoint", dest.display())
    })?;
    Ok(dest)
}

/// Writes this rank's shard files into `tmp` (nothing if it is not the first replica).
fn write_rank_files<C: CommBackend>(fsdp: &Fsdp<C>, opt: &ShardedOptimizer<C>, tmp: &Path) -> Result<()>
where
    C::B: ComputeBackend,
{
    if !is_first_replica(fsdp) {
        return Ok(());
    }
    let rank = fsdp.data_parallel().shard.rank();
    let first = rank == 0;
    let names = moment_names(opt.kind());
    let (mut model, mut model_offsets) = (Vec::new(), BTreeMap::new());
    let (mut optim, mut optim_offsets) = (Vec::new(), BTreeMap::new());
    for g in 0..fsdp.num_groups() {
        for (i, (name, shape)) in fsdp.group_params(g)?.into_iter().enumerate() {
            let layout = fsdp.param_layout(g, i)?;
            if layout.is_none() && !first {
                continue; // replicated: the first shard rank writes it whole
            }
            let region = Region::of(&shape, layout.as_ref(), rank);
            if region.numel() == 0 {
                continue; // trailing ranks may hold only padding
            }
            let cut = |v: Vec<f32>| match &layout {
                Some(l) => unpad(&v, l, rank),
                None => v,
            };
            model.push((name.clone(), region.shape.clone(), f32_bytes(&cut(fsdp.read_shard(g, i)?))));
            model_offsets.insert(name.clone(), region.offsets.clone());
            let moments = opt.read_state(fsdp, g, i)?;
            if moments.len() == names.len() && !moments.is_empty() {
                for (m, what) in moments.into_iter().zip(names) {
                    let key = state_key(&name, what);
                    optim.push((key.clone(), region.shape.clone(), f32_bytes(&cut(m))));
                    optim_offsets.insert(key, region.offsets.clone());
                }
                let key = state_key(&name, "step");
                optim.push((key.clone(), vec![], f32_bytes(&[opt.steps() as f32])));
                optim_offsets.insert(key, vec![]);
            }
        }
    }
    for (what, tensors, offsets) in [("model", model, model_offsets), ("optim", optim, optim_offsets)] {
        let path = tmp.join(shard_file(rank, what));
        let bytes = safetensors_bytes(&tensors, Some(&offsets), &path)?;
        write_synced(&path, &bytes)?;
    }
    Ok(())
}

/// The first rank's part: index, training state, manifest with checksums,
/// then the renames.
fn finish_save<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    root: &Path,
    tmp: &Path,
    dest: &Path,
    name: &str,
    state: &TrainingState,
) -> Result<()>
where
    C::B: ComputeBackend,
{
    let mut tensors = Vec::new();
    for g in 0..fsdp.num_groups() {
        for (n, shape) in fsdp.group_params(g)? {
            tensors.push(TensorEntry { name: n, shape, dtype: "F32".into() });
        }
    }
    // The index maps each tensor to the first shard file that holds part of it.
    let mut weight_map = BTreeMap::new();
    let mut entries: Vec<String> = std::fs::read_dir(tmp)
        .map_err(|e| CheckpointError::io(tmp, e))?
        .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
        .collect();
    entries.sort();
    for file in entries.iter().filter(|f| f.contains("-model-")) {
        let path = tmp.join(file);
        let bytes = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let (_, meta) =
            safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| CheckpointError::format(&path, e))?;
        for t in meta.tensors().keys() {
            weight_map.entry(t.clone()).or_insert_with(|| file.clone());
        }
    }
    let total: usize = tensors.iter().map(|t| t.shape.iter().product::<usize>() * 4).sum();
    write_index(tmp, total, &weight_map)?;
    write_json(&tmp.join(TRAINING_STATE), state)?;
    entries.push(INDEX.to_string());
    entries.push(TRAINING_STATE.to_string());
    let mut files = BTreeMap::new();
    for file in &entries {
        let path = tmp.join(file);
        let bytes = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, e))?;
        files.insert(file.clone(), FileEntry { bytes: bytes.len() as u64, crc32: crc32(&bytes) });
    }
    let dp = fsdp.data_parallel();
    let manifest = Manifest {
        format: FORMAT.into(),
        step: state.step,
        shard_world: dp.shard.size(),
        replicate_world: dp.replicate.as_ref().map_or(1, |r| r.size()),
        optimizer: optimizer_json(opt.kind()),
        tensors,
        files,
    };
    write_json(&tmp.join(MANIFEST), &manifest)?;
    sync_dir(tmp)?;
    // Replace an earlier checkpoint of the same step only once the new one is complete.
    if dest.exists() {
        let old = root.join(format!(".old-{name}"));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dest, &old).map_err(|e| CheckpointError::io(dest, e))?;
        std::fs::rename(tmp, dest).map_err(|e| CheckpointError::io(dest, e))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(tmp, dest).map_err(|e| CheckpointError::io(dest, e))?;
    }
    sync_dir(root)?;
    let latest_tmp = root.join(".latest.tmp");
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&latest_tmp, root.join(LATEST)).map_err(|e| CheckpointError::io(root.join(LATEST), e))?;
    sync_dir(root)?;
    Ok(())
}
