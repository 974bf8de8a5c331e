#!/usr/bin/env python3
"""Each judge of ci/gpu_judge.py (but `plan`) passes on what a correct run
writes and fails on a perturbed copy of it (standard library only).

    CHORUS_JUDGE_RUNS=DIR python3 -m unittest ci/test_gpu_judge.py

DIR holds two real runs of the same small Llama on sim ranks that
cli/tests/gpu_judge.rs makes, `plain/` and `offload/` (with `--offload`),
each with a `--peak-tflops` so that it reports an MFU; without the variable
the tests of those summaries fail, saying so (cli/tests/gpu_judge.rs runs
this file). The `bench` judge reads a JSON line made here, and
gpu-check.sh's `llama-torch` check is run with a Python that has no torch.
"""
import copy
import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_judge  # noqa: E402


def runs_dir():
    d = os.environ.get("CHORUS_JUDGE_RUNS")
    if not d:
        raise AssertionError("CHORUS_JUDGE_RUNS is not set: run this file through cli/tests/gpu_judge.rs")
    return Path(d)


def load(name):
    with open(runs_dir() / name / "summary.json") as f:
        return json.load(f)


class Judged(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.n = 0

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, obj, text=None):
        self.n += 1
        path = Path(self.tmp.name) / f"{self.n}.json"
        path.write_text(text if text is not None else json.dumps(obj))
        return str(path)

    def verdict(self, judge, *args):
        """The judge's exit status, its printed lines kept out of the test's output."""
        with open(os.devnull, "w") as null:
            out, sys.stdout = sys.stdout, null
            try:
                return judge(*args)
            finally:
                sys.stdout = out


class Mfu(Judged):
    def setUp(self):
        super().setUp()
        self.s = load("plain")
        self.gpus = self.s["config"]["world_size"]

    def judge(self, s, floor=0.0, gpus=None):
        return self.verdict(gpu_judge.mfu, self.write(s), str(gpus or self.gpus), str(floor))

    def test_the_runs_own_mfu_passes(self):
        self.assertIsNotNone(self.s["mfu"], "the run was given --peak-tflops")
        self.assertEqual(self.judge(self.s), 0)

    def test_a_reported_mfu_that_is_not_the_step_times_fails(self):
        s = copy.deepcopy(self.s)
        s["mfu"] *= 1.01
        self.assertEqual(self.judge(s), 1)

    def test_slower_steps_than_reported_fail(self):
        s = copy.deepcopy(self.s)
        s["step_times_s"] = [t * 1.5 for t in s["step_times_s"]]
        self.assertEqual(self.judge(s), 1)

    def test_a_run_below_the_floor_fails(self):
        floor = self.s["mfu"] * 1.5
        self.assertEqual(self.judge(self.s, floor=floor), 1)
        self.assertEqual(self.judge(self.s, floor=self.s["mfu"] * 0.5), 0)

    def test_another_model_or_world_fails(self):
        s = copy.deepcopy(self.s)
        s["config"]["llama"]["intermediate_size"] += 8
        self.assertEqual(self.judge(s), 1, "the parameter count no longer matches")
        s = copy.deepcopy(self.s)
        s["config"]["seq_len"] *= 2
        self.assertEqual(self.judge(s), 1, "other tokens per step")
        self.assertEqual(self.judge(self.s, gpus=self.gpus + 1), 1)

    def test_no_mfu_or_no_summary_fails(self):
        s = copy.deepcopy(self.s)
        s["mfu"] = None
        self.assertEqual(self.judge(s), 1)
        self.assertEqual(self.verdict(gpu_judge.mfu, str(Path(self.tmp.name) / "missing.json"), "1"), 1)
        self.assertEqual(self.verdict(gpu_judge.mfu, self.write(None, "{"), "1"), 1)


class Losses(Judged):
    def setUp(self):
        super().setUp()
        self.plain, self.offload = load("plain"), load("offload")

    def judge(self, a, b, atol="1e-6"):
        return self.verdict(gpu_judge.losses, self.write(a), self.write(b), atol, "no-offload")

    def test_offload_equals_no_offload(self):
        self.assertEqual(self.judge(self.offload, self.plain), 0)

    def test_a_loss_that_differs_fails(self):
        s = copy.deepcopy(self.offload)
        s["losses"][-1] += 1e-5
        self.assertEqual(self.judge(s, self.plain), 1)
        self.assertEqual(self.judge(s, self.plain, atol="1e-4"), 0)

    def test_other_lengths_nan_or_no_steps_fail(self):
        s = copy.deepcopy(self.offload)
        s["losses"] = s["losses"][:-1]
        self.assertEqual(self.judge(s, self.plain), 1)
        nan = self.write(None, json.dumps({"losses": [float("nan")] * len(self.plain["losses"])}))
        self.assertEqual(self.verdict(gpu_judge.losses, nan, nan, "1", "nan"), 1)
        flat = {"losses": [2.0] * 5}
        self.assertEqual(self.judge(flat, flat), 1, "the loss never moved")

    def test_losses_that_rise_alike_pass(self):
        # offload-nccl on 2026-11-26: the MLP's loss rose over 10 steps, with and without offload alike.
        rising = {"losses": [1.0, 1.1, 1.3, 1.2, 1.6]}
        self.assertEqual(self.judge(rising, rising), 0)


class OffloadMemory(Judged):
    def setUp(self):
        super().setUp()
        self.plain, self.offload = load("plain"), load("offload")

    def judge(self, plain, offload):
        return self.verdict(gpu_judge.offload_memory, self.write(plain), self.write(offload))

    def test_the_runs_pass(self):
        self.assertEqual(self.judge(self.plain, self.offload), 0)

    def test_no_host_memory_or_no_device_drop_fails(self):
        s = copy.deepcopy(self.offload)
        s["peak_host_memory_bytes"] = [0 for _ in s["peak_host_memory_bytes"]]
        self.assertEqual(self.judge(self.plain, s), 1)
        s = copy.deepcopy(self.offload)
        s["peak_memory_bytes"] = list(self.plain["peak_memory_bytes"])
        self.assertEqual(self.judge(self.plain, s), 1)
        self.assertEqual(self.judge(self.offload, self.plain), 1, "swapped")


class Bench(Judged):
    ROW = {
        "what": "llama",
        "max_loss_difference": 3e-7,
        "fsdp": {"median_step_time_s": 0.012},
        "plain": {"median_step_time_s": 0.011},
        "ratio": 0.012 / 0.011,
    }

    def judge(self, row):
        log = self.write(None, "a line of the bench's own\n" + json.dumps(row) + "\n")
        return self.verdict(gpu_judge.bench, log)

    def test_equal_losses_pass_and_a_difference_fails(self):
        self.assertEqual(self.judge(self.ROW), 0)
        for bad in [2e-4, float("nan")]:
            self.assertEqual(self.judge(dict(self.ROW, max_loss_difference=bad)), 1, bad)
        self.assertEqual(self.verdict(gpu_judge.bench, self.write(None, "no JSON\n")), 1)


class LlamaTorchCheck(unittest.TestCase):
    def test_a_python_without_torch_fails_the_check(self):
        root = Path(__file__).resolve().parent.parent
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, CHORUS_PYTHON="false", PATH=os.environ.get("PATH", "/usr/bin:/bin"))
            r = subprocess.run(
                ["bash", str(root / "ci/gpu-check.sh"), str(Path(d) / "bin"), str(Path(d) / "results"), "llama-torch"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            summary = (Path(d) / "results/summary.txt").read_text()
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("FAILED  llama-torch: false cannot import torch and transformers", summary)
        self.assertNotIn("skipped", summary)


if __name__ == "__main__":
    unittest.main()
