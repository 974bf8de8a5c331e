"""End-to-end check of `chorus train` against an independent NumPy (f64)
implementation of the same training with PyTorch's semantics: the init
directory is written by numpy.save as a PyTorch user would, chorus trains on
simulated ranks, and the losses and final parameters must agree.

Usage: $CHORUS_PYTHON ci/train_vs_numpy.py <path to the chorus binary> <scratch dir>
(any Python with numpy; ci/test.sh runs the venv's, from ci/python-env.sh)
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np


def write_init(d, dims, steps_in_data, rows, seed):
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    rng = np.random.default_rng(seed)
    for i in range(len(dims) - 1):
        np.save(f"{d}/layers.{i}.weight.npy", rng.uniform(-0.3, 0.3, (dims[i + 1], dims[i])).astype(np.float32))
        np.save(f"{d}/layers.{i}.bias.npy", rng.uniform(-0.3, 0.3, (dims[i + 1],)).astype(np.float32))
    np.save(f"{d}/x.npy", rng.uniform(-1, 1, (steps_in_data, rows, dims[0])).astype(np.float32))
    np.save(f"{d}/y.npy", rng.uniform(-1, 1, (steps_in_data, rows, dims[-1])).astype(np.float32))


def reference(d, layers, steps, optimizer, lr, weight_decay):
    W = [np.load(f"{d}/layers.{i}.weight.npy").astype(np.float64) for i in range(layers)]
    B = [np.load(f"{d}/layers.{i}.bias.npy").astype(np.float64) for i in range(layers)]
    X = np.load(f"{d}/x.npy").astype(np.float64)
    Y = np.load(f"{d}/y.npy").astype(np.float64)
    params = [p for pair in zip(W, B) for p in pair]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    losses = []
    for s in range(steps):
        # Every rank's rows together: the global batch (equal per-rank batches).
        x, y = X[s % len(X)], Y[s % len(Y)]
        acts, zs = [x], []
        for i in range(layers):
            z = acts[-1] @ W[i].T + B[i]
            zs.append(z)
            acts.append(np.maximum(z, 0) if i + 1 < layers else z)
        out = acts[-1]
        losses.append(((out - y) ** 2).sum() / out.size)
        g = 2 * (out - y) / out.size
        grads = [None] * (2 * layers)
        for i in reversed(range(layers)):
            if i + 1 < layers:
                g = g * (zs[i] > 0)
            grads[2 * i] = g.T @ acts[i]
            grads[2 * i + 1] = g.sum(0)
            g = g @ W[i]
        for k, (p, gr) in enumerate(zip(params, grads)):
            if optimizer == "sgd":
                p -= lr * gr
            else:  # torch.optim.AdamW
                b1, b2, eps, t = 0.9, 0.999, 1e-8, s + 1
                p *= 1 - lr * weight_decay
                m[k] = b1 * m[k] + (1 - b1) * gr
                v[k] = b2 * v[k] + (1 - b2) * gr * gr
                p -= lr / (1 - b1**t) * m[k] / (np.sqrt(v[k] / (1 - b2**t)) + eps)
    return losses, params


def check(chorus, scratch, name, dims, world, batch, steps, args, optimizer, lr, weight_decay, tol):
    init, out = f"{scratch}/{name}/init", f"{scratch}/{name}/out"
    write_init(init, dims, 3, world * batch, seed=len(name))
    cmd = [chorus, "train", "--model", "mlp", "--backend", "sim", "--world-size", str(world), "--batch", str(batch),
           "--steps", str(steps), "--init-dir", init, "--out-dir", out, "--optimizer", optimizer] + args
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    losses, params = reference(init, len(dims) - 1, steps, optimizer, lr, weight_decay)
    got = json.load(open(f"{out}/summary.json"))["losses"]
    loss_err = max(abs(a - b) for a, b in zip(got, losses))
    names = [f"layers.{i}.{k}" for i in range(len(dims) - 1) for k in ("weight", "bias")]
    param_err = max(np.abs(np.load(f"{out}/{n}.npy") - p).max() for n, p in zip(names, params))
    ok = loss_err <= tol and param_err <= tol and len(got) == steps
    print(f"{'passed' if ok else 'failed'}  train-vs-numpy/{name}  (max |loss diff| {loss_err:.2e}, max |param diff| {param_err:.2e})")
    return ok


def main():
    chorus, scratch = sys.argv[1], sys.argv[2]
    results = [
        check(chorus, scratch, "sgd-2-ranks", [5, 7, 3], 2, 4, 5, [], "sgd", 0.05, 0.0, 1e-6),
        check(chorus, scratch, "sgd-uneven-3-ranks", [37, 64, 33, 5], 3, 2, 4, [], "sgd", 0.05, 0.0, 1e-6),
        check(chorus, scratch, "adamw-hsdp-2x2", [6, 16, 4], 4, 3, 4, ["--hsdp", "2"], "adamw", 1e-3, 0.01, 1e-5),
        check(chorus, scratch, "sgd-reshard-2-of-4", [9, 12, 2], 4, 2, 3, ["--reshard-after-forward", "2"], "sgd", 0.05, 0.0, 1e-6),
    ]
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
