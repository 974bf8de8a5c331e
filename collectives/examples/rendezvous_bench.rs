//! Rendezvous time through a loopback TCPStore: N ranks (threads, each with
//! its own client connection, as processes would have) connect, set their
//! key, and wait for all N keys. Prints one line per repetition, a summary,
//! and the summary as JSON.
//!
//! ```text
//! cargo run --release -p chorus-collectives --example rendezvous_bench -- [--ranks 64] [--reps 10]
//! ```

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::{ClientOptions, Store, TcpStore, TcpStoreServer};

fn arg(name: &str, default: usize) -> anyhow::Result<usize> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args.get(i + 1).ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?.parse()?),
        None => Ok(default),
    }
}

/// One rendezvous: (time until every rank has every key, of which connecting).
fn rendezvous(ranks: usize, rep: usize) -> anyhow::Result<(Duration, Duration)> {
    let server = TcpStoreServer::bind_loopback(0)?;
    let port = server.port();
    let start = Arc::new(Barrier::new(ranks + 1));
    let threads: Vec<_> = (0..ranks)
        .map(|rank| {
            let start = start.clone();
            std::thread::spawn(move || -> anyhow::Result<(Instant, Instant)> {
                start.wait();
                let store = TcpStore::connect("127.0.0.1", port, ClientOptions::default())?;
                let connected = Instant::now();
                store.set(&format!("rep{rep}/rank{rank}"), rank.to_string().as_bytes())?;
                let keys: Vec<String> = (0..ranks).map(|r| format!("rep{rep}/rank{r}")).collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                store.wait(&keys, Duration::from_secs(60))?;
                Ok((connected, Instant::now()))
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    let mut last_connect = t0;
    let mut last_done = t0;
    for t in threads {
        let (connected, done) = t.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
        last_connect = last_connect.max(connected);
        last_done = last_done.max(done);
    }
    Ok((last_done - t0, last_connect - t0))
}

fn main() -> anyhow::Result<()> {
    let ranks = arg("--ranks", 64)?;
    let reps = arg("--reps", 10)?;
    anyhow::ensure!(ranks > 0 && reps > 0, "--ranks and --reps must be positive");
    let mut totals = Vec::new();
    let mut connects = Vec::new();
    for rep in 0..reps {
        let (total, connect) = rendezvous(ranks, rep)?;
        println!(
            "rep {rep}: {ranks} ranks rendezvoused in {:.2} ms (all connected after {:.2} ms)",
            total.as_secs_f64() * 1e3,
            connect.as_secs_f64() * 1e3
        );
        totals.push(total.as_secs_f64());
        connects.push(connect.as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (min, max) = (totals.iter().copied().fold(f64::INFINITY, f64::min), totals.iter().copied().fold(0.0, f64::max));
    let (med, med_connect) = (median(&mut totals), median(&mut connects));
    println!(
        "median {:.2} ms (min {:.2}, max {:.2}); connecting: median {:.2} ms",
        med * 1e3,
        min * 1e3,
        max * 1e3,
        med_connect * 1e3
    );
    println!("{{\"bench\":\"rendezvous\",\"store\":\"tcp-loopback\",\"ranks\":{ranks},\"reps\":{reps},\"median_s\":{med:.6},\"min_s\":{min:.6},\"max_s\":{max:.6},\"median_connect_s\":{med_connect:.6}}}");
    Ok(())
}
