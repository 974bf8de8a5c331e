//! The TCP store server's memory under hostile connections: `--hostile N`
//! connections each send VALIDATE with the public magic and then an
//! unfinished MULTI_SET of `--mib M` MiB (the code review's case: 60 × 55 MiB
//! grew the launcher's RSS by 3.3 GB), while a good client keeps doing
//! set / get / wait. Prints the process's RSS growth (peak, from `VmHWM`),
//! the server's accounted peak against its budget, how many connections it
//! cut, and the good client's operations and slowest round, as a table and
//! one JSON line.
//!
//! ```sh
//! cargo run --release -p chorus-collectives --example store_memory_bench -- --hostile 60 --mib 55
//! ```

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::bootstrap::tcp::protocol::{encode_request, put_bytes, QueryType, Request, VALIDATION_MAGIC};
use chorus_collectives::bootstrap::{ClientOptions, ServerOptions, Store, TcpStore, TcpStoreServer};

/// A field of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status.lines().find(|l| l.starts_with(field)).with_context(|| format!("no {field}"))?;
    let kib = line.split_whitespace().nth(1).with_context(|| format!("{line:?}"))?;
    Ok(kib.parse()?)
}

/// One hostile connection: VALIDATE, then a MULTI_SET whose values never end.
fn hostile(port: u16, tag: usize, bytes: usize) {
    let Ok(mut s) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)) else { return };
    let _ = s.set_write_timeout(Some(Duration::from_secs(30)));
    let mut head = Vec::new();
    encode_request(&Request::Validate { magic: VALIDATION_MAGIC }, &mut head);
    head.push(QueryType::MultiSet as u8);
    head.extend_from_slice(&8u64.to_le_bytes());
    put_bytes(&mut head, format!("/hostile{tag}").as_bytes());
    head.extend_from_slice(&(8u64 << 20).to_le_bytes());
    if s.write_all(&head).is_err() {
        return;
    }
    // Keys and values of 8 MiB, one after another, the last one unfinished.
    let piece = vec![0x5au8; 256 * 1024];
    let mut sent = 0;
    let mut in_value = 0;
    while sent < bytes {
        if in_value == 8 << 20 {
            let mut next = Vec::new();
            put_bytes(&mut next, format!("/hostile{tag}/{sent}").as_bytes());
            next.extend_from_slice(&(8u64 << 20).to_le_bytes());
            if s.write_all(&next).is_err() {
                return;
            }
            in_value = 0;
        }
        if s.write_all(&piece).is_err() {
            return;
        }
        sent += piece.len();
        in_value += piece.len();
    }
    // Hold the request open until the server cuts the connection (or 5 s).
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.read(&mut [0u8; 1]);
}

fn main() -> anyhow::Result<()> {
    let mut hostile_count = 60usize;
    let mut mib = 55usize;
    let mut budget_mib = ServerOptions::default().max_memory_bytes >> 20;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> anyhow::Result<usize> {
            args.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| format!("{name} takes a number"))
        };
        match a.as_str() {
            "--hostile" => hostile_count = value("--hostile")?,
            "--mib" => mib = value("--mib")?,
            "--budget-mib" => budget_mib = value("--budget-mib")?,
            other => bail!("unknown argument {other} (--hostile N, --mib M, --budget-mib B)"),
        }
    }
    if hostile_count > 1000 || mib > 64 || budget_mib == 0 || budget_mib > 4096 {
        bail!("--hostile at most 1000, --mib at most 64 (the request limit), --budget-mib 1..=4096");
    }
    let options = ServerOptions {
        max_memory_bytes: budget_mib << 20,
        log: Some(Arc::new(|_: &str| {})),
        ..ServerOptions::default()
    };
    let server = TcpStoreServer::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), options)?;
    let port = server.port();
    let good = TcpStore::connect("127.0.0.1", port, ClientOptions::default())?;
    good.set("warm", b"up")?;
    let rss_before = status_kib("VmRSS:")?;
    let hwm_before = status_kib("VmHWM:")?;

    let stop = Arc::new(AtomicBool::new(false));
    let good_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || -> anyhow::Result<(u64, Duration)> {
            let (mut ops, mut slowest) = (0u64, Duration::ZERO);
            while !stop.load(Ordering::Acquire) {
                let t = Instant::now();
                let key = format!("good/{}", ops % 64);
                good.set(&key, &ops.to_le_bytes())?;
                if good.get(&key, Duration::from_secs(30))? != ops.to_le_bytes() {
                    bail!("the good client read back another value");
                }
                good.wait(&[&key], Duration::from_secs(30))?;
                slowest = slowest.max(t.elapsed());
                ops += 1;
            }
            Ok((ops, slowest))
        })
    };
    let start = Instant::now();
    let threads: Vec<_> = (0..hostile_count).map(|i| std::thread::spawn(move || hostile(port, i, mib << 20))).collect();
    for t in threads {
        let _ = t.join();
    }
    let hostile_s = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    let (rounds, slowest) = good_thread.join().map_err(|_| anyhow::anyhow!("the good client panicked"))??;
    let hwm = status_kib("VmHWM:")?;
    let stats = server.stats();
    let growth_mib = hwm.saturating_sub(hwm_before.max(rss_before)) as f64 / 1024.0;
    println!(
        "hostile connections      {hostile_count} x {mib} MiB unfinished multi-set ({} MiB asked for)",
        hostile_count * mib
    );
    println!("server budget            {budget_mib} MiB");
    println!("server accounted peak    {:.1} MiB", stats.peak_memory_bytes as f64 / (1 << 20) as f64);
    println!("process RSS growth (peak) {growth_mib:.1} MiB");
    println!("connections cut          {}", stats.cut_over_budget);
    println!("good client              {rounds} rounds of set/get/wait, slowest {:.1} ms", slowest.as_secs_f64() * 1e3);
    println!("hostile phase            {hostile_s:.2} s");
    println!(
        "{{\"bench\":\"store_memory\",\"hostile\":{hostile_count},\"mib_each\":{mib},\"budget_mib\":{budget_mib},\"accounted_peak_bytes\":{},\"rss_growth_mib\":{growth_mib:.1},\"cut\":{},\"good_rounds\":{rounds},\"good_slowest_ms\":{:.1},\"hostile_s\":{hostile_s:.2}}}",
        stats.peak_memory_bytes,
        stats.cut_over_budget,
        slowest.as_secs_f64() * 1e3
    );
    if stats.peak_memory_bytes > budget_mib << 20 {
        bail!("the server went over its budget");
    }
    Ok(())
}
