//! [`LaunchEnv`]: who this process is in the job, read from the variables
//! its launcher set (torchrun or `chorus launch`, Slurm's `srun`, Open MPI's
//! `mpirun`, or a PMI launcher such as MPICH's hydra).
//!
//! Detection takes the variables as a map, so it is tested without touching
//! the process environment; [`LaunchEnv::from_process_env`] passes the real
//! one. The first launcher whose rank variable is present is used, in this
//! order: torchrun (`RANK`), Open MPI (`OMPI_COMM_WORLD_RANK`), PMI
//! (`PMI_RANK`), Slurm (`SLURM_PROCID`) — the more specific launcher first,
//! since `mpirun` inside a Slurm allocation also leaves Slurm's variables.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use super::nodelist::{self, NodeListError};

/// Which launcher started this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun or `chorus launch` (`TORCHELASTIC_*` present).
    Torchrun,
    /// `RANK`/`WORLD_SIZE` set by hand or by another tool (PyTorch's `env://`).
    Env,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// A PMI launcher (MPICH's or Intel MPI's hydra).
    Pmi,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Env => "env://",
            Launcher::Slurm => "Slurm",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "PMI",
        })
    }
}

/// Why the environment does not describe a rank of a job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// No launcher's variables at all.
    #[error("not started by a launcher: none of RANK (torchrun, chorus launch), OMPI_COMM_WORLD_RANK (mpirun), PMI_RANK or SLURM_PROCID (srun) is set; found {}", found_list(.found))]
    NoLauncher {
        /// The launcher-related variables that are set.
        found: BTreeMap<String, String>,
    },
    /// Some variables the launcher should have set are missing.
    #[error("{launcher} environment is missing {}; found {}", .missing.join(", "), found_list(.found))]
    Missing {
        /// The launcher detected.
        launcher: Launcher,
        /// The variables needed and not set (alternatives joined by `|`).
        missing: Vec<String>,
        /// The launcher-related variables that are set.
        found: BTreeMap<String, String>,
    },
    /// A variable does not parse.
    #[error("{var}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// The variables contradict each other (a rank not below the world size, say).
    #[error("{launcher} environment is inconsistent: {reason}; found {}", found_list(.found))]
    Inconsistent {
        /// The launcher detected.
        launcher: Launcher,
        /// The contradiction.
        reason: String,
        /// The launcher-related variables that are set.
        found: BTreeMap<String, String>,
    },
    /// Slurm's node list does not parse.
    #[error(transparent)]
    NodeList(#[from] NodeListError),
}

fn found_list(found: &BTreeMap<String, String>) -> String {
    if found.is_empty() {
        return "no launcher variables".into();
    }
    found.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
}

/// Where this process is in the job and where the job's store is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher detected.
    pub launcher: Launcher,
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank on this node, `0..local_world_size` (picks the GPU).
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Index of this node (torchrun's `GROUP_RANK`).
    pub node_rank: usize,
    /// Host of the job's store (rank 0's node, or torchrun's agent).
    pub master_addr: String,
    /// Port of the job's store.
    pub master_port: u16,
    /// How many times the job was restarted (`TORCHELASTIC_RESTART_COUNT`,
    /// `SLURM_RESTART_COUNT`; 0 otherwise).
    pub restart_count: u32,
    /// The run's name, when the launcher gives one (`TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`).
    pub run_id: Option<String>,
    /// Whether the launcher's agent already hosts the store at
    /// `master_addr:master_port` (`TORCHELASTIC_USE_AGENT_STORE=True`, as
    /// torchrun and `chorus launch` set it): every rank is then a client.
    pub use_agent_store: bool,
}

/// The variable-name prefixes reported as "found" in errors.
const RELEVANT: [&str; 14] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_",
    "TORCHELASTIC_",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_",
    "OMPI_COMM_WORLD_",
    "PMI_",
];

struct Vars<'a> {
    vars: &'a HashMap<String, String>,
    launcher: Launcher,
    missing: Vec<String>,
}

impl<'a> Vars<'a> {
    fn found(&self) -> BTreeMap<String, String> {
        found(self.vars)
    }

    fn raw(&self, name: &str) -> Option<&'a str> {
        self.vars.get(name).map(String::as_str).filter(|v| !v.trim().is_empty())
    }

    /// The first of `names` that is set, noting all of them as missing otherwise.
    fn first(&mut self, names: &[&str]) -> Option<(&'a str, String)> {
        for n in names {
            if let Some(v) = self.raw(n) {
                return Some((v, n.to_string()));
            }
        }
        self.missing.push(names.join("|"));
        None
    }

    fn number(&mut self, names: &[&str]) -> Result<Option<usize>, EnvError> {
        match self.first(names) {
            None => Ok(None),
            Some((v, name)) => parse_number(&name, v).map(Some),
        }
    }

    /// An optional number: `name`'s value, or `default` where it is unset.
    fn number_or(&self, name: &str, default: usize) -> Result<usize, EnvError> {
        self.raw(name).map_or(Ok(default), |v| parse_number(name, v))
    }

    fn finish_missing(&self) -> Result<(), EnvError> {
        if self.missing.is_empty() {
            Ok(())
        } else {
            Err(self.missing_error())
        }
    }

    /// The error naming every variable noted missing.
    fn missing_error(&self) -> EnvError {
        EnvError::Missing { launcher: self.launcher, missing: self.missing.clone(), found: self.found() }
    }

    fn inconsistent(&self, reason: String) -> EnvError {
        EnvError::Inconsistent { launcher: self.launcher, reason, found: self.found() }
    }
}

fn found(vars: &HashMap<String, String>) -> BTreeMap<String, String> {
    vars.iter()
        .filter(|(k, _)| RELEVANT.iter().any(|p| k.starts_with(p)) || k.starts_with("MPI_LOCAL"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn parse_number(var: &str, value: &str) -> Result<usize, EnvError> {
    value.trim().parse().map_err(|_| EnvError::Invalid {
        var: var.into(),
        value: value.into(),
        reason: "expected a non-negative integer".into(),
    })
}

fn parse_port(var: &str, value: &str) -> Result<u16, EnvError> {
    value.trim().parse().map_err(|_| EnvError::Invalid {
        var: var.into(),
        value: value.into(),
        reason: "expected a port number (0-65535)".into(),
    })
}

/// Slurm's tasks-per-node list, `2(x3),1`: the count of node `node`.
fn tasks_on_node(var: &str, value: &str, node: usize) -> Result<Option<usize>, EnvError> {
    let invalid = || EnvError::Invalid {
        var: var.into(),
        value: value.into(),
        reason: "expected counts like 4 or 2(x3),1".into(),
    };
    let mut index = 0usize;
    for part in value.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(invalid)?),
            None => (part, "1"),
        };
        let count: usize = count.parse().map_err(|_| invalid())?;
        let repeat: usize = repeat.parse().map_err(|_| invalid())?;
        if node < index.saturating_add(repeat) {
            return Ok(Some(count));
        }
        index = index.saturating_add(repeat);
    }
    Ok(None)
}

/// The part of store keys that tells jobs and their restarts apart,
/// `{run id}/{restart}` — what `chorus`'s commands put in their keys, and
/// the library's default prefixes (UCX's `chorus/ucx/{scope}`) too, so a
/// job never reads what an earlier job or attempt left in a shared store.
/// The run id is `TORCHELASTIC_RUN_ID` (torchrun, `chorus launch`) or
/// `SLURM_JOB_ID`, else `run`; the restart is `TORCHELASTIC_RESTART_COUNT`
/// or `SLURM_RESTART_COUNT`, else 0. Read from `vars`, so that it needs no
/// launcher and is tested without the process environment.
pub fn key_scope(vars: &HashMap<String, String>) -> String {
    let get = |names: &[&str]| names.iter().find_map(|n| vars.get(*n).map(|v| v.trim()).filter(|v| !v.is_empty()));
    let run = get(&["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]).unwrap_or("run");
    let restart = get(&["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"]).unwrap_or("0");
    format!("{run}/{restart}")
}

/// [`key_scope`] of this process's environment.
pub fn process_key_scope() -> String {
    key_scope(&process_vars())
}

/// The process environment's variables that are valid UTF-8.
fn process_vars() -> HashMap<String, String> {
    std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect()
}

impl LaunchEnv {
    /// The scope of this job's store keys, `{run id}/{restart}` (see [`key_scope`]).
    pub fn key_scope(&self) -> String {
        format!("{}/{}", self.run_id.as_deref().unwrap_or("run"), self.restart_count)
    }

    /// Detects the launcher from this process's environment.
    pub fn from_process_env() -> Result<LaunchEnv, EnvError> {
        LaunchEnv::detect(&process_vars())
    }

    /// Detects the launcher from `vars` (name → value); see the module doc
    /// for the order. Missing variables are listed together in one
    /// [`EnvError::Missing`]; contradictions are [`EnvError::Inconsistent`].
    pub fn detect(vars: &HashMap<String, String>) -> Result<LaunchEnv, EnvError> {
        let has = |k: &str| vars.get(k).is_some_and(|v| !v.trim().is_empty());
        let env = if has("RANK") {
            let launcher =
                if vars.keys().any(|k| k.starts_with("TORCHELASTIC_")) { Launcher::Torchrun } else { Launcher::Env };
            LaunchEnv::torchrun(Vars { vars, launcher, missing: Vec::new() })?
        } else if has("OMPI_COMM_WORLD_RANK") {
            LaunchEnv::mpi(
                &mut Vars { vars, launcher: Launcher::OpenMpi, missing: Vec::new() },
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            )?
        } else if has("PMI_RANK") {
            LaunchEnv::mpi(
                &mut Vars { vars, launcher: Launcher::Pmi, missing: Vec::new() },
                ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            )?
        } else if has("SLURM_PROCID") {
            LaunchEnv::slurm(Vars { vars, launcher: Launcher::Slurm, missing: Vec::new() })?
        } else {
            return Err(EnvError::NoLauncher { found: found(vars) });
        };
        env.validate(vars)?;
        Ok(env)
    }

    /// The job as an MPI launcher describes it: the rank, world size, local
    /// rank and local world size from the variables `names` (in that order),
    /// and the store's address from `MASTER_ADDR`/`MASTER_PORT` (MPI
    /// launchers name no store: the job says where rank 0 hosts it); names
    /// every missing one at once. Nodes are filled in blocks (MPI does not
    /// export the node index); no restarts, run id or agent store. torchrun
    /// reads the same variables and adds its own.
    fn mpi(v: &mut Vars<'_>, names: [&str; 4]) -> Result<LaunchEnv, EnvError> {
        let rank = v.number(&[names[0]])?;
        let world_size = v.number(&[names[1]])?;
        let local_rank = v.number(&[names[2]])?;
        let local_world_size = v.number(&[names[3]])?;
        let master_addr = v.first(&["MASTER_ADDR"]).map(|(a, _)| a.trim().to_string());
        let master_port = match v.first(&["MASTER_PORT"]) {
            Some((p, name)) => Some(parse_port(&name, p)?),
            None => None,
        };
        v.finish_missing()?;
        match (rank, world_size, local_rank, local_world_size, master_addr, master_port) {
            (Some(rank), Some(world_size), Some(local_rank), Some(local_world_size), Some(addr), Some(port)) => {
                Ok(LaunchEnv {
                    launcher: v.launcher,
                    rank,
                    world_size,
                    local_rank,
                    local_world_size,
                    node_rank: rank / local_world_size.max(1),
                    master_addr: addr,
                    master_port: port,
                    restart_count: 0,
                    run_id: None,
                    use_agent_store: false,
                })
            }
            _ => Err(v.missing_error()),
        }
    }

    fn torchrun(mut v: Vars<'_>) -> Result<LaunchEnv, EnvError> {
        let env = Self::mpi(&mut v, ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])?;
        let node_rank = v.number_or("GROUP_RANK", env.node_rank)?;
        let restart_count = v.number_or("TORCHELASTIC_RESTART_COUNT", 0)? as u32;
        Ok(LaunchEnv {
            node_rank,
            restart_count,
            run_id: v.raw("TORCHELASTIC_RUN_ID").map(str::to_string),
            use_agent_store: v.raw("TORCHELASTIC_USE_AGENT_STORE") == Some("True"),
            ..env
        })
    }

    fn slurm(mut v: Vars<'_>) -> Result<LaunchEnv, EnvError> {
        let rank = v.number(&["SLURM_PROCID"])?;
        let world_size = v.number(&["SLURM_NTASKS", "SLURM_NPROCS"])?;
        let local_rank = v.number(&["SLURM_LOCALID"])?;
        let node_rank = v.number(&["SLURM_NODEID"])?;
        let per_node = v.first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"]);
        let master_addr = match v.raw("MASTER_ADDR") {
            Some(a) => Some(a.trim().to_string()),
            None => match v.first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]) {
                Some((list, _)) => Some(nodelist::first_host(list)?),
                None => None,
            },
        };
        v.finish_missing()?;
        let (
            Some(rank),
            Some(world_size),
            Some(local_rank),
            Some(node_rank),
            Some((per_node, per_node_var)),
            Some(master_addr),
        ) = (rank, world_size, local_rank, node_rank, per_node, master_addr)
        else {
            return Err(v.missing_error());
        };
        let local_world_size = tasks_on_node(&per_node_var, per_node, node_rank)?.ok_or_else(|| {
            v.inconsistent(format!("{per_node_var}={per_node} has no entry for SLURM_NODEID={node_rank}"))
        })?;
        let job_id = v.raw("SLURM_JOB_ID").map(str::to_string);
        let master_port = match v.raw("MASTER_PORT") {
            Some(p) => parse_port("MASTER_PORT", p)?,
            // Jobs sharing a node get different ports; the same job agrees on one.
            None => match &job_id {
                Some(id) => 20000 + (parse_number("SLURM_JOB_ID", id)? % 20000) as u16,
                None => 29500,
            },
        };
        let restart_count = v.number_or("SLURM_RESTART_COUNT", 0)? as u32;
        Ok(LaunchEnv {
            launcher: v.launcher,
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            master_addr,
            master_port,
            restart_count,
            run_id: job_id,
            use_agent_store: false,
        })
    }

    fn validate(&self, vars: &HashMap<String, String>) -> Result<(), EnvError> {
        let bad = |reason: String| EnvError::Inconsistent { launcher: self.launcher, reason, found: found(vars) };
        if self.world_size == 0 {
            return Err(bad("the world size is 0".into()));
        }
        if self.rank >= self.world_size {
            return Err(bad(format!("rank {} is not below the world size {}", self.rank, self.world_size)));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return Err(bad(format!(
                "the local world size {} is not in 1..={}",
                self.local_world_size, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(bad(format!(
                "local rank {} is not below the local world size {}",
                self.local_rank, self.local_world_size
            )));
        }
        if self.master_addr.is_empty() {
            return Err(bad("the master address is empty".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn torchrun_variables() {
        let env = LaunchEnv::detect(&vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap();
        assert_eq!(
            env,
            LaunchEnv {
                launcher: Launcher::Torchrun,
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                master_addr: "node0".into(),
                master_port: 29500,
                restart_count: 2,
                run_id: Some("job7".into()),
                use_agent_store: true
            }
        );
        let plain = LaunchEnv::detect(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!((plain.launcher, plain.use_agent_store, plain.node_rank), (Launcher::Env, false, 0));
    }

    #[test]
    fn key_scopes_tell_runs_and_restarts_apart() {
        assert_eq!(key_scope(&vars(&[])), "run/0");
        assert_eq!(key_scope(&vars(&[("TORCHELASTIC_RUN_ID", "job7"), ("TORCHELASTIC_RESTART_COUNT", "2")])), "job7/2");
        assert_eq!(key_scope(&vars(&[("SLURM_JOB_ID", "123"), ("SLURM_RESTART_COUNT", "1")])), "123/1");
        let env = LaunchEnv::detect(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
        ]))
        .unwrap();
        assert_eq!(env.key_scope(), "job7/3");
    }

    #[test]
    fn slurm_variables_and_the_first_host() {
        let env = LaunchEnv::detect(&vars(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_JOB_NODELIST", "gpu[01-04,07],cpu3"),
            ("SLURM_JOB_ID", "123456"),
        ]))
        .unwrap();
        assert_eq!(
            (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank),
            (Launcher::Slurm, 6, 7, 0, 1, 3)
        );
        assert_eq!(env.master_addr, "gpu01");
        assert_eq!(env.master_port, 23456);
        assert_eq!(env.run_id.as_deref(), Some("123456"));
    }

    #[test]
    fn open_mpi_and_pmi_variables() {
        let ompi = LaunchEnv::detect(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "h0"),
            ("MASTER_PORT", "4000"),
            ("SLURM_PROCID", "0"),
        ]))
        .unwrap();
        assert_eq!((ompi.launcher, ompi.rank, ompi.node_rank), (Launcher::OpenMpi, 3, 1));
        let pmi = LaunchEnv::detect(&vars(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "h0"),
            ("MASTER_PORT", "4000"),
        ]))
        .unwrap();
        assert_eq!((pmi.launcher, pmi.rank, pmi.world_size), (Launcher::Pmi, 1, 2));
    }

    #[test]
    fn missing_and_inconsistent_variables_are_listed() {
        let e =
            LaunchEnv::detect(&vars(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "x")])).unwrap_err();
        let EnvError::Missing { launcher, missing, found } = &e else { panic!("{e}") };
        assert_eq!(*launcher, Launcher::Torchrun);
        assert_eq!(missing, &["LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]);
        assert_eq!(found.get("RANK").map(String::as_str), Some("0"));
        assert!(e.to_string().contains("RANK=0"), "{e}");

        let e = LaunchEnv::detect(&vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err();
        assert!(matches!(e, EnvError::Inconsistent { .. }), "{e}");
        let e = LaunchEnv::detect(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "70000"),
        ]))
        .unwrap_err();
        assert!(matches!(e, EnvError::Invalid { ref var, .. } if var == "MASTER_PORT"), "{e}");
        let e = LaunchEnv::detect(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(matches!(e, EnvError::Invalid { ref var, .. } if var == "RANK"), "{e}");
        let e = LaunchEnv::detect(&vars(&[("PATH", "/bin")])).unwrap_err();
        assert!(matches!(e, EnvError::NoLauncher { ref found } if found.is_empty()), "{e}");
        let e = LaunchEnv::detect(&vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])).unwrap_err();
        let EnvError::Missing { missing, .. } = &e else { panic!("{e}") };
        assert!(missing.iter().any(|m| m.contains("SLURM_JOB_NODELIST")), "{e}");
        let e = LaunchEnv::detect(&vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2"),
            ("SLURM_JOB_NODELIST", "gpu[01-"),
        ]))
        .unwrap_err();
        assert!(matches!(e, EnvError::NodeList(_)), "{e}");
    }
}
