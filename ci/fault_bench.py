#!/usr/bin/env python3
"""The measuring half of ci/fault-bench.sh (plain Python, stdlib only): it
reads the runs' summary.json files and prints a table and one JSON object
per measurement, and it runs the restart measurement (the launcher, the
kill, the polling of progress.json) itself, where timing needs to be exact.

    ci/fault_bench.py saves DIR GOAL
        DIR/<mode>-<round>/{out/summary.json,wall_s} for the modes
        nosave, blocking and async: per run, per mode, the ratios.
    ci/fault_bench.py restart --ck DIR --out DIR --pid-file F --at-step N
                              --timeout S --log F --backend B --goal S -- CMD...
        runs CMD (a `chorus launch`), kills the pid in F with SIGKILL once
        DIR/progress.json says N steps are done, and reports what the
        fault cost from the samples, the launcher's log and summary.json.

Every JSON line starts with `{` and carries "bench" (what it measures).
Exits 1 with a message on stderr when a run's outputs are missing or say
it failed.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

MODES = ("nosave", "blocking", "async")
LABEL = {"nosave": "no save", "blocking": "blocking save", "async": "async save"}


def fail(msg):
    print(f"fault-bench: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def emit(obj):
    print(json.dumps(obj, sort_keys=False), flush=True)


def load_summary(path):
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: {e}")
    if s.get("status") != "completed":
        fail(f"{path}: status {s.get('status')!r}, not completed: {s.get('error')}")
    return s


def ms(x):
    return None if x is None else round(x * 1e3, 2)


def median(xs):
    return statistics.median(xs) if xs else None


# --- 1. step time with saves -------------------------------------------------


def one_run(d, mode, rnd):
    s = load_summary(os.path.join(d, "out", "summary.json"))
    steps = s.get("step_times_s") or []
    if not steps:
        fail(f"{d}: summary.json has no step_times_s")
    saves = s.get("saves") or []
    if mode != "nosave" and not saves:
        fail(f"{d}: a run with --save-every recorded no saves")
    if saves and any(bool(v.get("asynchronous")) != (mode == "async") for v in saves):
        fail(f"{d}: saves of another kind than {mode}: {saves}")
    with open(os.path.join(d, "wall_s")) as f:
        wall = float(f.read())
    blocked = sum(v["blocked_s"] for v in saves)
    return {
        "mode": mode,
        "round": rnd,
        "steps": len(steps),
        "step_times_s": steps,
        "saves": saves,
        "median_step_s": median(steps),
        # What a step cost the run: its own time plus what the saves held it.
        "effective_step_s": (sum(steps) + blocked) / len(steps),
        "blocked_s_total": blocked,
        "wall_s": wall,
    }


def saves_report(args):
    runs = []
    for name in sorted(os.listdir(args.dir)):
        m = re.fullmatch(r"(nosave|blocking|async)-(\d+)", name)
        if m:
            runs.append(one_run(os.path.join(args.dir, name), m.group(1), int(m.group(2))))
    if not runs:
        fail(f"{args.dir}: no runs")
    for r in sorted(runs, key=lambda r: (r["round"], MODES.index(r["mode"]))):
        emit({
            "bench": "save_step_time_run",
            "mode": r["mode"],
            "round": r["round"],
            "steps": r["steps"],
            "median_step_ms": ms(r["median_step_s"]),
            "effective_step_ms": ms(r["effective_step_s"]),
            "saves": len(r["saves"]),
            "blocked_ms": [ms(v["blocked_s"]) for v in r["saves"]],
            "wall_s": round(r["wall_s"], 2),
        })
    agg = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            fail(f"no {mode} run")
        steps = [t for r in rs for t in r["step_times_s"]]
        saves = [v for r in rs for v in r["saves"]]
        last_step = max(v["step"] for v in saves) if saves else None
        # An asynchronous save at the run's end waits for its writer: apart.
        mid = [v for v in saves if v["step"] != last_step]
        end = [v for v in saves if v["step"] == last_step]
        a = {
            "bench": "save_step_time",
            "mode": mode,
            "runs": len(rs),
            "steps": len(steps),
            "median_step_ms": ms(median(steps)),
            "effective_step_ms": ms(
                (sum(steps) + sum(v["blocked_s"] for v in saves)) / len(steps)),
            # As in a long run, where the save at the end is one of many: the saves before it.
            "steady_step_ms": ms((sum(steps) + sum(v["blocked_s"] for v in mid)) / len(steps)),
            "median_run_wall_s": round(median([r["wall_s"] for r in rs]), 2),
            "saves": len(saves),
            "median_blocked_ms_per_save": ms(median([v["blocked_s"] for v in mid])),
            "max_blocked_ms_per_save": ms(max((v["blocked_s"] for v in mid), default=None)),
            "median_commit_ms_per_save": ms(median([v["commit_s"] for v in mid])),
            "median_blocked_ms_last_save": ms(median([v["blocked_s"] for v in end])),
            "staged_bytes_per_rank": max((v["staged_bytes"] for v in saves), default=0),
        }
        agg[mode] = a
    base = agg["nosave"]
    for mode in ("blocking", "async"):
        a = agg[mode]
        a["median_step_vs_nosave"] = round(a["median_step_ms"] / base["median_step_ms"], 3)
        a["effective_step_vs_nosave"] = round(a["effective_step_ms"] / base["effective_step_ms"], 3)
        a["steady_step_vs_nosave"] = round(a["steady_step_ms"] / base["steady_step_ms"], 3)
    goal = args.goal
    a = agg["async"]
    a["goal"] = goal
    a["goal_met_median_step"] = a["median_step_vs_nosave"] <= goal
    a["goal_met_steady_step"] = a["steady_step_vs_nosave"] <= goal
    a["goal_met_effective_step"] = a["effective_step_vs_nosave"] <= goal

    print()
    print("1. step time: no save / blocking saves / asynchronous saves (rank 0's steps, all rounds)")
    print(f"   {'mode':<14} {'runs':>4} {'steps':>5} {'median step':>12} {'x no-save':>9} "
          f"{'step+held':>10} {'x no-save':>9} {'+last save':>10} {'x no-save':>9} "
          f"{'held/save':>10} {'max held':>9} {'last save':>10}")
    for mode in MODES:
        a = agg[mode]
        ratio = lambda k: "" if mode == "nosave" else f"{a[k]:.3f}"
        held = lambda k: "-" if a[k] is None else f"{a[k]:.1f} ms"
        print(f"   {LABEL[mode]:<14} {a['runs']:>4} {a['steps']:>5} {a['median_step_ms']:>9.1f} ms "
              f"{ratio('median_step_vs_nosave'):>9} {a['steady_step_ms']:>7.1f} ms "
              f"{ratio('steady_step_vs_nosave'):>9} {a['effective_step_ms']:>7.1f} ms "
              f"{ratio('effective_step_vs_nosave'):>9} {held('median_blocked_ms_per_save'):>10} "
              f"{held('max_blocked_ms_per_save'):>9} {held('median_blocked_ms_last_save'):>10}")
    print("   step+held: the steps' time plus what the saves before the run's last held them, per step (as in a")
    print("   long run); +last save: with the last too (an asynchronous one at the run's end waits for its")
    print("   writer); held/save, max held: the saves before the last")
    verdict = lambda ok: "met" if ok else "NOT met"
    print(f"   goal async/no-save <= {goal}: median step {a['median_step_vs_nosave']:.3f} "
          f"({verdict(a['goal_met_median_step'])}), step+held {a['steady_step_vs_nosave']:.3f} "
          f"({verdict(a['goal_met_steady_step'])}), +last save {a['effective_step_vs_nosave']:.3f} "
          f"({verdict(a['goal_met_effective_step'])})")
    print()
    for mode in MODES:
        emit(agg[mode])


# --- 2. what a fault costs ---------------------------------------------------


def read_progress(path):
    try:
        with open(path) as f:
            p = json.load(f)
        return int(p["step"]), int(p["at_us"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def now_us():
    return time.time_ns() // 1000


def alive(pid):
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def train_pid(pid_file):
    """The rank's pid from the wrapper's file, if it is that `chorus train`."""
    try:
        with open(pid_file) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"train" in argv else None


def stop_group(proc, grace):
    """Stops the launcher's session: SIGTERM, then SIGKILL after `grace`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def restart(args):
    progress = os.path.join(args.ck, "progress.json")
    deadline = time.monotonic() + args.timeout
    with open(args.log, "wb") as log:
        started = now_us()
        # Its own session, so that a run past the deadline is stopped whole.
        proc = subprocess.Popen(args.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def stopped(sig, _frame):
            stop_group(proc, 3)
            fail(f"stopped by signal {sig}; the launched job was stopped")

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stopped)
        samples, last, kill_us, victim = [], None, None, None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                stop_group(proc, 3)
                fail(f"the launched job ran past --timeout {args.timeout} s (log: {args.log})")
            p = read_progress(progress)
            if p is not None and p != last:
                last = p
                samples.append(p)
            if kill_us is None and p is not None and p[0] >= args.at_step:
                victim = train_pid(args.pid_file)
                if victim is None:
                    stop_group(proc, 3)
                    fail(f"step {p[0]} reached but no rank's pid in {args.pid_file}")
                kill_us = now_us()
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.005)
        ended = now_us()
    rc = proc.returncode
    with open(args.log, errors="replace") as f:
        text = f.read()
    if kill_us is None:
        fail(f"the job ended (exit {rc}) before step {args.at_step}: nothing was killed (log: {args.log})")
    if rc != 0:
        sys.stderr.write(text[-4000:])
        fail(f"the launched job exited {rc} after the kill (log above)")
    s = load_summary(os.path.join(args.out, "summary.json"))
    r = s.get("restart") or {}
    resumed = (r.get("resumed_from") or {}).get("step")
    prev = r.get("previous_attempt") or {}
    if r.get("restart_count") != 1 or resumed is None or not prev:
        fail(f"summary.json's restart does not say one restart from a checkpoint: {r}")
    # The new attempt's rank 0 writes progress.json at its start (after the
    # checkpoint's load) with the step resumed from, then after each step;
    # the old attempt's records are all past that step.
    after = [(st, at) for st, at in samples if at > kill_us]
    start_rec = next((at for st, at in after if st == resumed), None)
    first = next(((st, at) for st, at in after if st > resumed and start_rec is not None and at >= start_rec), None)
    # When the new attempt's rank 0 resolved --resume auto (its process running).
    # (The previous attempt's last record, which it read, plus the time it says since.)
    proc_start = None
    reached_at = next((at for st, at in reversed(samples)
                       if st == prev.get("reached_step") and (start_rec is None or at < start_rec)), None)
    if prev.get("seconds_from_its_last_step_to_this_start") is not None and reached_at is not None:
        proc_start = reached_at + prev["seconds_from_its_last_step_to_this_start"] * 1e6
    attempts = re.findall(r"attempt (\d+): (failed|succeeded) after ([0-9.]+) s", text)
    sec = lambda a, b: None if a is None or b is None else round((b - a) / 1e6, 3)
    save_every = s.get("config", {}).get("save_every")
    steps = s.get("config", {}).get("steps")
    row = {
        "bench": "restart_after_kill",
        "backend": args.backend,
        "killed": "rank 1 (SIGKILL)" if args.backend == "ucx" else "the process of both sim ranks (SIGKILL)",
        "killed_after_step": max((st for st, at in samples if at <= kill_us), default=None),
        "save_every": save_every,
        "resumed_from_step": resumed,
        "lost_steps": prev.get("lost_steps"),
        "lost_seconds": prev.get("lost_seconds"),
        "kill_to_new_process_s": sec(kill_us, proc_start),
        "kill_to_new_attempt_loaded_s": sec(kill_us, start_rec),
        "kill_to_first_step_s": sec(kill_us, first[1] if first else None),
        "first_step_of_new_attempt": first[0] if first else None,
        "load_s": sec(proc_start, start_rec),
        "first_step_s": (s.get("step_times_s") or [None])[0],
        "seconds_from_last_step_to_start": prev.get("seconds_from_its_last_step_to_this_start"),
        "attempts": [{"attempt": int(a), "result": res, "seconds": float(t)} for a, res, t in attempts],
        "finished": rc == 0 and s.get("status") == "completed" and len(s.get("losses", [])) == steps,
        "launch_wall_s": sec(started, ended),
        "goal_kill_to_first_step_s": args.goal,
    }
    row["goal_met"] = (row["kill_to_first_step_s"] is not None and row["load_s"] is not None
                       and row["kill_to_first_step_s"] - row["load_s"] <= args.goal)
    row["lost_within_save_interval"] = (row["lost_steps"] is not None and save_every is not None
                                        and row["lost_steps"] <= save_every)
    f = lambda v, unit=" s": "?" if v is None else f"{v}{unit}"
    if row["first_step_of_new_attempt"] == resumed + 1:
        first_note = f"itself {f(ms(row['first_step_s']), ' ms')}"
    else:
        # progress.json is polled every 5 ms: steps shorter than that can pass unseen.
        first_note = "the first seen: the steps before it were shorter than the 5 ms poll"
    print()
    print(f"2. a fault with restarts on one host ({args.backend}: {row['killed']}, --max-restarts 1)")
    print(f"   killed after step {row['killed_after_step']}; resumed from step {resumed} "
          f"(save every {save_every}): {row['lost_steps']} step(s) lost ({f(row['lost_seconds'])})")
    print(f"   kill -> new attempt's rank 0 running:     {f(row['kill_to_new_process_s'])}")
    print(f"   kill -> checkpoint loaded (its start):    {f(row['kill_to_new_attempt_loaded_s'])}"
          f"  (of it, process start to loaded: {f(row['load_s'])})")
    print(f"   kill -> first step of the next attempt:   {f(row['kill_to_first_step_s'])}"
          f"  (step {row['first_step_of_new_attempt']}, {first_note})")
    for a in row["attempts"]:
        print(f"   attempt {a['attempt']}: {a['result']} after {a['seconds']} s")
    print(f"   job finished: {'yes' if row['finished'] else 'NO'}; goal <= {args.goal} s plus the load "
          f"(kill to first step, less process start to loaded): {'met' if row['goal_met'] else 'NOT met'}; "
          f"lost <= save interval: {'yes' if row['lost_within_save_interval'] else 'NO'}")
    print()
    emit(row)
    if not row["finished"]:
        fail("the job did not finish after the restart")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd_name", required=True)
    a = sub.add_parser("saves")
    a.add_argument("dir")
    a.add_argument("goal", type=float)
    a.set_defaults(func=saves_report)
    b = sub.add_parser("restart")
    b.add_argument("--ck", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--pid-file", required=True)
    b.add_argument("--at-step", type=int, required=True)
    b.add_argument("--timeout", type=float, required=True)
    b.add_argument("--log", required=True)
    b.add_argument("--backend", required=True)
    b.add_argument("--goal", type=float, default=15.0)
    b.add_argument("cmd", nargs=argparse.REMAINDER)
    b.set_defaults(func=restart)
    args = ap.parse_args()
    if getattr(args, "cmd", None) is not None and args.cmd_name == "restart":
        if args.cmd and args.cmd[0] == "--":
            args.cmd = args.cmd[1:]
        if not args.cmd:
            ap.error("restart: the command after --")
    args.func(args)


if __name__ == "__main__":
    main()
