//! The trained model written at the end of a run, tensor by tensor: every
//! rank all-gathers one parameter at a time, in the order the output lays
//! them out ([`ModelOutput::order`]), and the writing rank streams each
//! into its file as it arrives ([`write_model`]). No rank ever holds more
//! of the model than its shards, one full parameter and one piece of it.
//!
//! The outputs: the transformer's `model.safetensors` ([`SafetensorsOutput`]),
//! the Llama's Hugging Face directory
//! ([`HfOutput`](crate::models::llama::hf::HfOutput)) and the MLP's `.npy` files
//! ([`NpyOutput`]).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use chorus_collectives::{CommBackend, CommError};
use chorus_devices::{Buffer, ComputeBackend, StreamExt};
use chorus_fsdp::{Fsdp, FsdpError};
use chorus_fsdp_candle::safetensors_io::{Planned, StreamWriter, WriteError, WRITE_BUFFER};

/// Elements per piece a gathered parameter is handed over in (256 KiB of f32).
pub const PIECE: usize = 1 << 16;

/// Where the trained model goes at the end of a run.
pub trait ModelOutput: std::fmt::Debug + Send + Sync {
    /// The parameters, by name, in the order they are written: every rank
    /// gathers them in this order (so it must not depend on the rank).
    fn order(&self) -> Vec<String>;
    /// The writer, on the rank that writes (`None` where this process
    /// writes nothing, e.g. a rank under a launcher other than the first).
    fn open(&self) -> Result<Option<Box<dyn TensorSink>>, WriteError>;
}

/// A model output being written: the values of [`ModelOutput::order`]'s
/// parameters, each row-major, one after the other, in pieces.
pub trait TensorSink {
    /// The next values.
    fn write(&mut self, values: &[f32]) -> Result<(), WriteError>;
    /// Completes the output (every value written; synced).
    fn finish(self: Box<Self>) -> Result<(), WriteError>;
}

/// What [`write_model`] ends with: the writing rank's own failure to write
/// is the inner error there; a collective's failure, and on the other ranks
/// the writing rank's failure to write ([`CommError::Aborted`], naming no
/// file: the writing rank's error does), the outer one.
pub type Written = Result<Result<(), WriteError>, FsdpError>;

/// Writes `output` from the shards of `fsdp`: every rank of the data-parallel
/// world calls it (it gathers each parameter in turn); `writes` says whether
/// this rank writes. A write that fails keeps the gathers going, so the other
/// ranks never wait on this one, and is returned once all are done; then
/// every rank learns whether some rank's write failed, so all stop here
/// together instead of the others going on to their next collective and
/// waiting there for the writing rank until their deadline.
pub fn write_model<C: CommBackend>(fsdp: &Fsdp<C>, writes: bool, output: &dyn ModelOutput) -> Written
where
    C::B: ComputeBackend,
{
    let written = write_here(fsdp, writes, output)?;
    let failed_here = if written.is_err() { 1.0f32 } else { 0.0 };
    let flag = StreamExt::buffer_from(fsdp.compute_stream(), &[failed_here])?;
    // The mean of 0 (written) and 1 (failed): above 0 where any rank failed.
    let failed_anywhere = fsdp.mean_over_ranks(Buffer::view(&flag))? > 0.0;
    match written {
        Ok(()) if failed_anywhere => Err(FsdpError::Comm(CommError::Aborted {
            reason: "the rank writing the trained model could not write it".into(),
        })),
        written => Ok(written),
    }
}

/// This rank's part of [`write_model`]: the gathers, and the writing where
/// `writes`; the inner error is this rank's own failure to write.
fn write_here<C: CommBackend>(fsdp: &Fsdp<C>, writes: bool, output: &dyn ModelOutput) -> Written
where
    C::B: ComputeBackend,
{
    let (mut sink, mut failed) = match writes.then(|| output.open()).transpose() {
        Ok(sink) => (sink.flatten(), None),
        Err(e) => (None, Some(e)),
    };
    for name in output.order() {
        let (g, i) = fsdp
            .find_param(&name)
            .ok_or_else(|| FsdpError::InvalidArgument(format!("the model has no parameter {name}")))?;
        fsdp.gather_param(g, i, PIECE, &mut |piece| {
            if let (Some(s), None) = (sink.as_mut(), &failed) {
                failed = s.write(piece).err();
            }
            Ok(())
        })?;
    }
    Ok(match (sink, failed) {
        (_, Some(e)) => Err(e),
        (Some(s), None) => s.finish(),
        (None, None) => Ok(()),
    })
}

/// One safetensors file of f32 tensors (the transformer's `model.safetensors`).
#[derive(Debug, Clone)]
pub struct SafetensorsOutput {
    /// The file to create (it must not exist); `None` where this process writes nothing.
    pub path: Option<PathBuf>,
    /// The tensors in file order, with their shapes.
    pub tensors: Vec<(String, Vec<usize>)>,
}

impl ModelOutput for SafetensorsOutput {
    fn order(&self) -> Vec<String> {
        self.tensors.iter().map(|(n, _)| n.clone()).collect()
    }
    fn open(&self) -> Result<Option<Box<dyn TensorSink>>, WriteError> {
        let Some(path) = &self.path else { return Ok(None) };
        let plan: Vec<Planned> = self
            .tensors
            .iter()
            .map(|(name, shape)| Planned { name: name.clone(), dtype: safetensors::Dtype::F32, shape: shape.clone() })
            .collect();
        Ok(Some(Box::new(StreamWriter::create(path, &plan, &Default::default())?)))
    }
}

impl TensorSink for StreamWriter {
    fn write(&mut self, values: &[f32]) -> Result<(), WriteError> {
        self.write_f32(values)
    }
    fn finish(self: Box<Self>) -> Result<(), WriteError> {
        StreamWriter::finish(*self).map(|_| ())
    }
}

/// One float32 `.npy` file per parameter, `dir/{name}.npy` (the MLP's output).
#[derive(Debug, Clone)]
pub struct NpyOutput {
    /// The existing directory the files go in; `None` where this process writes nothing.
    pub dir: Option<PathBuf>,
    /// The parameters in order, with their shapes.
    pub tensors: Vec<(String, Vec<usize>)>,
}

impl ModelOutput for NpyOutput {
    fn order(&self) -> Vec<String> {
        self.tensors.iter().map(|(n, _)| n.clone()).collect()
    }
    fn open(&self) -> Result<Option<Box<dyn TensorSink>>, WriteError> {
        let Some(dir) = &self.dir else { return Ok(None) };
        let mut sink = NpySink { dir: dir.clone(), tensors: self.tensors.clone(), next: 0, file: None };
        sink.advance()?;
        Ok(Some(Box::new(sink)))
    }
}

struct NpySink {
    dir: PathBuf,
    tensors: Vec<(String, Vec<usize>)>,
    /// The next tensor to open a file for.
    next: usize,
    /// The file being written, its path and the values it still needs.
    file: Option<(BufWriter<File>, PathBuf, usize)>,
}

fn write_err(path: &Path) -> impl Fn(std::io::Error) -> WriteError + '_ {
    move |source| WriteError { path: path.to_path_buf(), source }
}

impl NpySink {
    /// Finishes the file whose values are complete and opens the next one
    /// (files of empty tensors are written whole on the way).
    fn advance(&mut self) -> Result<(), WriteError> {
        loop {
            match &mut self.file {
                Some((_, _, left)) if *left > 0 => return Ok(()),
                Some(_) => {
                    if let Some((mut f, path, _)) = self.file.take() {
                        f.flush().and_then(|_| f.get_ref().sync_all()).map_err(write_err(&path))?;
                    }
                }
                None => {
                    let Some((name, shape)) = self.tensors.get(self.next) else { return Ok(()) };
                    self.next += 1;
                    let path = self.dir.join(format!("{name}.npy"));
                    let Some(numel) = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d)) else {
                        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("shape {shape:?}"));
                        return Err(WriteError { path, source: e });
                    };
                    let f = std::fs::OpenOptions::new().write(true).create_new(true).open(&path);
                    let mut f = BufWriter::with_capacity(WRITE_BUFFER, f.map_err(write_err(&path))?);
                    f.write_all(&crate::npy::header(shape)).map_err(write_err(&path))?;
                    self.file = Some((f, path, numel));
                }
            }
        }
    }
}

impl TensorSink for NpySink {
    fn write(&mut self, mut values: &[f32]) -> Result<(), WriteError> {
        while !values.is_empty() {
            let Some((f, path, left)) = &mut self.file else {
                let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "more values than the tensors hold");
                return Err(WriteError { path: self.dir.clone(), source: e });
            };
            let take = (*left).min(values.len());
            let bytes: Vec<u8> = values[..take].iter().flat_map(|x| x.to_le_bytes()).collect();
            f.write_all(&bytes).map_err(write_err(path))?;
            *left -= take;
            values = &values[take..];
            self.advance()?;
        }
        Ok(())
    }
    fn finish(self: Box<Self>) -> Result<(), WriteError> {
        if self.file.is_some() || self.next < self.tensors.len() {
            let e = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "fewer values than the tensors hold");
            return Err(WriteError { path: self.dir.clone(), source: e });
        }
        Ok(())
    }
}
