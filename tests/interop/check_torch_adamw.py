#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tandem's AdamW training on 2 ranks against PyTorch's torch.optim.AdamW, and a tandem checkpoint resumed by PyTorch.

    check_torch_adamw.py ADAMW_RUN OUT

ADAMW_RUN (tests/interop/adamw_run.cpp) trains four tensors on 2 ranks, seven times: with the user's buffers under
Replicated, OptimizerSharded and GradientSharded, and with tandem's storage under those and ParameterSharded. Each
run uses AdamW in two optimizer groups (the biases at another lr and without weight decay), a linear lr
schedule, the gradients averaged over the ranks and clipped to a global norm of 1. It saves at steps 5 and 10 and
consolidates each checkpoint with every array. This script writes the same problem for PyTorch (the initial values,
each rank's gradients and the schedule by the same float32 operations, so both sides start from the same bits) as
DistributedDataParallel computes it: the ranks' gradients averaged, torch.nn.utils.clip_grad_norm_, then
torch.optim.AdamW. Then:

  1. PyTorch from scratch: its parameters, exp_avg and exp_avg_sq at steps 5 and 10 are tandem's, in every run.
  2. PyTorch resumed from tandem's step-5 file: the parameters, state0/<name> as exp_avg, state1/<name> as
     exp_avg_sq, the manifest's step, and the optimizer groups the manifest records (beta1 and beta2 as torch's
     betas, optimizer_group_of as the groups' params); after 5 more steps it is where tandem's step-10 file is.
  3. The seven runs' files are bitwise the same.

"The same" is within a relative difference (the largest difference over the largest magnitude of each array) of
TOLERANCE: the two sides round differently (torch's AdamW divides by sqrt(bias correction) where tandem multiplies
by its inverse, and sums the norm in float32 where tandem sums in double). The largest difference found is printed.
Exit 77 (ctest: skipped) where PyTorch or NumPy is not installed.
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
    print(f"check_torch_adamw.py: skipped: {e} (Debian: python3-torch)")
    sys.exit(77)

TOLERANCE = 1e-5

# The problem, as tests/interop/adamw_run.cpp states it: (name, elements, optimizer group).
TENSORS = [("embed.weight", 700, 0), ("block.bias", 37, 1), ("head.weight", 515, 0), ("head.bias", 9, 1)]
WORLD, STEPS, SAVE_AT, MAX_NORM = 2, 10, 5, 1.0
POLICIES = ["Replicated", "OptimizerSharded", "GradientSharded"]
RUNS = POLICIES + [p + "-owned" for p in POLICIES + ["ParameterSharded"]]  # the user's buffers; tandem's storage
f32 = np.float32


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


def lr(group, t):
    base = f32(1e-2) if group == 0 else f32(3e-2)
    return float(base * (f32(1.0) - f32(0.05) * f32(t)))


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


def torch_groups(options, group_of, params):
    """PyTorch's parameter groups from the options tandem records: its beta1 and beta2 are torch's betas."""
    groups = []
    for g, o in enumerate(options):
        groups.append({"params": [p for p, of in zip(params, group_of) if of == g], "lr": option(o["lr"]),
                       "betas": (option(o["beta1"]), option(o["beta2"])), "eps": option(o["eps"]),
                       "weight_decay": option(o["weight_decay"])})
    return groups


class TorchRun:
    """The problem under PyTorch as DDP runs it: from `values`, with `options` (tandem's names) by group."""

    def __init__(self, values, options, group_of, step=0, moments=None):
        self.params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
        self.group_of = group_of
        self.opt = torch.optim.AdamW(torch_groups(options, group_of, self.params), foreach=False)
        self.step_count = step
        if moments is not None:
            for p, (m, v) in zip(self.params, moments):
                self.opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": torch.from_numpy(m.copy()),
                                     "exp_avg_sq": torch.from_numpy(v.copy())}

    def step(self):
        t = self.step_count + 1
        for g, group in enumerate(self.opt.param_groups):
            group["lr"] = lr(g, t)
        for k, p in enumerate(self.params):
            w = p.detach().numpy()
            total = sum(gradient(k, r, t, w) for r in range(WORLD))  # every rank's gradient, summed
            p.grad = torch.from_numpy((total / f32(WORLD)).astype(f32))
        torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        self.opt.step()
        self.step_count = t

    def arrays(self):
        out = {}
        for (name, _, _), p in zip(TENSORS, self.params):
            state = self.opt.state[p]
            out[name] = p.detach().numpy().copy()
            out["state0/" + name] = state["exp_avg"].numpy().copy()
            out["state1/" + name] = state["exp_avg_sq"].numpy().copy()
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


def main():
    run, out = sys.argv[1], sys.argv[2]
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([run, out], check=True)
    torch.set_num_threads(1)
    group_of = [g for _, _, g in TENSORS]
    first = None
    worst = 0.0
    for run_name in RUNS:
        files = {t: read_safetensors(os.path.join(out, run_name, f"step{t}.safetensors")) for t in (SAVE_AT, STEPS)}
        manifests = {}
        for t in (SAVE_AT, STEPS):
            with open(os.path.join(out, run_name, f"step{t}", "manifest.json")) as f:
                manifests[t] = json.load(f)
        mid = manifests[SAVE_AT]
        if mid["step"] != SAVE_AT or manifests[STEPS]["step"] != STEPS:
            sys.exit(f"{run_name}: the manifests record steps {mid['step']} and {manifests[STEPS]['step']}")
        if mid.get("optimizer_group_of") != group_of:
            sys.exit(f"{run_name}: the manifest's optimizer_group_of is {mid.get('optimizer_group_of')}")
        for g, o in enumerate(mid["optimizer_groups"]):
            if option(o["lr"]) != lr(g, SAVE_AT):
                sys.exit(f"{run_name}: group {g}'s recorded lr is {o['lr']}, the schedule's at step 5 {lr(g, SAVE_AT)}")

        # 1. From scratch, with the options of construction (the step-5 ones but the schedule's first lr).
        start = [dict(o, lr=lr(g, 1)) for g, o in enumerate(mid["optimizer_groups"])]
        scratch = TorchRun([initial(k, n) for k, (_, n, _) in enumerate(TENSORS)], start, group_of)
        for t in range(1, STEPS + 1):
            scratch.step()
            if t in files:
                d, name = difference(scratch.arrays(), files[t])
                print(f"{run_name}: PyTorch from scratch at step {t}: largest relative difference {d:.2e} ({name})")
                worst = max(worst, d)
                if not d <= TOLERANCE:
                    sys.exit(f"{run_name}: PyTorch from scratch differs from tandem at step {t} by {d:.2e} in {name}")

        # 2. Resumed from tandem's step-5 file.
        f = files[SAVE_AT]
        resumed = TorchRun([f[name] for name, _, _ in TENSORS], mid["optimizer_groups"], group_of, step=SAVE_AT,
                           moments=[(f["state0/" + name], f["state1/" + name]) for name, _, _ in TENSORS])
        for _ in range(SAVE_AT, STEPS):
            resumed.step()
        d, name = difference(resumed.arrays(), files[STEPS])
        print(f"{run_name}: PyTorch resumed from tandem's step {SAVE_AT}, at step {STEPS}: largest relative difference "
              f"{d:.2e} ({name})")
        worst = max(worst, d)
        if not d <= TOLERANCE:
            sys.exit(f"{run_name}: PyTorch resumed from tandem's step {SAVE_AT} differs at step {STEPS} by {d:.2e} "
                     f"in {name}")

        # 3. Every run saves the same bits.
        if first is None:
            first = (run_name, files)
        for t in files:
            for name, a in files[t].items():
                if a.tobytes() != first[1][t][name].tobytes():
                    sys.exit(f"{run_name} and {first[0]} saved different {name} at step {t}")
    shutil.rmtree(out)
    print(f"PyTorch {torch.__version__} agrees with tandem within {worst:.2e} (tolerance {TOLERANCE:.0e}), "
          f"in {len(RUNS)} runs, whose checkpoints are bitwise the same")


main()
