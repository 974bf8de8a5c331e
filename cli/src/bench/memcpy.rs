//! The memcpy reference: what this machine's memory system does for plain copies.
//!
//! `threads` threads each copy `bytes` bytes from one private buffer to
//! another (read `bytes` + write `bytes` per thread), timed exactly like a
//! collective ([`super::timing`]). The rate is `2 · bytes · threads / time`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::timing::{median_window, timed_loop, HostBarrier, Spans};

/// Measures `threads` concurrent copies of `bytes` bytes each; returns the
/// read+write rate `2 · bytes · threads / median time` in bytes per second.
pub fn measure(threads: usize, bytes: usize, warmup: usize, iters: usize) -> anyhow::Result<f64> {
    let barrier = Arc::new(HostBarrier::new(threads, Duration::from_secs(600)));
    let per_thread: Vec<Spans> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = barrier.clone();
                std::thread::Builder::new().name(format!("memcpy{t}")).spawn_scoped(scope, move || {
                    // Both buffers are written before timing so their pages are mapped.
                    let src = vec![t as u8 | 1; bytes];
                    let mut dst = vec![0u8; bytes];
                    dst.fill(0xff);
                    timed_loop(&barrier, warmup, iters, || {
                        dst.copy_from_slice(std::hint::black_box(&src));
                        std::hint::black_box(&mut dst);
                        Ok(())
                    })
                })
            })
            .collect();
        if handles.iter().any(Result::is_err) {
            // The threads that did start would wait for the missing ones.
            barrier.cancel();
        }
        let mut out = Vec::with_capacity(threads);
        let mut first_error = None;
        for h in handles {
            let spans = match h.context("could not start a memcpy thread") {
                Ok(h) => h.join().map_err(|_| anyhow::anyhow!("a memcpy thread panicked")).and_then(|r| r),
                Err(e) => Err(e),
            };
            match spans {
                Ok(s) => out.push(s),
                Err(e) => {
                    barrier.cancel();
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    })?;
    let time = median_window(&per_thread)?;
    let moved = 2.0 * bytes as f64 * threads as f64;
    let secs = time.as_secs_f64();
    Ok(if secs > 0.0 { moved / secs } else { 0.0 })
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_are_timed() {
        let r = super::measure(2, 1 << 16, 1, 3).unwrap();
        assert!(r > 0.0);
    }
}
