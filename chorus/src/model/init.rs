//! Initial weights that are the same on every rank by construction:
//! candle_nn's initialisers ([`Init`]) drawn from a seed instead of
//! candle's CPU generator, which cannot be seeded.
//!
//! Each value is a function of the seed, the parameter's full name and its
//! index only, so the order in which layers are built does not matter and
//! a one-process candle model built from the same seed
//! ([`SeededVars::var_builder`]) starts from the same weights as its
//! sharded copy.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use chorus_fsdp_candle::rng::mix;

/// Where a model's initial weights come from.
#[derive(Clone)]
pub(crate) enum Source {
    /// candle_nn's initialisers, drawn from a seed.
    Seed(u64),
    /// A caller's [`VarBuilder`] (loaded weights, a `VarMap`).
    Given(VarBuilder<'static>),
}

/// Variables made through a [`VarBuilder`] with seeded initial values, kept
/// in the order they were made: a one-process model trained with candle's
/// own optimizers ([`SeededVars::all_vars`]) to compare with a sharded one.
///
/// ```
/// use chorus::candle_nn::{linear, Module};
/// use chorus::candle_core::{DType, Device, Tensor};
/// use chorus::model::SeededVars;
///
/// let vars = SeededVars::new(7);
/// let layer = linear(4, 2, vars.var_builder(DType::F32, &Device::Cpu).pp("l0"))?;
/// let again = linear(4, 2, SeededVars::new(7).var_builder(DType::F32, &Device::Cpu).pp("l0"))?;
/// assert_eq!(layer.weight().to_vec2::<f32>()?, again.weight().to_vec2::<f32>()?);
/// assert_eq!(vars.all_vars().len(), 2); // weight and bias
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Clone)]
pub struct SeededVars {
    recorder: Arc<Recorder>,
}

impl std::fmt::Debug for SeededVars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SeededVars({} variables)", self.recorder.len())
    }
}

impl SeededVars {
    /// Variables drawn from `seed`.
    pub fn new(seed: u64) -> SeededVars {
        SeededVars { recorder: Recorder::new(Source::Seed(seed)) }
    }

    /// A [`VarBuilder`] whose every new name gets a variable of seeded values
    /// (asked again, a name gets the same variable).
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(RecorderBackend(self.recorder.clone())), dtype, device.clone())
    }

    /// Every variable made so far, in the order made (for candle's optimizers).
    pub fn all_vars(&self) -> Vec<Var> {
        self.recorder.made().into_iter().map(|(_, v)| v).collect()
    }

    /// Every variable made so far with its full name, in the order made.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        self.recorder.made()
    }
}

/// Records the variables a [`VarBuilder`] makes, with their values from a [`Source`].
pub(crate) struct Recorder {
    source: Source,
    made: Mutex<Vec<(String, Var)>>,
}

impl Recorder {
    pub(crate) fn new(source: Source) -> Arc<Recorder> {
        Arc::new(Recorder { source, made: Mutex::new(Vec::new()) })
    }

    /// A builder recording into `self`, in f32 on the CPU (FSDP's masters).
    pub(crate) fn var_builder(self: &Arc<Self>) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(RecorderBackend(self.clone())), DType::F32, Device::Cpu)
    }

    pub(crate) fn made(&self) -> Vec<(String, Var)> {
        self.made.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn len(&self) -> usize {
        self.made.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn get(&self, shape: Shape, name: &str, init: Init, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, var)) = made.iter().find(|(n, _)| n == name) {
            if var.shape() != &shape {
                candle_core::bail!("`{name}` was made with shape {:?}, now asked for with {shape:?}", var.shape());
            }
            return var.as_tensor().to_dtype(dtype)?.to_device(device);
        }
        let values = match &self.source {
            Source::Seed(seed) => Tensor::from_vec(draw(*seed, name, &shape, init), shape, &Device::Cpu)?,
            Source::Given(vb) => vb.get_with_hints_dtype(shape, name, init, DType::F32)?.to_device(&Device::Cpu)?,
        };
        let var = Var::from_tensor(&values.to_dtype(dtype)?.to_device(device)?)?;
        made.push((name.to_string(), var.clone()));
        Ok(var.as_tensor().clone())
    }
}

struct RecorderBackend(Arc<Recorder>);

impl SimpleBackend for RecorderBackend {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match &self.0.source {
            Source::Given(vb) => vb.get_unchecked_dtype(name, dtype)?.to_device(dev),
            Source::Seed(_) => candle_core::bail!(
                "`{name}` asked for without a shape: seeded weights are made only with their shape and initialiser"
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        match &self.0.source {
            Source::Given(vb) => vb.contains_tensor(name),
            Source::Seed(_) => false,
        }
    }
}

/// The values of parameter `name` of `shape` as `init` draws them from `seed`.
fn draw(seed: u64, name: &str, shape: &Shape, init: Init) -> Vec<f32> {
    let key = mix(seed ^ fnv1a(name.as_bytes()));
    let n = shape.elem_count();
    // A uniform in (0, 1] from the i-th draw of this parameter.
    let unit = |i: u64| ((mix(key.wrapping_add(i)) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let uniform = |lo: f64, up: f64| (0..n as u64).map(|i| (lo + (up - lo) * unit(i)) as f32).collect::<Vec<_>>();
    // Box–Muller on two draws per element.
    let normal = |mean: f64, std: f64| {
        (0..n as u64)
            .map(|i| {
                let (u1, u2) = (unit(2 * i), unit(2 * i + 1));
                (mean + std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect::<Vec<_>>()
    };
    match init {
        Init::Const(c) => vec![c as f32; n],
        Init::Uniform { lo, up } => uniform(lo, up),
        Init::Randn { mean, stdev } => normal(mean, stdev),
        // candle_nn's own formula (`Init::var`): std = gain / √fan.
        Init::Kaiming { dist, fan, non_linearity } => {
            let std = non_linearity.gain() / (fan.for_shape(shape).max(1) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => uniform(-(3f64.sqrt()) * std, 3f64.sqrt() * std),
                NormalOrUniform::Normal => normal(0.0, std),
            }
        }
    }
}

/// FNV-1a, 64 bits: a parameter's name (and a value's bits) as a number.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The draws have the moments candle_nn's initialisers ask for.
    #[test]
    fn seeded_draws_have_the_initialisers_moments() {
        let shape = Shape::from((256, 256));
        let moments = |v: &[f32]| {
            let n = v.len() as f64;
            let mean = v.iter().map(|x| *x as f64).sum::<f64>() / n;
            (mean, (v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt())
        };
        let (m, s) = moments(&draw(1, "w", &shape, Init::Randn { mean: 0.5, stdev: 2.0 }));
        assert!((m - 0.5).abs() < 0.02 && (s - 2.0).abs() < 0.02, "{m} {s}");
        let u = draw(1, "w", &shape, Init::Uniform { lo: -1.0, up: 3.0 });
        assert!(u.iter().all(|x| (-1.0..=3.0).contains(x)));
        let (m, s) = moments(&u);
        assert!((m - 1.0).abs() < 0.02 && (s - 4.0 / 12f64.sqrt()).abs() < 0.02, "{m} {s}");
        // Kaiming normal with fan-in 256 and ReLU's gain: std √2 / 16.
        let (_, s) = moments(&draw(1, "w", &shape, candle_nn::init::DEFAULT_KAIMING_NORMAL));
        assert!((s - 2f64.sqrt() / 16.0).abs() < 0.002, "{s}");
        assert_eq!(draw(1, "w", &Shape::from(3), Init::Const(0.25)), vec![0.25; 3]);
    }

    /// Values depend on the seed and the name, not on anything else.
    #[test]
    fn a_seed_and_a_name_give_the_same_values_and_others_differ() {
        let shape = Shape::from(64);
        let init = Init::Randn { mean: 0.0, stdev: 1.0 };
        assert_eq!(draw(3, "a.weight", &shape, init), draw(3, "a.weight", &shape, init));
        assert_ne!(draw(3, "a.weight", &shape, init), draw(4, "a.weight", &shape, init));
        assert_ne!(draw(3, "a.weight", &shape, init), draw(3, "b.weight", &shape, init));
    }
}
