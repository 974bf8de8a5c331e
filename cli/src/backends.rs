//! The backends compiled into this binary, and `chorus info`.
//!
//! Each backend is one [`Backend`] variant behind its cargo feature and one
//! [`InfoRow`] made by a probe function. Adding a backend is: a feature in
//! `cli/Cargo.toml`, a variant here with its name, a probe that tries to load
//! its library and says which variable points to it, and its arm in
//! `with_backend!` (a member of the NCCL family needs nothing else:
//! `train`, `bench` and `conformance` are written once over the family).

use crate::Outcome;

/// A communication backend this binary can run `train`, `bench` and
/// `conformance` on: the one place a backend is registered in the CLI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Ranks as threads of this process, each with its own cpu device.
    #[cfg(feature = "sim")]
    Sim,
    /// The NCCL family's communicator over the simulated NCCL ABI (as NCCL
    /// 2.28.3), ranks as threads on cpu devices.
    #[cfg(feature = "sim")]
    SimNccl,
    /// NCCL, one rank per GPU, as threads of this process.
    #[cfg(feature = "nccl")]
    Nccl,
    /// RCCL, one rank per GPU, as threads of this process.
    #[cfg(feature = "rccl")]
    Rccl,
    /// UCX, one rank per process (started by a launcher), on cpu devices.
    #[cfg(feature = "ucx")]
    Ucx,
}

/// Calls `$body` with `$L` bound to the [`VendorLib`](chorus_collectives::nccl_family::VendorLib)
/// of a vendor-family backend, or evaluates `$sim` / `$ucx` for those
/// backends: how the subcommands dispatch once to code written generically
/// over the family.
#[macro_export]
macro_rules! with_backend {
    ($backend:expr, sim => $sim:expr, ucx => $ucx:expr, vendor<$L:ident> => $body:expr) => {
        match $backend {
            #[cfg(feature = "sim")]
            $crate::backends::Backend::Sim => $sim,
            #[cfg(feature = "ucx")]
            $crate::backends::Backend::Ucx => $ucx,
            #[cfg(feature = "sim")]
            $crate::backends::Backend::SimNccl => {
                type $L = chorus_collectives::nccl_family::simlib::SimNccl228;
                $body
            }
            #[cfg(feature = "nccl")]
            $crate::backends::Backend::Nccl => {
                type $L = chorus_collectives::nccl::Nccl;
                $body
            }
            #[cfg(feature = "rccl")]
            $crate::backends::Backend::Rccl => {
                type $L = chorus_collectives::rccl::Rccl;
                $body
            }
        }
    };
}

/// Backends that exist but are not compiled into this binary (each behind
/// its cargo feature), and those only planned; named in `info` and in the
/// error when someone asks for one.
fn not_in_binary() -> String {
    let mut out: Vec<&str> = Vec::new();
    if !cfg!(feature = "cuda") {
        out.push("cuda (--features cuda)");
    }
    if !cfg!(feature = "nccl") {
        out.push("nccl (--features nccl)");
    }
    if !cfg!(feature = "rocm") {
        out.push("rocm (--features rocm)");
    }
    if !cfg!(feature = "rccl") {
        out.push("rccl (--features rccl)");
    }
    if !cfg!(feature = "ucx") {
        out.push("ucx (--features ucx)");
    }
    out.join(", ")
}

impl Backend {
    /// Every backend compiled in, in a fixed order.
    pub fn compiled() -> Vec<Backend> {
        vec![
            #[cfg(feature = "sim")]
            Backend::Sim,
            #[cfg(feature = "sim")]
            Backend::SimNccl,
            #[cfg(feature = "nccl")]
            Backend::Nccl,
            #[cfg(feature = "rccl")]
            Backend::Rccl,
            #[cfg(feature = "ucx")]
            Backend::Ucx,
        ]
    }

    /// Whether the backend runs one rank per process when a launcher's
    /// variables are present (`ucx` always needs them; the simulated
    /// backends run their ranks as threads).
    pub fn runs_as_processes(self) -> bool {
        match self {
            #[cfg(feature = "nccl")]
            Backend::Nccl => true,
            #[cfg(feature = "rccl")]
            Backend::Rccl => true,
            #[cfg(feature = "ucx")]
            Backend::Ucx => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            #[cfg(feature = "sim")]
            Backend::Sim => "sim",
            #[cfg(feature = "sim")]
            Backend::SimNccl => "simnccl",
            #[cfg(feature = "nccl")]
            Backend::Nccl => "nccl",
            #[cfg(feature = "rccl")]
            Backend::Rccl => "rccl",
            #[cfg(feature = "ucx")]
            Backend::Ucx => "ucx",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Most ranks a command runs as threads of one process: each rank is a
/// handful of threads (its stream executors, its collectives), and one
/// process's threads are bounded (a hundred thousand ranks aborted while
/// setting up their stacks). Larger worlds run one rank per process under a
/// launcher.
pub const MAX_THREAD_RANKS: usize = 512;

/// Refuses a `--world-size` above [`MAX_THREAD_RANKS`] for a command that
/// runs its ranks as threads of this process on `backend`.
pub fn check_thread_world(backend: Backend, world: usize) -> Result<(), String> {
    if world <= MAX_THREAD_RANKS {
        return Ok(());
    }
    Err(format!(
        "--world-size {world}: the {backend} backend runs every rank as threads of this process here; at most \
         {MAX_THREAD_RANKS} (more ranks run one per process under a launcher, e.g. with --backend ucx)"
    ))
}

/// Refuses a backend that runs every rank as threads of this process when a
/// launcher (`chorus launch`, torchrun, srun, mpirun) started this process
/// as one rank of several: each process would run a whole world of its own
/// (and all of them would write the same outputs).
pub fn check_not_one_of_many(backend: Backend) -> Result<(), String> {
    if backend.runs_as_processes() {
        return Ok(());
    }
    match chorus_collectives::bootstrap::LaunchEnv::from_process_env() {
        Ok(env) if env.world_size > 1 => Err(format!(
            "the {backend} backend runs every rank as threads of one process, but this process is rank {} of \
             {} that a launcher started ({}'s variables): under a launcher use --backend ucx (or nccl/rccl), \
             one rank per process",
            env.rank, env.world_size, env.launcher
        )),
        _ => Ok(()),
    }
}

/// Parses `--backend`: one of the compiled backends, or an error that lists them.
pub fn parse_backend(text: &str) -> Result<Backend, String> {
    let compiled = Backend::compiled();
    if let Some(b) = compiled.iter().find(|b| b.name() == text) {
        return Ok(*b);
    }
    let names: Vec<&str> = compiled.iter().map(|b| b.name()).collect();
    let names = if names.is_empty() { "none".to_string() } else { names.join(", ") };
    Err(format!(
        "backend `{text}` is not compiled into this binary (compiled: {names}; not in this binary: {})",
        not_in_binary()
    ))
}

/// Whether a backend's library can be used on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    /// Usable; the detail says what was found.
    Available(String),
    /// Not usable here; the reason names the library and the variable that points to it.
    // Made by the probes of the vendor backends (cuda, nccl, rocm, rccl), none compiled yet.
    #[allow(dead_code)]
    Unavailable(String),
}

/// One line of `chorus info`.
#[derive(Clone, Debug)]
pub struct InfoRow {
    /// The backend's name.
    pub name: &'static str,
    /// What it provides (`device`, `collectives`).
    pub role: &'static str,
    /// The library it needs.
    pub library: &'static str,
    /// Whether that library is usable here.
    pub availability: Availability,
}

/// The host device: always compiled, always available.
fn cpu_row() -> InfoRow {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    InfoRow {
        name: "cpu",
        role: "device",
        library: "none (host memory, one executor thread per stream)",
        availability: Availability::Available(format!("{cpus} CPUs available to this process")),
    }
}

#[cfg(feature = "sim")]
fn sim_row() -> InfoRow {
    InfoRow {
        name: "sim",
        role: "collectives",
        library: "none (ranks are threads of this process, each on a cpu device)",
        availability: Availability::Available("always".into()),
    }
}

#[cfg(feature = "sim")]
fn simnccl_row() -> InfoRow {
    InfoRow {
        name: "simnccl",
        role: "collectives",
        library: "none (the NCCL family's communicator over a simulated NCCL 2.28.3 ABI; ranks are threads of this \
                  process, each on a cpu device)",
        availability: Availability::Available("always".into()),
    }
}

/// NVIDIA GPUs: the driver, NVRTC and cuBLAS, probed the way the backend loads them.
#[cfg(feature = "cuda")]
fn cuda_row() -> InfoRow {
    use chorus_devices::cuda;
    let found = |l: cuda::LibraryInfo| format!("{} at {}", l.name, l.path.unwrap_or_else(|| "(path unknown)".into()));
    let availability = match cuda::driver_library() {
        Err(e) => Availability::Unavailable(e.to_string()),
        Ok(driver) => {
            let version = match cuda::driver_version() {
                Ok(v) => format!("driver supports CUDA {}.{}", v / 1000, (v % 1000) / 10),
                Err(e) => format!("driver version unknown: {e}"),
            };
            let devices = match cuda::device_count() {
                Ok(n) => format!("{n} device(s) visible"),
                Err(e) => format!("no devices: {e}"),
            };
            let nvrtc = cuda::nvrtc_library().map(found).unwrap_or_else(|e| format!("nvrtc unavailable: {e}"));
            let cublas = cuda::cublas_library().map(found).unwrap_or_else(|e| format!("cublas unavailable: {e}"));
            Availability::Available(format!("{}, {version}, {devices}; {nvrtc}; {cublas}", found(driver)))
        }
    };
    InfoRow {
        name: "cuda",
        role: "device",
        library: "libcuda.so.1, libnvrtc.so.12, libcublas.so.12 (CHORUS_CUDA_LIB, CHORUS_NVRTC_LIB, CHORUS_CUBLAS_LIB)",
        availability,
    }
}

/// NCCL: the library (version, where it was found) and the GPUs it could use.
#[cfg(feature = "nccl")]
fn nccl_row() -> InfoRow {
    use chorus_collectives::nccl;
    let availability = match nccl::version() {
        Err(e) => Availability::Unavailable(e.to_string()),
        Ok(v) => {
            let path = nccl::library_path().unwrap_or_default();
            let devices = match chorus_devices::cuda::device_count() {
                Ok(n) => format!("{n} CUDA device(s) visible"),
                Err(e) => format!("no CUDA devices: {e}"),
            };
            Availability::Available(format!("NCCL {v} from {path}; {devices}"))
        }
    };
    InfoRow { name: "nccl", role: "collectives", library: "libnccl.so.2 (CHORUS_NCCL_LIB)", availability }
}

/// AMD GPUs: the HIP runtime and hipRTC (where they were found, the version) and the devices they see.
#[cfg(feature = "rocm")]
fn rocm_row() -> InfoRow {
    use chorus_devices::hip;
    let availability = match hip::info() {
        Ok(i) => {
            let rtc = match &i.hiprtc {
                Ok(path) => format!("hipRTC at {path}"),
                Err(e) => format!("hipRTC unavailable: {e}"),
            };
            let found = format!("HIP {} at {}; {rtc}", i.runtime_version, i.library);
            match (i.devices, &i.no_device_reason) {
                (0, reason) => Availability::Unavailable(format!(
                    "{found}; no device visible ({})",
                    reason.as_deref().unwrap_or("none reported")
                )),
                (n, _) => Availability::Available(format!("{found}; {n} device(s) visible")),
            }
        }
        Err(e) => Availability::Unavailable(e.to_string()),
    };
    InfoRow {
        name: "rocm",
        role: "device",
        library: "libamdhip64, hipRTC (CHORUS_HIP_LIB, CHORUS_HIPRTC_LIB)",
        availability,
    }
}

/// RCCL: the library (version, where it was found) and the HIP devices it could use.
#[cfg(feature = "rccl")]
fn rccl_row() -> InfoRow {
    use chorus_collectives::rccl;
    let availability = match (rccl::library_path(), rccl::version()) {
        (Ok(path), Ok(v)) => match chorus_devices::hip::device_count() {
            Ok(n) if n > 0 => Availability::Available(format!("RCCL {v} from {path}; {n} HIP device(s) visible")),
            Ok(_) => Availability::Unavailable(format!("RCCL {v} from {path}; no HIP device visible")),
            Err(e) => Availability::Unavailable(format!("RCCL {v} from {path}; {e}")),
        },
        (Err(e), _) => Availability::Unavailable(e.to_string()),
        (_, Err(e)) => Availability::Unavailable(e.to_string()),
    };
    InfoRow { name: "rccl", role: "collectives", library: "librccl.so (CHORUS_RCCL_LIB)", availability }
}

/// UCX: the bundled library (built into this binary) and whether a worker
/// starts here.
#[cfg(feature = "ucx")]
fn ucx_row() -> InfoRow {
    let availability = match chorus_collectives::ucx::probe() {
        Ok(detail) => Availability::Available(format!(
            "{detail}; one rank per process under chorus launch, torchrun --no-python, srun or mpirun"
        )),
        Err(e) => Availability::Unavailable(e.to_string()),
    };
    InfoRow {
        name: "ucx",
        role: "collectives",
        library: "UCX 1.22.0 linked in statically (ucx-rs; TCP and shared-memory transports; UCX_* variables apply)",
        availability,
    }
}

/// The rows of `chorus info`: every compiled backend, devices first.
pub fn rows() -> Vec<InfoRow> {
    vec![
        cpu_row(),
        #[cfg(feature = "cuda")]
        cuda_row(),
        #[cfg(feature = "rocm")]
        rocm_row(),
        #[cfg(feature = "sim")]
        sim_row(),
        #[cfg(feature = "sim")]
        simnccl_row(),
        #[cfg(feature = "nccl")]
        nccl_row(),
        #[cfg(feature = "rccl")]
        rccl_row(),
        #[cfg(feature = "ucx")]
        ucx_row(),
    ]
}

/// `chorus info`.
pub fn info() -> anyhow::Result<Outcome> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "chorus {} — backends compiled into this binary", env!("CARGO_PKG_VERSION"))?;
    writeln!(out)?;
    let rows = rows();
    let w_name = rows.iter().map(|r| r.name.len()).max().unwrap_or(0).max("backend".len());
    let w_role = rows.iter().map(|r| r.role.len()).max().unwrap_or(0).max("role".len());
    let w_status = "unavailable".len();
    writeln!(out, "{:<w_name$}  {:<w_role$}  {:<w_status$}  library / detail", "backend", "role", "status")?;
    for r in &rows {
        let (status, detail) = match &r.availability {
            Availability::Available(d) => ("available", d.as_str()),
            Availability::Unavailable(d) => ("unavailable", d.as_str()),
        };
        writeln!(out, "{:<w_name$}  {:<w_role$}  {status:<w_status$}  {}; {detail}", r.name, r.role, r.library)?;
    }
    writeln!(out)?;
    writeln!(out, "not in this binary: {}", not_in_binary())?;
    Ok(Outcome::Passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_backends_are_refused_with_the_compiled_list() {
        let e = parse_backend("mpi").unwrap_err();
        assert!(e.contains("not compiled"), "{e}");
        assert!(rows().iter().any(|r| r.name == "cpu"));
    }

    #[cfg(feature = "sim")]
    #[test]
    fn sim_is_compiled_and_available() {
        assert_eq!(parse_backend("sim"), Ok(Backend::Sim));
        let sim = rows().into_iter().find(|r| r.name == "sim").expect("sim row");
        assert!(matches!(sim.availability, Availability::Available(_)));
    }

    #[test]
    fn info_has_a_row_for_every_backend_that_backend_accepts() {
        let rows = rows();
        for b in Backend::compiled() {
            assert_eq!(parse_backend(b.name()), Ok(b));
            assert!(rows.iter().any(|r| r.name == b.name()), "`chorus info` has no row for {b}");
        }
    }

    #[cfg(feature = "sim")]
    #[test]
    fn worlds_of_threads_are_bounded() {
        assert_eq!(check_thread_world(Backend::Sim, MAX_THREAD_RANKS), Ok(()));
        let e = check_thread_world(Backend::SimNccl, 100_000).unwrap_err();
        assert!(e.contains("--world-size 100000") && e.contains(&format!("at most {MAX_THREAD_RANKS}")), "{e}");
    }
}
