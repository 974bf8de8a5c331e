//! Saving: the first rank draws the save's identity and every rank receives
//! it; every rank writes its shard files into a temporary directory named
//! after it; the first rank then checks that every file is of this save,
//! writes the index, the training state and the manifest, moves the
//! directory into place, points `latest` at it and prunes older checkpoints.
//! The ranks agree after each stage, so a failure on any rank fails the save
//! on all of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{Buffer, ComputeBackend, StreamExt};
use chorus_fsdp::{Fsdp, ShardedOptimizer};

use safetensors::Dtype;

use super::files::{
    fresh_dir, moment_names, new_save_id, replace_dir, save_id_text, shard_file, shard_metadata, state_key, sync_dir,
    write_index, write_json, write_synced, FileEntry, Manifest, StoredState, TensorEntry, INDEX, LATEST, MANIFEST,
    SAVE_ID_KEY, TRAINING_STATE,
};
use super::geometry::{unpad, Region};
use super::{optimizer_json, TrainingState, FORMAT};
use crate::crc32::Crc32;
use crate::safetensors_io::{Planned, StreamWriter, WriteError};
use crate::{CheckpointError, Error, Result};

/// How [`save`] treats the checkpoints already under its root.
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Keep only this many `step-*` checkpoints (the newest, by step) after
    /// each save; `None` keeps all. The one `latest` names and those in
    /// [`keep`](Self::keep) are never removed.
    pub keep_last: Option<usize>,
    /// Checkpoints never pruned (e.g. the one the run resumed from).
    pub keep: Vec<PathBuf>,
}

/// The element-wise sum of `values` over every rank (both mesh dimensions;
/// a collective; blocks).
fn sum_over_ranks<C: CommBackend>(fsdp: &Fsdp<C>, values: &[f32]) -> Result<Vec<f32>>
where
    C::B: ComputeBackend,
{
    let s = fsdp.compute_stream();
    let buf = s.buffer_from(values).map_err(chorus_fsdp::FsdpError::from)?;
    let dp = fsdp.data_parallel();
    dp.shard.all_reduce_in_place(buf.view(), ReduceOp::Sum, s).map_err(chorus_fsdp::FsdpError::from)?;
    if let Some(r) = &dp.replicate {
        r.all_reduce_in_place(buf.view(), ReduceOp::Sum, s).map_err(chorus_fsdp::FsdpError::from)?;
    }
    Ok(s.read_vec::<f32>(buf.view()).map_err(chorus_fsdp::FsdpError::from)?)
}

/// Every rank's success or failure, agreed on by all (a collective; blocks).
fn agree<C: CommBackend>(fsdp: &Fsdp<C>, ok: bool) -> Result<bool>
where
    C::B: ComputeBackend,
{
    let v = sum_over_ranks(fsdp, &[if ok { 0.0f32 } else { 1.0 }])?;
    Ok(v.first().is_some_and(|x| *x == 0.0))
}

/// The save's identity, drawn by the first rank and received by all: four
/// 16-bit pieces, each exact in f32, summed with zeros from the other ranks.
fn shared_save_id<C: CommBackend>(fsdp: &Fsdp<C>, first: bool) -> Result<u64>
where
    C::B: ComputeBackend,
{
    let id = if first { new_save_id() } else { 0 };
    let pieces: Vec<f32> = (0..4).map(|k| ((id >> (16 * k)) & 0xFFFF) as f32).collect();
    let summed = sum_over_ranks(fsdp, &pieces)?;
    Ok(summed.iter().enumerate().fold(0u64, |acc, (k, v)| acc | ((*v as u64 & 0xFFFF) << (16 * k))))
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
/// `root/step-{state.step:08}`, then points `root/latest` at it and prunes
/// as `options` say. Every rank must call it with the same arguments (it
/// synchronizes the ranks); returns the checkpoint's directory. See the
/// module docs for the layout and the crash safety.
pub fn save<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    root: &Path,
    state: &TrainingState,
    options: &SaveOptions,
) -> Result<PathBuf>
where
    C::B: ComputeBackend,
{
    let started = Started::new(fsdp, root, state)?;
    // From here a failed stage leaves a partial directory, which the first rank removes.
    let written = write_rank_files(fsdp, opt, &started.tmp, &started.save_id);
    started.commit(fsdp, opt, written, options)
}

/// A save whose shards are being written by a thread of its own while the
/// training continues ([`save_async`]); [`PendingSave::commit`] makes it a
/// checkpoint. Dropped without a commit, it leaves only its temporary
/// directory, which the next writer's [`recover`](super::recover) removes:
/// `latest` still names the previous checkpoint.
pub struct PendingSave {
    started: Started,
    writer: Option<std::thread::JoinHandle<Result<()>>>,
    staged_bytes: u64,
}

/// What [`save`] and [`save_async`] share: the step's names, the save's
/// identity, its temporary directory (prepared by the first rank), its state.
struct Started {
    root: PathBuf,
    tmp: PathBuf,
    dest: PathBuf,
    name: String,
    save_id: String,
    first: bool,
    state: TrainingState,
}

impl Started {
    /// Draws the save's identity and prepares its temporary directory (a collective).
    fn new<C: CommBackend>(fsdp: &Fsdp<C>, root: &Path, state: &TrainingState) -> Result<Started>
    where
        C::B: ComputeBackend,
    {
        let name = format!("step-{:08}", state.step);
        let dest = root.join(&name);
        let first = is_global_first(fsdp);
        let save_id = save_id_text(shared_save_id(fsdp, first)?);
        let tmp = root.join(format!(".tmp-{name}-{save_id}"));
        // The first rank prepares the temporary directory; the others wait for it.
        let prepared = if first { fresh_dir(&tmp).map_err(Error::from) } else { Ok(()) };
        end_stage(fsdp, prepared, None, || {
            format!("{}: another rank could not prepare the checkpoint", tmp.display())
        })?;
        Ok(Started { root: root.to_path_buf(), tmp, dest, name, save_id, first, state: state.clone() })
    }

    /// Agrees on every rank's files (`written`, this rank's), then the first
    /// rank completes the checkpoint and puts it in place (a collective).
    fn commit<C: CommBackend>(
        self,
        fsdp: &Fsdp<C>,
        opt: &ShardedOptimizer<C>,
        written: Result<()>,
        options: &SaveOptions,
    ) -> Result<PathBuf>
    where
        C::B: ComputeBackend,
    {
        let Started { root, tmp, dest, name, save_id, first, state } = self;
        let discard = first.then_some(tmp.as_path());
        end_stage(fsdp, written, discard, || format!("{}: another rank failed to write its shards", tmp.display()))?;
        let target = Target { root: &root, tmp: &tmp, dest: &dest, name: &name, save_id: &save_id };
        let finished = if first { finish_save(fsdp, opt, &target, &state, options) } else { Ok(()) };
        // A complete new copy whose step is not in place (its replacement failed) is kept for recovery.
        let discard = discard.filter(|tmp| !super::place::is_checkpoint(tmp) || super::place::is_checkpoint(&dest));
        end_stage(fsdp, finished, discard, || {
            format!("{}: the first rank failed to complete the checkpoint", dest.display())
        })?;
        Ok(dest)
    }
}

/// Starts a save that does not hold the step: the save's identity and
/// directory (a collective), then this rank's shards and optimizer state
/// copied to host memory (the step waits for this copy only: its size is
/// [`PendingSave::staged_bytes`], one copy of the rank's share of the
/// training state), which a thread of its own writes while the training
/// goes on. Every rank calls it with the same arguments, then, at the same
/// step, [`PendingSave::commit`]; one save at a time: commit this one before
/// starting another.
pub fn save_async<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    root: &Path,
    state: &TrainingState,
) -> Result<PendingSave>
where
    C::B: ComputeBackend,
{
    let started = Started::new(fsdp, root, state)?;
    let staged = match plan_rank_files(fsdp, opt) {
        Ok(Some(plan)) => {
            let mut pieces = (Vec::new(), Vec::new());
            let read = read_pieces(fsdp, opt, &plan, |file, values| {
                match file {
                    File::Model => pieces.0.push(values),
                    File::Optim => pieces.1.push(values),
                }
                Ok(())
            });
            read.map(|()| Some((plan, pieces)))
        }
        Ok(None) => Ok(None),
        Err(e) => Err(e),
    };
    let staged = match staged {
        Ok(staged) => staged,
        Err(e) => {
            // The others wait at the agreement on the files: fail it there, on every rank.
            return Err(started
                .commit(fsdp, opt, Err(e), &SaveOptions::default())
                .err()
                .unwrap_or_else(|| Error::InvalidArgument("a save whose staging failed was committed".into())));
        }
    };
    let staged_bytes = staged
        .as_ref()
        .map_or(0, |(_, (m, o))| m.iter().chain(o.iter()).map(|v: &Vec<f32>| 4 * v.len() as u64).sum::<u64>());
    let (tmp, save_id) = (started.tmp.clone(), started.save_id.clone());
    let writer = std::thread::Builder::new()
        .name("checkpoint-writer".into())
        .spawn(move || match staged {
            Some((plan, (model, optim))) => {
                let mut files = plan.create(&tmp, &save_id)?;
                for v in model {
                    files.write(File::Model, &v)?;
                }
                for v in optim {
                    files.write(File::Optim, &v)?;
                }
                files.finish()?;
                // The commit's pass over every file, done here, off the step:
                // the first rank reads these notes instead.
                for what in ["model", "optim"] {
                    let name = shard_file(plan.rank, what);
                    let (entry, header) = scan(&tmp.join(&name))?;
                    let note = tmp.join(scan_note(&name));
                    let text = serde_json::to_vec(&ScanNote { entry, header: header.unwrap_or_default() })
                        .map_err(|e| CheckpointError::format(&note, e))?;
                    std::fs::write(&note, text).map_err(|e| CheckpointError::io(&note, e))?;
                }
                Ok(())
            }
            None => Ok(()),
        })
        .map_err(|e| CheckpointError::io(&started.tmp, e))?;
    Ok(PendingSave { started, writer: Some(writer), staged_bytes })
}

impl PendingSave {
    /// Bytes of this rank's training state copied to host memory for the save.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }

    /// The step the save is of.
    pub fn step(&self) -> u64 {
        self.started.state.step
    }

    /// Whether this rank's writer is done (a query; no rank waits).
    pub fn written_here(&self) -> bool {
        self.writer.as_ref().is_none_or(|w| w.is_finished())
    }

    /// Whether every rank's writer is done (a collective: every rank asks
    /// at the same step, and all get the same answer).
    pub fn written_everywhere<C: CommBackend>(&self, fsdp: &Fsdp<C>) -> Result<bool>
    where
        C::B: ComputeBackend,
    {
        agree(fsdp, self.written_here())
    }

    /// Waits for this rank's writer, then completes the checkpoint as
    /// [`save`] does (a collective): returns its directory.
    pub fn commit<C: CommBackend>(
        mut self,
        fsdp: &Fsdp<C>,
        opt: &ShardedOptimizer<C>,
        options: &SaveOptions,
    ) -> Result<PathBuf>
    where
        C::B: ComputeBackend,
    {
        let written = match self.writer.take().map(std::thread::JoinHandle::join) {
            None => Ok(()),
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(Error::InvalidArgument(format!(
                "{}: the thread writing this rank's shards panicked",
                self.started.tmp.display()
            ))),
        };
        self.started.commit(fsdp, opt, written, options)
    }
}

/// Which of a rank's two files a piece goes to.
#[derive(Clone, Copy)]
enum File {
    Model,
    Optim,
}

/// One parameter of a rank's files: where it is, its layout, and whether
/// its optimizer step, its moments and its box are written.
struct Item {
    group: usize,
    index: usize,
    name: String,
    layout: Option<chorus_fsdp::layout::ParamLayout>,
    with_step: bool,
    with_moments: bool,
    with_box: bool,
}

/// What a rank's two files hold, in order (their headers are known before
/// any data: every box's size is).
struct RankFiles {
    rank: usize,
    model: Vec<Planned>,
    model_offsets: BTreeMap<String, Vec<usize>>,
    optim: Vec<Planned>,
    optim_offsets: BTreeMap<String, Vec<usize>>,
    items: Vec<Item>,
}

/// The two files open for writing.
struct OpenFiles {
    model: StreamWriter,
    optim: StreamWriter,
}

impl RankFiles {
    fn create(&self, tmp: &Path, save_id: &str) -> Result<OpenFiles> {
        let create = |what: &str, tensors: &[Planned], offsets: &BTreeMap<String, Vec<usize>>| {
            let path = tmp.join(shard_file(self.rank, what));
            StreamWriter::create(&path, tensors, &shard_metadata(Some(offsets), Some(save_id)))
                .map_err(|e| CheckpointError::io(&e.path, e.source))
        };
        Ok(OpenFiles {
            model: create("model", &self.model, &self.model_offsets)?,
            optim: create("optim", &self.optim, &self.optim_offsets)?,
        })
    }
}

impl OpenFiles {
    fn write(&mut self, file: File, values: &[f32]) -> Result<()> {
        let w = match file {
            File::Model => &mut self.model,
            File::Optim => &mut self.optim,
        };
        w.write_f32(values).map_err(|e: WriteError| CheckpointError::io(&e.path, e.source).into())
    }

    fn finish(self) -> Result<()> {
        for f in [self.model, self.optim] {
            f.finish().map_err(|e| CheckpointError::io(&e.path, e.source))?;
        }
        Ok(())
    }
}

/// What this rank writes (nothing if it is not the first replica).
fn plan_rank_files<C: CommBackend>(fsdp: &Fsdp<C>, opt: &ShardedOptimizer<C>) -> Result<Option<RankFiles>>
where
    C::B: ComputeBackend,
{
    if !is_first_replica(fsdp) {
        return Ok(None);
    }
    let rank = fsdp.data_parallel().shard.rank();
    let first = rank == 0;
    let names = moment_names(opt.kind());
    let mut files = RankFiles {
        rank,
        model: Vec::new(),
        model_offsets: BTreeMap::new(),
        optim: Vec::new(),
        optim_offsets: BTreeMap::new(),
        items: Vec::new(),
    };
    let plan = |name: String, shape: &[usize]| Planned { name, dtype: Dtype::F32, shape: shape.to_vec() };
    for g in 0..fsdp.num_groups() {
        for (i, (name, shape)) in fsdp.group_params(g)?.into_iter().enumerate() {
            let layout = fsdp.param_layout(g, i)?;
            if layout.is_none() && !first {
                continue; // replicated: the first shard rank writes it whole
            }
            let has_state = opt.has_state(g, i) && !names.is_empty();
            // The optimizer's step is the same on every rank (a replicated
            // scalar): written once, by the first shard rank, as PyTorch's
            // saver writes a replicated tensor.
            let with_step = has_state && first;
            if with_step {
                let key = state_key(&name, "step");
                files.optim.push(plan(key.clone(), &[]));
                files.optim_offsets.insert(key, vec![]);
            }
            let region = Region::of(&shape, layout.as_ref(), rank);
            // Trailing ranks may hold only padding.
            let with_box = region.numel() > 0;
            if with_box {
                files.model.push(plan(name.clone(), &region.shape));
                files.model_offsets.insert(name.clone(), region.offsets.clone());
                if has_state {
                    for what in names {
                        let key = state_key(&name, what);
                        files.optim.push(plan(key.clone(), &region.shape));
                        files.optim_offsets.insert(key, region.offsets.clone());
                    }
                }
            }
            files.items.push(Item {
                group: g,
                index: i,
                name,
                layout,
                with_step,
                with_moments: with_box && has_state,
                with_box,
            });
        }
    }
    Ok(Some(files))
}

/// Reads this rank's pieces in the files' order, one parameter at a time,
/// and hands each to `sink` with the file it goes to.
fn read_pieces<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    files: &RankFiles,
    mut sink: impl FnMut(File, Vec<f32>) -> Result<()>,
) -> Result<()>
where
    C::B: ComputeBackend,
{
    let names = moment_names(opt.kind());
    for item in &files.items {
        let cut = |v: Vec<f32>| match &item.layout {
            Some(l) => unpad(&v, l, files.rank),
            None => v,
        };
        if item.with_step {
            sink(File::Optim, vec![opt.steps() as f32])?;
        }
        if item.with_box {
            sink(File::Model, cut(fsdp.read_shard(item.group, item.index)?))?;
        }
        if item.with_moments {
            let moments = opt.read_state(fsdp, item.group, item.index)?;
            if moments.len() != names.len() {
                return Err(Error::InvalidArgument(format!(
                    "{}: {} optimizer moments, the optimizer keeps {}",
                    item.name,
                    moments.len(),
                    names.len()
                )));
            }
            for m in moments {
                sink(File::Optim, cut(m))?;
            }
        }
    }
    Ok(())
}

/// Writes this rank's shard files into `tmp` (nothing if it is not the
/// first replica): both files' headers first (every box's size is known),
/// then each parameter's box and its moments, one parameter at a time, so a
/// blocking save holds one parameter's shard beside the rank's state, never
/// a copy of all of it.
fn write_rank_files<C: CommBackend>(fsdp: &Fsdp<C>, opt: &ShardedOptimizer<C>, tmp: &Path, save_id: &str) -> Result<()>
where
    C::B: ComputeBackend,
{
    let Some(files) = plan_rank_files(fsdp, opt)? else { return Ok(()) };
    let mut open = files.create(tmp, save_id)?;
    read_pieces(fsdp, opt, &files, |file, values| open.write(file, &values))?;
    open.finish()
}

/// One pass over a file of the save: its size and CRC-32, read in pieces,
/// and, for a safetensors file, its header (JSON) — never the whole file
/// in memory, never read twice.
fn scan(path: &Path) -> Result<(FileEntry, Option<serde_json::Map<String, serde_json::Value>>), CheckpointError> {
    use std::io::Read;
    let io = |e| CheckpointError::io(path, e);
    let mut f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let mut crc = Crc32::new();
    let mut header = None;
    if path.extension().is_some_and(|e| e == "safetensors") {
        let mut n = [0u8; 8];
        f.read_exact(&mut n).map_err(|e| CheckpointError::format(path, format!("no safetensors header: {e}")))?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) || n > 100_000_000 {
            return Err(CheckpointError::format(path, format!("a header of {n} bytes in a file of {len}")));
        }
        let mut text = vec![0u8; n as usize];
        f.read_exact(&mut text).map_err(io)?;
        crc.update(&(n).to_le_bytes());
        crc.update(&text);
        header = Some(serde_json::from_slice(&text).map_err(|e| CheckpointError::format(path, e))?);
    }
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let got = f.read(&mut buf).map_err(io)?;
        if got == 0 {
            break;
        }
        crc.update(&buf[..got]);
    }
    Ok((FileEntry { bytes: len, crc32: crc.finish() }, header))
}

/// A file's [`scan`], made by the rank that wrote it (an asynchronous
/// save's writer), for the first rank's commit.
#[derive(serde::Serialize, serde::Deserialize)]
struct ScanNote {
    entry: FileEntry,
    header: serde_json::Map<String, serde_json::Value>,
}

/// The name of `file`'s [`ScanNote`] in the temporary directory.
fn scan_note(file: &str) -> String {
    format!(".scan-{file}.json")
}

/// `path`'s scan: from its writer's note when there is one of this size
/// (then removed: nothing but the checkpoint's files is put in place), else read.
fn scan_or_note(
    path: &Path,
) -> Result<(FileEntry, Option<serde_json::Map<String, serde_json::Value>>), CheckpointError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let note_path = path.with_file_name(scan_note(&name));
    let note = std::fs::read(&note_path).ok().and_then(|b| serde_json::from_slice::<ScanNote>(&b).ok());
    let _ = std::fs::remove_file(&note_path);
    let len = std::fs::metadata(path).map_err(|e| CheckpointError::io(path, e))?.len();
    match note {
        Some(n) if n.entry.bytes == len => Ok((n.entry, Some(n.header))),
        _ => scan(path),
    }
}

/// Where the first rank completes a save.
struct Target<'a> {
    root: &'a Path,
    tmp: &'a Path,
    dest: &'a Path,
    name: &'a str,
    save_id: &'a str,
}

/// The first rank's part: checks every shard file is of this save, writes
/// the index, training state and manifest with checksums, moves the
/// checkpoint into place, points `latest` at it, prunes.
fn finish_save<C: CommBackend>(
    fsdp: &Fsdp<C>,
    opt: &ShardedOptimizer<C>,
    t: &Target<'_>,
    state: &TrainingState,
    options: &SaveOptions,
) -> Result<()>
where
    C::B: ComputeBackend,
{
    let (root, tmp, dest, name) = (t.root, t.tmp, t.dest, t.name);
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
        .filter(|n| !n.starts_with(".scan-"))
        .collect();
    entries.sort();
    let mut files = BTreeMap::new();
    for file in &entries {
        let path = tmp.join(file);
        let (entry, header) = scan_or_note(&path)?;
        let header = header.unwrap_or_default();
        // Only this save's ranks write here (the directory is named after
        // it); a file of another writer is refused, never recorded.
        let recorded = header.get("__metadata__").and_then(|m| m.get(SAVE_ID_KEY)).and_then(|v| v.as_str());
        if recorded != Some(t.save_id) {
            return Err(CheckpointError::Mixed {
                path,
                found: recorded.unwrap_or("none").to_string(),
                expected: t.save_id.to_string(),
            }
            .into());
        }
        if file.contains("-model-") {
            for n in header.keys().filter(|k| k.as_str() != "__metadata__") {
                weight_map.entry(n.clone()).or_insert_with(|| file.clone());
            }
        }
        files.insert(file.clone(), entry);
    }
    let total: usize = tensors.iter().map(|t| t.shape.iter().product::<usize>() * 4).sum();
    write_index(tmp, total, &weight_map, Some(t.save_id))?;
    write_json(&tmp.join(TRAINING_STATE), &StoredState { state: state.clone(), save_id: Some(t.save_id.to_string()) })?;
    for file in [INDEX, TRAINING_STATE] {
        files.insert(file.to_string(), scan(&tmp.join(file))?.0);
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
        save_id: Some(t.save_id.to_string()),
    };
    write_json(&tmp.join(MANIFEST), &manifest)?;
    sync_dir(tmp)?;
    // An earlier checkpoint of the same step is exchanged with the new one in one step.
    replace_dir(tmp, dest, &root.join(format!(".old-{name}-{}", t.save_id)))?;
    sync_dir(root)?;
    let latest_tmp = root.join(format!(".latest.tmp-{}", t.save_id));
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&latest_tmp, root.join(LATEST)).map_err(|e| CheckpointError::io(root.join(LATEST), e))?;
    sync_dir(root)?;
    if let Some(keep_last) = options.keep_last {
        prune(root, keep_last, name, &options.keep, t.save_id)?;
    }
    Ok(())
}

/// The step of a checkpoint directory's name (`step-00000040` → 40).
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-").filter(|d| d.len() == 8 && d.bytes().all(|b| b.is_ascii_digit()))?.parse().ok()
}

/// Removes the `step-*` checkpoints of `root` beyond the `keep_last` newest,
/// never `latest` (the checkpoint just written) nor any of `keep`. Each is
/// renamed away before it is deleted, so a crash never leaves a
/// half-deleted directory that looks like a checkpoint.
fn prune(root: &Path, keep_last: usize, latest: &str, keep: &[PathBuf], save_id: &str) -> Result<()> {
    let canonical = |p: &Path| std::fs::canonicalize(p).ok();
    let kept: Vec<PathBuf> = keep.iter().filter_map(|p| canonical(p)).collect();
    let mut steps: Vec<(u64, String)> = std::fs::read_dir(root)
        .map_err(|e| CheckpointError::io(root, e))?
        .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
        .filter_map(|n| step_of(&n).map(|s| (s, n)))
        .filter(|(_, n)| root.join(n).join(MANIFEST).is_file())
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (_, n) in steps.into_iter().skip(keep_last) {
        let dir = root.join(&n);
        if n == latest || canonical(&dir).is_some_and(|c| kept.contains(&c)) {
            continue;
        }
        let doomed = root.join(format!(".pruned-{n}-{save_id}"));
        std::fs::rename(&dir, &doomed).map_err(|e| CheckpointError::io(&dir, e))?;
        std::fs::remove_dir_all(&doomed).map_err(|e| CheckpointError::io(&doomed, e))?;
    }
    sync_dir(root)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::step_of;

    #[test]
    fn only_checkpoint_names_have_a_step() {
        assert_eq!(step_of("step-00000040"), Some(40));
        for name in ["step-40", "step-0000004x", ".tmp-step-00000040", "step-00000040-old", "latest"] {
            assert_eq!(step_of(name), None, "{name}");
        }
    }
}
