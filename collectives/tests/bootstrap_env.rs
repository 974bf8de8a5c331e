//! `connect_from_env`: ranks described only by their launcher variables
//! find each other (threads standing in for processes).

use crate::torch_python;

use std::collections::HashMap;
use std::time::Duration;

use chorus_collectives::bootstrap::{
    connect_from_env, ClientOptions, ConnectOptions, LaunchEnv, Launcher, Store, TcpStoreServer,
};
use chorus_collectives::{CommError, StoreFailure};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn torchrun_vars(rank: usize, world: usize, port: u16, agent: bool) -> HashMap<String, String> {
    let mut v: HashMap<String, String> = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if agent {
        v.insert("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into());
        v.insert("TORCHELASTIC_RESTART_COUNT".into(), "0".into());
    }
    v
}

fn options() -> ConnectOptions {
    ConnectOptions {
        client: ClientOptions { connect_timeout: Duration::from_secs(20), ..ClientOptions::default() },
        ..ConnectOptions::default()
    }
}

/// Every rank publishes its rank and reads everyone's.
fn exchange(store: &dyn Store, rank: usize, world: usize) -> Vec<Vec<u8>> {
    store.set(&format!("rank/{rank}"), rank.to_string().as_bytes()).unwrap();
    let keys: Vec<String> = (0..world).map(|r| format!("rank/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.multi_get(&keys, Duration::from_secs(20)).unwrap()
}

#[test]
fn rank_zero_hosts_the_store_and_every_rank_joins() {
    let (world, port) = (4, free_port());
    let expected: Vec<Vec<u8>> = (0..world).map(|r| r.to_string().into_bytes()).collect();
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || {
                let env = LaunchEnv::detect(&torchrun_vars(rank, world, port, false)).unwrap();
                assert_eq!(env.launcher, Launcher::Env);
                let rdzv = connect_from_env(&env, &options()).unwrap();
                assert_eq!(rdzv.server().is_some(), rank == 0);
                let values = exchange(&*rdzv.store(), rank, world);
                // Rank 0 keeps its server up until everyone has read.
                rdzv.store().add("done", 1).unwrap();
                if rank == 0 {
                    let deadline = std::time::Instant::now() + Duration::from_secs(20);
                    while rdzv.store().get("done", Duration::from_secs(20)).unwrap() != world.to_string().as_bytes() {
                        assert!(std::time::Instant::now() < deadline);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                values
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), expected);
    }
}

#[test]
fn under_an_agent_store_every_rank_is_a_client() {
    let agent = TcpStoreServer::bind_loopback(0).unwrap();
    let world = 3;
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let port = agent.port();
            std::thread::spawn(move || {
                let env = LaunchEnv::detect(&torchrun_vars(rank, world, port, true)).unwrap();
                assert!(env.use_agent_store);
                let rdzv = connect_from_env(&env, &options()).unwrap();
                assert!(rdzv.server().is_none());
                exchange(&*rdzv.store(), rank, world)
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap().len(), world);
    }
}

#[test]
fn a_taken_port_and_an_absent_rank_zero_are_typed_errors() {
    let taken = TcpStoreServer::bind_loopback(0).unwrap();
    let env = LaunchEnv::detect(&torchrun_vars(0, 2, taken.port(), false)).unwrap();
    let e = connect_from_env(&env, &options()).unwrap_err();
    assert!(matches!(e, CommError::Store { failure: StoreFailure::AddressInUse, .. }), "{e}");

    let env = LaunchEnv::detect(&torchrun_vars(1, 2, free_port(), false)).unwrap();
    let quick = ConnectOptions {
        client: ClientOptions { connect_timeout: Duration::from_millis(300), ..ClientOptions::default() },
        ..ConnectOptions::default()
    };
    let e = connect_from_env(&env, &quick).unwrap_err();
    assert!(
        matches!(e, CommError::Store { failure: StoreFailure::Unreachable, ref reason, .. } if reason.contains("hosted by rank 0")),
        "{e}"
    );
}

/// One rank as a process: started by `ranks_as_processes_find_each_other`
/// with a launcher's variables; reads them, joins the store, exchanges.
#[test]
#[ignore = "a rank process, started by ranks_as_processes_find_each_other"]
fn rank_process() {
    let env = LaunchEnv::from_process_env().unwrap();
    let rdzv = connect_from_env(&env, &options()).unwrap();
    let values = exchange(&*rdzv.store(), env.rank, env.world_size);
    let joined: Vec<String> = values.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect();
    // Rank 0 hosts the store: it leaves last.
    rdzv.store().add("left", 1).unwrap();
    if rdzv.server().is_some() {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while rdzv.store().get("left", Duration::from_secs(20)).unwrap() != env.world_size.to_string().as_bytes() {
            assert!(std::time::Instant::now() < deadline, "the other ranks did not finish");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    println!("CHILD {} {} saw {}", env.launcher, env.rank, joined.join(","));
}

#[test]
fn ranks_as_processes_find_each_other() {
    let exe = std::env::current_exe().unwrap();
    let world = 3;
    let slurm = |rank: usize, port: u16| -> Vec<(String, String)> {
        [
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", world.to_string()),
            ("SLURM_LOCALID", rank.to_string()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_STEP_TASKS_PER_NODE", world.to_string()),
            ("SLURM_JOB_NODELIST", "localhost,other[01-02]".into()),
            ("MASTER_PORT", port.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    let plain = |rank: usize, port: u16| -> Vec<(String, String)> {
        torchrun_vars(rank, world, port, false).into_iter().collect()
    };
    for (name, vars) in [("env://", &plain as &dyn Fn(usize, u16) -> Vec<(String, String)>), ("Slurm", &slurm)] {
        let port = free_port();
        let children: Vec<_> = (0..world)
            .map(|rank| {
                let mut cmd = std::process::Command::new(&exe);
                cmd.args(["--exact", &this_test!("rank_process"), "--ignored", "--nocapture", "--test-threads", "1"]);
                for k in
                    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"]
                {
                    cmd.env_remove(k);
                }
                cmd.envs(vars(rank, port))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (rank, child) in children.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{name} rank {rank}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
            assert!(stdout.contains(&format!("CHILD {name} {rank} saw 0,1,2")), "{name} rank {rank}: {stdout}");
        }
    }
}

/// Real torchrun (`python -m torch.distributed.run --no-python`, the venv's
/// `$CHORUS_PYTHON`) starts this test binary as its ranks: they join
/// torchrun's agent store as clients.
#[test]
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn rust_ranks_join_torchruns_agent_store() {
    let python = torch_python::torch_python("torch.distributed.run");
    let exe = std::env::current_exe().unwrap();
    let port = free_port().to_string();
    let mut child = std::process::Command::new(&python)
        .args(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", &port, "--no-python"])
        .arg(&exe)
        .args(["--exact", &this_test!("rank_process"), "--ignored", "--nocapture", "--test-threads", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("torchrun did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for rank in 0..2 {
        assert!(stdout.contains(&format!("CHILD torchrun {rank} saw 0,1")), "{stdout}");
    }
}
