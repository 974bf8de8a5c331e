#!/usr/bin/env python3
"""ci/gpu_judge.py's `plan` judge on a run it passes and on perturbed
copies of it, each of which it must fail (standard library only; run by
plan/tests/plan_judge.rs):

    python3 plan/tests/judge/plan_judge.py

The passing case is the H200 run of 2026-11-27 as docs/plan.md records it:
the 110M Llama in bf16 (median step 111.0 ms, FSDP peak 2,020,689,408 B,
nvidia-smi's peak 4,891 MiB) against a plan that predicted it well.
"""
import importlib.util
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
JUDGE = os.path.join(HERE, "..", "..", "..", "ci", "gpu_judge.py")

spec = importlib.util.spec_from_file_location("gpu_judge", JUDGE)
gpu_judge = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_judge)

STEPS = [0.2401, 0.1129, 0.1105, 0.1104, 0.1118, 0.1128, 0.1108, 0.1318, 0.1303, 0.1256, 0.1086, 0.1123, 0.1093, 0.1136, 0.1093, 0.1113, 0.1110, 0.1102, 0.1093, 0.1096]
FSDP_PEAK = 2020689408
SMI_MIB = 4891


def summary(**changes):
    s = {"step_times_s": STEPS, "peak_memory_bytes": [FSDP_PEAK], "losses": [8.3, 2.8]}
    s.update(changes)
    return s


def plan(**changes):
    # 2 % slow on the step, 3 % low on the GPU's memory: inside both tolerances.
    median = sorted(STEPS[3:])[len(STEPS[3:]) // 2]
    p = {
        "gpus": 1,
        "gpu": "h200",
        "kernels": "candle",
        "fits": True,
        "step_time_s": median * 1.02,
        "fsdp_peak_memory_bytes": FSDP_PEAK,
        "gpu_memory_used_bytes_estimate": int(SMI_MIB * 2**20 * 0.97),
    }
    p.update(changes)
    return p


class PlanJudge(unittest.TestCase):
    def judge(self, plan_json, summary_json, samples="4100\n4891\n4500\n"):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, content in [("plan.json", plan_json), ("summary.json", summary_json), ("smi", samples)]:
                path = os.path.join(d, name)
                if content is not None:
                    with open(path, "w") as f:
                        f.write(content if isinstance(content, str) else json.dumps(content))
                paths.append(path)
            out = io.StringIO()
            with redirect_stdout(out):
                rc = gpu_judge.plan(*paths)
            return rc, out.getvalue()

    def test_a_good_prediction_passes(self):
        rc, out = self.judge(plan(), summary())
        self.assertEqual(rc, 0, out)
        self.assertIn("+2.0 %", out)

    def test_the_step_judge_fails_past_25_percent_either_way(self):
        median = sorted(STEPS[3:])[len(STEPS[3:]) // 2]
        for factor, rc in [(1.24, 0), (1.26, 1), (0.76, 0), (0.74, 1), (0.13, 1)]:
            got, out = self.judge(plan(step_time_s=median * factor), summary())
            self.assertEqual(got, rc, f"x{factor}: {out}")
        # The run perturbed instead: 40 % slower steps (the plan 27 % fast).
        got, out = self.judge(plan(), summary(step_times_s=[t * 1.4 for t in STEPS]))
        self.assertEqual(got, 1, out)

    def test_the_fsdp_peak_judge_fails_on_one_byte(self):
        for peak in [FSDP_PEAK + 1, FSDP_PEAK - 1]:
            rc, out = self.judge(plan(fsdp_peak_memory_bytes=peak), summary())
            self.assertEqual(rc, 1, out)
            self.assertIn("must be equal", out)
        rc, out = self.judge(plan(), summary(peak_memory_bytes=[FSDP_PEAK, FSDP_PEAK + 4096]))
        self.assertEqual(rc, 1, out)

    def test_the_memory_judge_fails_past_10_percent_either_way(self):
        for factor, rc in [(1.09, 0), (1.11, 1), (0.91, 0), (0.89, 1)]:
            used = int(SMI_MIB * 2**20 * factor)
            got, out = self.judge(plan(gpu_memory_used_bytes_estimate=used), summary())
            self.assertEqual(got, rc, f"x{factor}: {out}")
        # nvidia-smi perturbed: a peak 20 % above the plan's.
        rc, out = self.judge(plan(), summary(), samples=f"{int(SMI_MIB * 1.2)}\n")
        self.assertEqual(rc, 1, out)

    def test_a_plan_that_says_it_does_not_fit_fails(self):
        rc, out = self.judge(plan(fits=False, step_time_s=None), summary())
        self.assertEqual(rc, 1, out)
        self.assertIn("does not fit", out)

    def test_missing_or_broken_inputs_fail_and_say_so(self):
        for args in [
            (None, summary()),
            (plan(), None),
            ("{not json", summary()),
            (plan(), summary(peak_memory_bytes=[])),
            ({k: v for k, v in plan().items() if k != "fits"}, summary()),
        ]:
            rc, out = self.judge(*args)
            self.assertEqual(rc, 1, f"{args!r}: {out}")
        for samples in [None, "", "no numbers\n"]:
            rc, out = self.judge(plan(), summary(), samples=samples)
            self.assertEqual(rc, 1, out)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() and result.testsRun >= 6 else 1)
