"""The learning rate of every step under torch.optim.lr_scheduler.LambdaLR
with torchtitan's linear_warmup_stable_decay factor, written out here (as
torchtitan's components/lr_scheduler.py computes it, decay over all steps
after the warmup, no stable phase), printed as JSON: the reference
cli/tests/lr_torch.rs compares `chorus train`'s summary.json `lrs` with.

usage: lr_schedule_torch.py STEPS WARMUP DECAY(none|linear|cosine) LR MIN_LR
"""

import functools
import json
import math
import sys

import torch


def linear_warmup_stable_decay(current_step, warmup_steps, stable_steps, decay_steps, lr_decay_type, lr_min):
    warmup_stable_steps = warmup_steps + stable_steps
    if current_step >= warmup_stable_steps + decay_steps:
        current_step = warmup_stable_steps + decay_steps
    if current_step < warmup_steps:
        return float((current_step + 1) / (warmup_steps + 1))
    if current_step < warmup_stable_steps or decay_steps == 0:
        return 1.0
    progress = float((current_step + 1) - warmup_stable_steps) / (decay_steps + 1)
    if lr_decay_type == "linear":
        curr_adjustment = 1 - progress
    elif lr_decay_type == "cosine":
        curr_adjustment = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(lr_decay_type)
    return lr_min + (1 - lr_min) * curr_adjustment


def main():
    steps, warmup, decay, lr, min_lr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
    # "none": warmup, then the base lr (no decay steps).
    decay_steps = 0 if decay == "none" else steps - warmup
    stable_steps = steps - warmup - decay_steps
    fn = functools.partial(
        linear_warmup_stable_decay,
        warmup_steps=warmup,
        stable_steps=stable_steps,
        decay_steps=decay_steps,
        lr_decay_type=decay,
        lr_min=min_lr / lr,
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    lrs = []
    for _ in range(steps):
        # The lr this step uses, then the step and the scheduler's advance.
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    print(json.dumps(lrs))


if __name__ == "__main__":
    main()
