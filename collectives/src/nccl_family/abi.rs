//! The NCCL ABI shared by NCCL and RCCL: plain Rust, no vendor types.
//!
//! RCCL is a port of NCCL and keeps its C ABI: the same `ncclDataType_t`,
//! `ncclRedOp_t` and `ncclResult_t` values, the same version encoding and the
//! same 128-byte unique id. Both the `nccl` and the `rccl` backend build their
//! calls from these definitions, so the two cannot drift apart, and this
//! module compiles without either library or feature.
//!
//! Everything here is a value the C library reads or writes. Raw values are
//! kept as `i32` at the boundary (never as a Rust enum received from C): a
//! library may return a code this crate does not know, and NCCL's reduce-op
//! handle of a pre-multiplied sum is a run-time value beyond the enum.
//!
//! # Stability
//! Every library of the family depends on these names; add to this module,
//! never rename or change a value.

use std::fmt;

use chorus_devices::DType;

use crate::{CommError, ReduceOp};

/// `NCCL_UNIQUE_ID_BYTES`: the size of a unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: the rendezvous token rank 0 creates (`ncclGetUniqueId`)
/// and every rank passes to `ncclCommInitRank*`. Same layout as the C struct
/// (`char internal[128]`), so a pointer to it can be passed to the library.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    /// The opaque bytes.
    pub internal: [u8; UNIQUE_ID_BYTES],
}

impl UniqueId {
    /// An id from its bytes.
    pub const fn from_bytes(internal: [u8; UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId { internal }
    }

    /// An id from a slice that must be exactly [`UNIQUE_ID_BYTES`] long (as
    /// read back from a store).
    pub fn from_slice(bytes: &[u8]) -> Result<UniqueId, CommError> {
        let internal: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            CommError::invalid("UniqueId", format!("a unique id has {UNIQUE_ID_BYTES} bytes, got {}", bytes.len()))
        })?;
        Ok(UniqueId { internal })
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.internal
    }

    /// Lower-case hex (256 characters), for environment variables and logs.
    pub fn to_hex(&self) -> String {
        self.internal.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`UniqueId::to_hex`]'s output.
    pub fn from_hex(hex: &str) -> Result<UniqueId, CommError> {
        let bad = || CommError::invalid("UniqueId", format!("expected {} hex digits", 2 * UNIQUE_ID_BYTES));
        if hex.len() != 2 * UNIQUE_ID_BYTES || !hex.is_ascii() {
            return Err(bad());
        }
        let mut internal = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in internal.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(UniqueId { internal })
    }

    /// A short fingerprint (FNV-1a of the bytes), for logs: two ranks with
    /// different fingerprints were given different ids.
    pub fn fingerprint(&self) -> u64 {
        self.internal.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({:016x})", self.fingerprint())
    }
}

/// `ncclDataType_t` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DataType {
    /// `ncclInt8` (`ncclChar`).
    Int8 = 0,
    /// `ncclUint8`.
    Uint8 = 1,
    /// `ncclInt32` (`ncclInt`).
    Int32 = 2,
    /// `ncclUint32`.
    Uint32 = 3,
    /// `ncclInt64`.
    Int64 = 4,
    /// `ncclUint64`.
    Uint64 = 5,
    /// `ncclFloat16` (`ncclHalf`).
    Float16 = 6,
    /// `ncclFloat32` (`ncclFloat`).
    Float32 = 7,
    /// `ncclFloat64` (`ncclDouble`).
    Float64 = 8,
    /// `ncclBfloat16` (NCCL 2.10+, RCCL).
    Bfloat16 = 9,
    /// `ncclFloat8e4m3` (NCCL 2.24+ on sm_90+; RCCL's `ncclFp8E4M3`).
    Float8E4M3 = 10,
    /// `ncclFloat8e5m2` (NCCL 2.24+ on sm_90+; RCCL's `ncclFp8E5M2`).
    Float8E5M2 = 11,
}

impl DataType {
    /// The NCCL type of a chorus dtype (every dtype has one). Float8 travels
    /// as bytes: it is only ever moved (reductions of it are refused before
    /// a backend sees them), and `ncclUint8` exists in every NCCL and RCCL,
    /// where `ncclFloat8e4m3` needs NCCL 2.24 on sm_90.
    pub const fn of(dtype: DType) -> DataType {
        match dtype {
            DType::F32 => DataType::Float32,
            DType::F64 => DataType::Float64,
            DType::F16 => DataType::Float16,
            DType::BF16 => DataType::Bfloat16,
            DType::I32 => DataType::Int32,
            DType::I64 => DataType::Int64,
            DType::I8 => DataType::Int8,
            DType::U8 | DType::F8E4M3 => DataType::Uint8,
        }
    }

    /// The C value.
    pub const fn raw(self) -> i32 {
        self as i32
    }

    /// The C enumerator's name.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "ncclInt8",
            DataType::Uint8 => "ncclUint8",
            DataType::Int32 => "ncclInt32",
            DataType::Uint32 => "ncclUint32",
            DataType::Int64 => "ncclInt64",
            DataType::Uint64 => "ncclUint64",
            DataType::Float16 => "ncclFloat16",
            DataType::Float32 => "ncclFloat32",
            DataType::Float64 => "ncclFloat64",
            DataType::Bfloat16 => "ncclBfloat16",
            DataType::Float8E4M3 => "ncclFloat8e4m3",
            DataType::Float8E5M2 => "ncclFloat8e5m2",
        }
    }
}

/// The built-in `ncclRedOp_t` values. Note NCCL's order: max before min.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum RedOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclProd`.
    Prod = 1,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
    /// `ncclAvg` (NCCL 2.10+).
    Avg = 4,
}

/// `ncclNumOps`: the first value of the run-time operators that
/// `ncclRedOpCreatePreMulSum` hands out.
pub const NUM_BUILTIN_OPS: i32 = 5;

impl RedOp {
    /// The C value.
    pub const fn raw(self) -> i32 {
        self as i32
    }
}

/// How a chorus [`ReduceOp`] is issued on an NCCL-ABI library.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RedOpPlan {
    /// A built-in operator, passed as is.
    Builtin(RedOp),
    /// `ncclRedOpCreatePreMulSum` with this scalar (host-immediate, converted
    /// to the buffer's dtype), then `ncclRedOpDestroy` after the call is enqueued.
    PreMulSum(f64),
}

impl RedOpPlan {
    /// The plan for `op`.
    pub const fn of(op: ReduceOp) -> RedOpPlan {
        match op {
            ReduceOp::Sum => RedOpPlan::Builtin(RedOp::Sum),
            ReduceOp::Prod => RedOpPlan::Builtin(RedOp::Prod),
            ReduceOp::Min => RedOpPlan::Builtin(RedOp::Min),
            ReduceOp::Max => RedOpPlan::Builtin(RedOp::Max),
            ReduceOp::Avg => RedOpPlan::Builtin(RedOp::Avg),
            ReduceOp::PreMulSum(s) => RedOpPlan::PreMulSum(s),
        }
    }
}

/// Whether an NCCL of this version computes one-rank `Avg` and `PreMulSum`
/// reductions wrongly: the last elements unwritten or unscaled when the count
/// is not a multiple of the kernel's split (NVIDIA/nccl#1950, fixed in 2.29.7).
pub fn nccl_one_rank_scaling_broken(version: Version) -> bool {
    version < Version { major: 2, minor: 29, patch: 7 }
}

/// A pre-multiplied sum's scalar as one element of `dtype`, little-endian
/// (what `ncclRedOpCreatePreMulSum` reads with a host-immediate residence):
/// floats rounded to nearest, integers truncated toward zero, as C converts.
pub fn encode_scalar(dtype: DataType, s: f64) -> [u8; 8] {
    let mut out = [0u8; 8];
    let bytes: Vec<u8> = match dtype {
        DataType::Float32 => (s as f32).to_le_bytes().to_vec(),
        DataType::Float64 => s.to_le_bytes().to_vec(),
        DataType::Float16 => half::f16::from_f64(s).to_le_bytes().to_vec(),
        DataType::Bfloat16 => half::bf16::from_f64(s).to_le_bytes().to_vec(),
        DataType::Int32 => (s as i32).to_le_bytes().to_vec(),
        DataType::Uint32 => (s as u32).to_le_bytes().to_vec(),
        DataType::Int64 => (s as i64).to_le_bytes().to_vec(),
        DataType::Uint64 => (s as u64).to_le_bytes().to_vec(),
        DataType::Int8 => (s as i8).to_le_bytes().to_vec(),
        DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2 => (s as u8).to_le_bytes().to_vec(),
    };
    out[..bytes.len()].copy_from_slice(&bytes);
    out
}

/// `ncclScalarResidence_t`: where a pre-multiplied sum's scalar lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ScalarResidence {
    /// `ncclScalarDevice`: the pointer is to device memory, read when the collective runs.
    Device = 0,
    /// `ncclScalarHostImmediate`: the pointer is to host memory, read during the create call.
    HostImmediate = 1,
}

/// An `ncclResult_t` as returned by the library (any value, known or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResultCode(pub i32);

/// What a call that did not fail reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// `ncclSuccess`.
    Done,
    /// `ncclInProgress`: a non-blocking communicator is still working; poll
    /// `ncclCommGetAsyncError`.
    InProgress,
}

impl ResultCode {
    /// `ncclSuccess`.
    pub const SUCCESS: ResultCode = ResultCode(0);
    /// `ncclUnhandledCudaError` (a HIP error on RCCL).
    pub const UNHANDLED_CUDA_ERROR: ResultCode = ResultCode(1);
    /// `ncclSystemError`.
    pub const SYSTEM_ERROR: ResultCode = ResultCode(2);
    /// `ncclInternalError`.
    pub const INTERNAL_ERROR: ResultCode = ResultCode(3);
    /// `ncclInvalidArgument`.
    pub const INVALID_ARGUMENT: ResultCode = ResultCode(4);
    /// `ncclInvalidUsage`.
    pub const INVALID_USAGE: ResultCode = ResultCode(5);
    /// `ncclRemoteError`: a peer exited or the network failed.
    pub const REMOTE_ERROR: ResultCode = ResultCode(6);
    /// `ncclInProgress`.
    pub const IN_PROGRESS: ResultCode = ResultCode(7);

    /// The C enumerator's name (`ncclUnknownResult` for a value this crate does not know).
    pub const fn name(self) -> &'static str {
        match self.0 {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            _ => "ncclUnknownResult",
        }
    }

    /// The message `ncclGetErrorString` gives for this code.
    pub const fn message(self) -> &'static str {
        match self.0 {
            0 => "no error",
            1 => "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
            2 => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            3 => "internal error - please report this issue to the NCCL developers",
            4 => "invalid argument (run with NCCL_DEBUG=WARN for details)",
            5 => "invalid usage (run with NCCL_DEBUG=WARN for details)",
            6 => "remote process exited or there was a network error",
            7 => "NCCL operation in progress",
            _ => "unknown result code",
        }
    }

    /// `Done`, `InProgress`, or the error: [`CommError::Backend`] with the
    /// code and a message naming `call` and the code (`library` is `nccl` or `rccl`).
    pub fn check(self, library: &'static str, call: &str) -> Result<Status, CommError> {
        match self {
            ResultCode::SUCCESS => Ok(Status::Done),
            ResultCode::IN_PROGRESS => Ok(Status::InProgress),
            other => Err(other.error(library, call)),
        }
    }

    /// This code as an error of `call`.
    pub fn error(self, library: &'static str, call: &str) -> CommError {
        CommError::Backend {
            library,
            code: self.0 as i64,
            message: format!("{call} returned {}: {}", self.name(), self.message()),
        }
    }
}

impl fmt::Display for ResultCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name(), self.0, self.message())
    }
}

/// A library version as `ncclGetVersion` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl Version {
    /// Decodes `ncclGetVersion`'s integer: `major*1000 + minor*100 + patch`
    /// up to 2.8, `major*10000 + minor*100 + patch` from 2.9 on (`NCCL_VERSION`).
    pub const fn decode(code: i32) -> Version {
        let c = if code < 0 { 0 } else { code as u32 };
        if c >= 10_000 {
            Version { major: c / 10_000, minor: (c % 10_000) / 100, patch: c % 100 }
        } else {
            Version { major: c / 1000, minor: (c % 1000) / 100, patch: c % 100 }
        }
    }

    /// The inverse of [`Version::decode`] (`NCCL_VERSION(major, minor, patch)`).
    pub const fn encode(self) -> i32 {
        if self.major <= 2 && self.minor <= 8 {
            (self.major * 1000 + self.minor * 100 + self.patch) as i32
        } else {
            (self.major * 10_000 + self.minor * 100 + self.patch) as i32
        }
    }

    /// Whether this version is at least `major.minor`.
    pub const fn at_least(self, major: u32, minor: u32) -> bool {
        self.major > major || (self.major == major && self.minor >= minor)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// `NCCL_CONFIG_UNDEF_INT`: "leave this config field at the library's default".
pub const CONFIG_UNDEF_INT: i32 = i32::MIN;
/// The magic number of an initialized `ncclConfig_t`.
pub const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// `ncclConfig_t` as of NCCL 2.17 (the fields both NCCL ≥ 2.17 and RCCL
/// read). The library copies `size` bytes and fills the fields of later
/// versions with defaults, so this prefix is valid for every newer library.
#[repr(C)]
#[derive(Debug)]
pub struct CommConfig {
    /// `sizeof` this struct.
    pub size: usize,
    /// [`CONFIG_MAGIC`].
    pub magic: u32,
    /// The version whose layout this is (`NCCL_VERSION(2, 17, 0)`).
    pub version: u32,
    /// 0: calls may return `ncclInProgress`; 1: calls block.
    pub blocking: i32,
    /// `cgaClusterSize`.
    pub cga_cluster_size: i32,
    /// `minCTAs`.
    pub min_ctas: i32,
    /// `maxCTAs`.
    pub max_ctas: i32,
    /// `netName` (null: default).
    pub net_name: *const std::os::raw::c_char,
    /// `splitShare`: a split child shares its parent's resources.
    pub split_share: i32,
}

impl CommConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub fn new(blocking: bool) -> CommConfig {
        CommConfig {
            size: std::mem::size_of::<CommConfig>(),
            magic: CONFIG_MAGIC,
            version: Version { major: 2, minor: 17, patch: 0 }.encode() as u32,
            blocking: blocking as i32,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_an_nccl_type() {
        let raws: Vec<i32> = DType::ALL.iter().map(|d| DataType::of(*d).raw()).collect();
        assert_eq!(raws, vec![7, 8, 6, 9, 2, 4, 0, 1]);
    }

    #[test]
    fn reduce_ops_follow_nccl_order() {
        assert_eq!(RedOpPlan::of(ReduceOp::Max), RedOpPlan::Builtin(RedOp::Max));
        assert_eq!(RedOp::Max.raw(), 2);
        assert_eq!(RedOp::Min.raw(), 3);
        assert_eq!(RedOpPlan::of(ReduceOp::PreMulSum(0.5)), RedOpPlan::PreMulSum(0.5));
    }

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(Version::decode(2708), Version { major: 2, minor: 7, patch: 8 });
        assert_eq!(Version::decode(22703), Version { major: 2, minor: 27, patch: 3 });
        for v in [2708, 22703, 21805] {
            assert_eq!(Version::decode(v).encode(), v);
        }
        assert!(Version::decode(22703).at_least(2, 19));
        assert!(!Version::decode(21805).at_least(2, 19));
        assert_eq!(Version::decode(22703).to_string(), "2.27.3");
    }

    #[test]
    fn result_codes_name_themselves() {
        assert_eq!(ResultCode(6).name(), "ncclRemoteError");
        assert!(matches!(ResultCode::IN_PROGRESS.check("nccl", "x"), Ok(Status::InProgress)));
        let e = ResultCode(4).check("nccl", "ncclAllReduce").unwrap_err();
        assert!(matches!(e, CommError::Backend { library: "nccl", code: 4, .. }), "{e}");
        assert!(e.to_string().contains("ncclInvalidArgument"));
        assert_eq!(ResultCode(99).name(), "ncclUnknownResult");
    }

    #[test]
    fn unique_ids_round_trip() {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let id = UniqueId::from_bytes(bytes);
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
        assert_eq!(UniqueId::from_slice(&bytes).unwrap(), id);
        assert!(UniqueId::from_slice(&bytes[..5]).is_err());
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn config_is_the_2_17_layout() {
        let c = CommConfig::new(false);
        assert_eq!(c.size, std::mem::size_of::<CommConfig>());
        assert_eq!(c.version, 21700);
        assert_eq!(std::mem::offset_of!(CommConfig, net_name), 32);
    }
}
