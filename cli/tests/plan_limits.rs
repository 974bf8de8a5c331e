//! `chorus plan` under an 8 GB address-space limit (`ulimit -v 8000000`,
//! as a login node or a container may impose): the largest world it takes
//! plans in bounded time with two threads; sizes past its own limits are
//! refused by name with exit status 2; a plan that does not fit exits 1
//! and says so. Issue 35: thread creation failed near 6,650 of 8,192 ranks
//! and the run hung or aborted. (The model is named where the case is the
//! Llama's: the job's default is `chorus train`'s, the transformer.)

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{chorus_path, run_bounded, text};

/// `chorus plan ARGS` under `ulimit -v 8000000` (kilobytes), through `sh`.
fn limited(args: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(format!("ulimit -v 8000000 && exec {} plan {args}", chorus_path()));
    cmd
}

#[test]
fn the_largest_world_plans_in_bounded_memory_and_time() {
    let t0 = Instant::now();
    let out = run_bounded(&mut limited("--gpus 8192 --gpu h100-sxm"), Duration::from_secs(60));
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("ranks run             0 and 8191"), "{stdout}");
    assert!(stdout.contains("every rank issues the same collectives"), "{stdout}");
    println!("8,192 ranks under ulimit -v 8000000: {:.2} s", t0.elapsed().as_secs_f64());
    // HSDP across 1,024 nodes and a Llama of 64 layers: still two ranks.
    let out = run_bounded(
        &mut limited("--model llama --gpus 8192 --hsdp 1024 --layers 64 --gpu h200 --kernels chorus"),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
}

#[test]
fn sizes_past_the_planners_limits_are_refused_by_name() {
    for (args, says) in [
        ("--model llama --gpus 8 --layers 65536", "at most 4096 layers"),
        ("--gpus 8193", "--gpus 8193"),
        ("--model llama --gpus 8 --layers 2048 --batch 32 --micro-batches 32", "stage runs"),
        ("--model llama --gpus 1 --vocab 16777216 --d-model 4096 --heads 32", "at most 1 GiB"),
    ] {
        let out = run_bounded(&mut limited(args), Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(2), "{args}: {}{}", text(&out.stdout), text(&out.stderr));
        assert!(text(&out.stderr).contains(says), "{args}: {}", text(&out.stderr));
    }
}

#[test]
fn a_plan_that_does_not_fit_exits_1_and_says_so() {
    let out = run_bounded(&mut limited("--model llama --gpus 1 --seq-len 16777216"), Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(1), "{}{}", text(&out.stdout), text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("DOES NOT FIT") && !stdout.contains("tokens/s"), "{stdout}");
}
