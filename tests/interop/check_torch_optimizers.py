#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tandem's AdamW and SGD training on 2 ranks against PyTorch's, and tandem checkpoints resumed by PyTorch.

    check_torch_optimizers.py OPTIMIZER_RUNS OUT

OPTIMIZER_RUNS (tests/interop/optimizer_runs.cpp) trains four tensors on 2 ranks, seven times per optimizer: with the
user's buffers under Replicated, OptimizerSharded and GradientSharded, and with tandem's storage under those and
ParameterSharded. Each run uses two optimizer groups (the biases with other options: AdamW's another lr, betas and eps
and no weight decay; SGD's Nesterov momentum and weight decay in one group, dampened momentum in the other), a linear
lr schedule and the gradients averaged over the ranks (AdamW's clipped to a global norm of 1; SGD's not, so that their
scale shows). It saves at steps 5 and 10 and consolidates each checkpoint with every array. This script writes the same problem for PyTorch (the initial values,
each rank's gradients and the schedule by the same float32 operations, so both sides start from the same bits) as
DistributedDataParallel computes it: the ranks' gradients averaged, torch.nn.utils.clip_grad_norm_, then
torch.optim.AdamW or torch.optim.SGD, with the options this script states (GROUPS). Then, for each run:

  0. The manifests record those options (the lr the schedule's at the step), each tensor's group and the step.
  1. PyTorch from scratch: its parameters and optimizer state (AdamW's exp_avg and exp_avg_sq, SGD's
     momentum_buffer) at steps 5 and 10 are tandem's.
  2. PyTorch resumed from tandem's step-5 file: the parameters, state0/<name> and state1/<name> as that state, the
     manifest's step, and the optimizer groups the manifest records (AdamW's beta1 and beta2 as torch's betas,
     optimizer_group_of as the groups' params); after 5 more steps it is where tandem's step-10 file is.
  3. The seven runs' files of an optimizer are bitwise the same.

"The same" is within a relative difference (the largest difference over the largest magnitude of each array) of
TOLERANCE: the two sides round differently (torch's AdamW divides by sqrt(bias correction) where tandem multiplies
by its inverse, and sums the norm in float32 where tandem sums in double). The largest difference found is printed.
Exit 77 where PyTorch or NumPy is not installed: ctest reports skipped, or failed where TANDEM_TORCH_PYTHON named
this Python.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"check_torch_optimizers.py: cannot run: {e} (Debian: python3-torch)")
    sys.exit(77)

TOLERANCE = 2e-6

# The problem, as tests/interop/optimizer_runs.cpp states it: (name, elements, optimizer group).
TENSORS = [("embed.weight", 700, 0), ("block.bias", 37, 1), ("head.weight", 515, 0), ("head.bias", 9, 1)]
WORLD, STEPS, SAVE_AT = 2, 10, 5
f32 = np.float32


def lr(group, t):
    """Group `group`'s learning rate at step t (1-based): each decays linearly."""
    base = f32(1e-2) if group == 0 else f32(3e-2)
    return float(base * (f32(1.0) - f32(0.05) * f32(t)))


# Each optimizer's groups at step 1 in tandem's names, and its clipping (None: none), as optimizer_runs.cpp sets them.
GROUPS = {
    "AdamW": [{"lr": lr(0, 1), "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1},
              {"lr": lr(1, 1), "beta1": 0.8, "beta2": 0.995, "eps": 1e-6, "weight_decay": 0.0}],
    "SGD": [{"lr": lr(0, 1), "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": 1},
            {"lr": lr(1, 1), "momentum": 0.8, "dampening": 0.1, "weight_decay": 0.0, "nesterov": 0}],
}
MAX_NORM = {"AdamW": 1.0, "SGD": None}
POLICIES = ["Replicated", "OptimizerSharded", "GradientSharded"]
RUNS = POLICIES + [p + "-owned" for p in POLICIES + ["ParameterSharded"]]  # the user's buffers; tandem's storage


def initial(k, n):
    i = np.arange(n)
    return f32(0.01) * (((i + 13 * k) % 97) - 48).astype(f32)


def target(k, n):
    i = np.arange(n)
    return f32(0.5) - f32(0.002) * ((i + 7 * k) % 89).astype(f32)


def gradient(k, r, t, w):
    i = np.arange(w.size)
    scale = f32(1.0) + f32(0.5) * f32(r)
    noise = (((i * 7 + k * 5 + r * 3 + t) % 11) - 5).astype(f32) * f32(0.01)
    return (w - target(k, w.size)) * scale + noise


def read_safetensors(path):
    """The tensors of a safetensors file (the format's header: a little-endian u64 length, then JSON)."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    body = data[8 + length:]
    out = {}
    for name, entry in header.items():
        if entry["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {entry['dtype']}; this check reads fp32 arrays")
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(body[begin:end], dtype=np.float32).reshape(entry["shape"]).copy()
    return out


def option(value):
    """A recorded option as tandem steps with it: the float32 its shortest decimal text stands for."""
    return float(f32(value))


class AdamW:
    """torch.optim.AdamW from the options tandem records (its beta1 and beta2 are torch's betas), and its state."""
    states = ["exp_avg", "exp_avg_sq"]  # tandem's state0, state1
    max_norm = MAX_NORM["AdamW"]

    @staticmethod
    def make(groups):
        for g in groups:
            o = g.pop("options")
            g.update(lr=option(o["lr"]), betas=(option(o["beta1"]), option(o["beta2"])), eps=option(o["eps"]),
                     weight_decay=option(o["weight_decay"]))
        return torch.optim.AdamW(groups, foreach=False)

    @staticmethod
    def state(step, arrays):
        return {"step": torch.tensor(float(step)), "exp_avg": arrays[0], "exp_avg_sq": arrays[1]}


class SGD:
    """torch.optim.SGD from the options tandem records (its nesterov is 0 or 1), and its state."""
    states = ["momentum_buffer"]  # tandem's state0
    max_norm = MAX_NORM["SGD"]

    @staticmethod
    def make(groups):
        for g in groups:
            o = g.pop("options")
            if o["nesterov"] not in (0, 1):
                sys.exit(f"a recorded nesterov of {o['nesterov']}")
            g.update(lr=option(o["lr"]), momentum=option(o["momentum"]), dampening=option(o["dampening"]),
                     weight_decay=option(o["weight_decay"]), nesterov=o["nesterov"] == 1)
        return torch.optim.SGD(groups, foreach=False)

    @staticmethod
    def state(step, arrays):
        return {"momentum_buffer": arrays[0]}


OPTIMIZERS = {"AdamW": AdamW, "SGD": SGD}


class TorchRun:
    """The problem under PyTorch as DDP runs it: from `values`, with `options` (tandem's names) by group, at `step`
    with the optimizer state `state` (one list of arrays per tensor, in tandem's order) or none."""

    def __init__(self, kind, values, options, group_of, step=0, state=None):
        self.kind = kind
        self.params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
        groups = [{"params": [p for p, of in zip(self.params, group_of) if of == g], "options": o}
                  for g, o in enumerate(options)]
        self.opt = kind.make(groups)
        self.step_count = step
        if state is not None:
            for p, arrays in zip(self.params, state):
                self.opt.state[p] = kind.state(step, [torch.from_numpy(a.copy()) for a in arrays])

    def step(self):
        t = self.step_count + 1
        for g, group in enumerate(self.opt.param_groups):
            group["lr"] = lr(g, t)
        for k, p in enumerate(self.params):
            w = p.detach().numpy()
            total = sum(gradient(k, r, t, w) for r in range(WORLD))  # every rank's gradient, summed
            p.grad = torch.from_numpy((total / f32(WORLD)).astype(f32))
        if self.kind.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.kind.max_norm)
        self.opt.step()
        self.step_count = t

    def arrays(self):
        out = {}
        for (name, _, _), p in zip(TENSORS, self.params):
            state = self.opt.state[p]
            out[name] = p.detach().numpy().copy()
            for k, key in enumerate(self.kind.states):
                out[f"state{k}/{name}"] = state[key].numpy().copy()
        return out


def difference(got, want):
    """The largest relative difference over the arrays of `want` (each: max |got - want| / max |want|)."""
    worst, where = 0.0, ""
    if set(got) != set(want):
        sys.exit(f"the arrays differ: {sorted(set(got) ^ set(want))}")
    for name, w in want.items():
        scale = max(float(np.abs(w).max()), 1e-30)
        d = float(np.abs(got[name].astype(np.float64) - w.astype(np.float64)).max()) / scale
        if np.isnan(d):  # a NaN on either side is as far as it gets
            d = float("inf")
        if d > worst:
            worst, where = d, name
    return worst, where


def check(out, optimizer, run_name, group_of):
    """The checks of one run; returns the largest difference found."""
    kind, where = OPTIMIZERS[optimizer], os.path.join(out, optimizer, run_name)
    files = {t: read_safetensors(os.path.join(where, f"step{t}.safetensors")) for t in (SAVE_AT, STEPS)}
    manifests = {}
    for t in (SAVE_AT, STEPS):
        with open(os.path.join(where, f"step{t}", "manifest.json")) as f:
            manifests[t] = json.load(f)
    mid = manifests[SAVE_AT]
    label = f"{optimizer} {run_name}"
    if mid["optimizer"] != optimizer or mid["step"] != SAVE_AT or manifests[STEPS]["step"] != STEPS:
        sys.exit(f"{label}: the manifests record {mid['optimizer']} at steps {mid['step']} and "
                 f"{manifests[STEPS]['step']}")
    if mid.get("optimizer_group_of") != group_of:
        sys.exit(f"{label}: the manifest's optimizer_group_of is {mid.get('optimizer_group_of')}")
    stated = [{k: option(v) for k, v in dict(o, lr=lr(g, SAVE_AT)).items()} for g, o in enumerate(GROUPS[optimizer])]
    recorded = [{k: option(v) for k, v in o.items()} for o in mid["optimizer_groups"]]
    if recorded != stated:
        sys.exit(f"{label}: the manifest records the groups {recorded}; this script states {stated}")
    worst = 0.0

    def compare(got, t, what):
        nonlocal worst
        d, name = difference(got, files[t])
        print(f"{label}: PyTorch {what} at step {t}: largest relative difference {d:.2e} ({name})")
        worst = max(worst, d)
        if not d <= TOLERANCE:
            sys.exit(f"{label}: PyTorch {what} differs from tandem at step {t} by {d:.2e} in {name}")

    # 1. From scratch, with the options this script states.
    scratch = TorchRun(kind, [initial(k, n) for k, (_, n, _) in enumerate(TENSORS)], GROUPS[optimizer], group_of)
    for t in range(1, STEPS + 1):
        scratch.step()
        if t in files:
            compare(scratch.arrays(), t, "from scratch")

    # 2. Resumed from tandem's step-5 file.
    f = files[SAVE_AT]
    state = [[f[f"state{k}/{name}"] for k in range(len(kind.states))] for name, _, _ in TENSORS]
    resumed = TorchRun(kind, [f[name] for name, _, _ in TENSORS], mid["optimizer_groups"], group_of, step=SAVE_AT,
                       state=state)
    for _ in range(SAVE_AT, STEPS):
        resumed.step()
    compare(resumed.arrays(), STEPS, f"resumed from tandem's step {SAVE_AT}")
    return worst, files


def main():
    runs, out = sys.argv[1], sys.argv[2]
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([runs, out], check=True)
    torch.set_num_threads(1)
    group_of = [g for _, _, g in TENSORS]
    worst = 0.0
    for optimizer in OPTIMIZERS:
        first = None
        for run_name in RUNS:
            d, files = check(out, optimizer, run_name, group_of)
            worst = max(worst, d)
            # 3. Every run saves the same bits.
            if first is None:
                first = (run_name, files)
            for t in files:
                for name, a in files[t].items():
                    if a.tobytes() != first[1][t][name].tobytes():
                        sys.exit(f"{optimizer}: {run_name} and {first[0]} saved different {name} at step {t}")
    shutil.rmtree(out)
    print(f"PyTorch {torch.__version__} agrees with tandem within {worst:.2e} (tolerance {TOLERANCE:.0e}) in "
          f"{len(RUNS)} runs of each of {', '.join(OPTIMIZERS)}, whose checkpoints are bitwise the same")


if __name__ == "__main__":
    main()
