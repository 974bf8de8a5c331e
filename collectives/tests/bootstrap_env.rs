//! `connect_from_env`: ranks described only by their launcher variables
//! find each other (threads standing in for processes).

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
