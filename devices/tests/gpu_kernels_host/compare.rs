//! Host arrays of any dtype and how a kernel's result is held against the
//! reference: the cpu device's result (or `half`'s), bit for bit unless a
//! case says otherwise.

use chorus_devices::cpu::{Cpu, CpuBuffer, CpuDevice, CpuStream};
use chorus_devices::{with_element, Buffer, DType, Device, Element, Priority, Stream, View};

use crate::host_build::HostKernels;
use crate::lanes::Launch;

/// A host array of any dtype, 8-byte aligned for the kernels.
#[derive(Clone, Debug)]
pub struct Data {
    pub dtype: DType,
    pub len: usize,
    words: Vec<u64>,
}

impl Data {
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Data {
        let len = bytes.len() / dtype.size();
        let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Data { dtype, len, words }
    }
    pub fn of<T: Element>(values: &[T]) -> Data {
        Data::from_bytes(T::DTYPE, bytemuck::cast_slice(values))
    }
    /// `f` of each of `values`.
    pub fn map<T, U: Element>(values: &[T], f: impl Fn(&T) -> U) -> Data {
        Data::of(&values.iter().map(f).collect::<Vec<U>>())
    }
    /// `values` converted to `dtype` as the cpu device converts (ints saturate).
    pub fn from_f64(dtype: DType, values: &[f64]) -> Data {
        with_element!(dtype, T => Data::map(values, |v| T::from_f64(*v)))
    }
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len * self.dtype.size()]
    }
    pub fn ptr(&self) -> usize {
        self.words.as_ptr() as usize
    }
    pub fn ptr_mut(&mut self) -> usize {
        self.words.as_mut_ptr() as usize
    }
    pub fn get(&self, i: usize) -> f64 {
        let s = self.dtype.size();
        with_element!(self.dtype, T => bytemuck::pod_read_unaligned::<T>(&self.bytes()[i * s..(i + 1) * s]).to_f64())
    }
    pub fn bits(&self, i: usize) -> u64 {
        let s = self.dtype.size();
        let mut b = [0u8; 8];
        b[..s].copy_from_slice(&self.bytes()[i * s..(i + 1) * s]);
        u64::from_le_bytes(b)
    }
    pub fn to_cpu(&self, s: &CpuStream) -> CpuBuffer {
        let b = s.alloc(self.dtype, self.len).unwrap();
        s.copy_from_host(self.bytes(), b.view()).unwrap();
        b
    }
    pub fn from_cpu(s: &CpuStream, b: &CpuBuffer) -> Data {
        Data::from_bytes(b.dtype(), &s.copy_to_host(b.view()).unwrap().wait().unwrap())
    }
}

/// How two results must agree.
#[derive(Clone, Copy, PartialEq)]
pub enum Agree {
    /// Every bit, NaN payloads included.
    Bits,
    /// Every bit, except that any NaN equals any NaN (which operand's
    /// payload an addition keeps is the compiler's choice).
    Value,
    /// Within this relative difference (a different summation order).
    Relative(f64),
}

#[track_caller]
pub fn assert_agree(what: &str, kernel: &Data, cpu: &Data, how: Agree) {
    assert_eq!((kernel.dtype, kernel.len), (cpu.dtype, cpu.len), "{what}");
    for i in 0..kernel.len {
        let (k, c) = (kernel.get(i), cpu.get(i));
        let ok = match how {
            Agree::Bits => kernel.bits(i) == cpu.bits(i),
            Agree::Value => kernel.bits(i) == cpu.bits(i) || (k.is_nan() && c.is_nan()),
            Agree::Relative(r) => (k - c).abs() <= r * c.abs().max(f64::MIN_POSITIVE) || (k.is_nan() && c.is_nan()),
        };
        assert!(ok, "{what}: element {i}: kernel {k:e} ({:#x}), cpu device {c:e} ({:#x})", kernel.bits(i), cpu.bits(i));
    }
}

/// `got` is `expected` bit for bit; `input` names each element's source pattern.
#[track_caller]
pub fn assert_bits(what: &str, input: &[u64], got: &Data, expected: &Data) {
    assert_eq!(got.len, input.len(), "{what}");
    for (i, pattern) in input.iter().enumerate() {
        assert_eq!(got.bits(i), expected.bits(i), "{what} of {pattern:#x}");
    }
}

/// A test's two sides: the host build of the kernels and a stream of the
/// cpu device, the reference.
pub struct Sides {
    pub k: &'static HostKernels,
    _device: CpuDevice,
    pub s: CpuStream,
}

/// Both sides (the host build fails the test without a C++ compiler).
pub fn sides() -> Sides {
    let k = crate::host_build::kernels();
    let device = CpuDevice::with_ordinal(0);
    let s = device.create_stream(Priority::Normal).unwrap();
    Sides { k, _device: device, s }
}

impl Sides {
    /// One kernel against the cpu device: both start from the same
    /// `outputs` (named for the report); the kernel runs as `launch` on host
    /// copies, given their addresses, and `cpu` on the cpu device, given
    /// views of its copies; every output must then agree `how`. Returns
    /// the kernel's outputs.
    #[track_caller]
    pub fn compare<const N: usize>(
        &self,
        what: &str,
        how: Agree,
        launch: Launch,
        outputs: [(&str, &Data); N],
        kernel: impl Fn([usize; N]) + Sync,
        cpu: impl FnOnce([View<'_, Cpu>; N]) -> chorus_devices::Result<()>,
    ) -> [Data; N] {
        let mut host = outputs.map(|(_, d)| d.clone());
        let ptrs = std::array::from_fn(|i| host[i].ptr_mut());
        self.k.launch(launch, || kernel(ptrs));
        let bufs = outputs.map(|(_, d)| d.to_cpu(&self.s));
        cpu(std::array::from_fn(|i| bufs[i].view())).unwrap();
        for (i, (name, _)) in outputs.iter().enumerate() {
            assert_agree(&format!("{what}: {name}"), &host[i], &Data::from_cpu(&self.s, &bufs[i]), how);
        }
        host
    }

    /// `data` on the cpu device.
    pub fn upload(&self, data: &Data) -> CpuBuffer {
        data.to_cpu(&self.s)
    }
}
