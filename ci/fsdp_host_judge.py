#!/usr/bin/env python3
"""Judges FSDP's host time per group and step on a GPU (ci/gpu-check.sh fsdp-host).

    python3 ci/fsdp_host_judge.py LIMIT_US FILE...

Each FILE is a `chorus train` summary.json (its
`fsdp_host_overhead_per_group_per_step_s`) or the log of
`host_path` (fsdp/examples/host_path.rs; its JSON line's
`host_us_per_group_step`). Prints each number and fails (exit 1) when one
is above LIMIT_US, or when a file holds no such number (the run failed).
Standard library only; a file, not a here-document (gpu-check.sh's `run`
gives its command /dev/null as standard input).
"""
import json
import sys


def host_us(path):
    """FSDP host µs per group and step recorded in `path`, or None."""
    with open(path) as f:
        text = f.read()
    try:
        summary = json.loads(text)
        if isinstance(summary, dict) and "fsdp_host_overhead_per_group_per_step_s" in summary:
            return summary["fsdp_host_overhead_per_group_per_step_s"] * 1e6
    except ValueError:
        pass
    found = None
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "host_us_per_group_step" in row:
                found = row["host_us_per_group_step"]
    return found


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    limit = float(argv[1])
    failed = False
    for path in argv[2:]:
        try:
            us = host_us(path)
        except OSError as e:
            print(f"{path}: unreadable ({e}): the run failed, see its log")
            failed = True
            continue
        if us is None or us != us:
            print(f"{path}: no FSDP host time per group and step in it: the run failed, see its log")
            failed = True
            continue
        verdict = "ok" if us <= limit else "ABOVE the limit"
        print(f"{path}: FSDP host {us:.1f} µs per group and step (limit {limit:g} µs): {verdict}")
        failed |= us > limit
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
