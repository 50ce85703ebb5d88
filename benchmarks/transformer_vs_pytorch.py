#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""The tiny transformer on tandem's host ranks against the same model under PyTorch DDP (gloo), side by side.

Both train the same decoder-only transformer (vocab 256, context 128, width 128, 4 layers, 4 heads, MLP 4x,
untied head, GELU tanh, pre-LayerNorm, AdamW, clipping at 1.0) as a byte-level language model on the same
text, with the same global batch (16 windows of 128 bytes), one rank per core and one BLAS thread per rank.
The figure is training throughput: tokens/s over --steps optimizer steps, after --warmup steps that neither side
times; and, from the same run, tandem's and PyTorch's 1 -> 2 rank scaling.

Both sides run their matrix products on the same OpenBLAS kernels, and the script prints which. OpenBLAS 0.3.21
falls back to its generic Prescott (SSE3) kernels on CPUs it does not know (Intel's Xeons with AVX-512 and AMX);
with --blas-core auto (the default) tiny_transformer --blas-info checks better ones in a child process, and when they
pass, both sides run with OPENBLAS_CORETYPE set to them (PyTorch only if it maps the same OpenBLAS file). An
OPENBLAS_CORETYPE already set is used by both sides as it is; --blas-core keep leaves OpenBLAS's own choice.

Usage: benchmarks/transformer_vs_pytorch.py --binary build/release/examples/tiny_transformer [--steps 40]
Needs Debian's python3-torch (a CPU PyTorch) with OpenBLAS installed (libopenblas0), as the tandem example does.
"""
import argparse
import csv
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time


def make_text(path, size=1 << 20):
    """Deterministic English-like text: the throughput does not depend on it, but both sides read the same bytes."""
    words = ("the of and to in is that for it as with was on be by this are at from or an which have not but one "
             "all were when we there can more if out so some what about into than them only other new time could "
             "these two may first then do any like my now over such our man me even most made after also did many "
             "before must through back years where much your way well down should because each just those people "
             "how too little state good very make world still own see men work long get here between both life "
             "being under never day same another know while last might us great old year off come since against "
             "go came right used take three").split()
    seed, out, n = 12345, [], 0
    while n < size:
        seed = (seed * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        w = words[(seed >> 33) % len(words)]
        out.append(w)
        n += len(w) + 1
        if (seed >> 20) % 13 == 0:
            out[-1] += "."
    with open(path, "w") as f:
        f.write(" ".join(out)[:size])


def openblas_of_this_process():
    """The OpenBLAS mapped into this process (after import torch): {"core", "config", "library"}, or None."""
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and "openblas" in os.path.basename(fields[5].strip()).lower():
                paths.append(fields[5].strip())
    for path in dict.fromkeys(paths):  # in order, once each
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle
            corename, config = lib.openblas_get_corename, lib.openblas_get_config
        except (OSError, AttributeError):
            continue
        corename.restype = config.restype = ctypes.c_char_p
        return {"core": corename().decode().strip(), "config": config().decode().strip(),
                "library": os.path.realpath(path)}
    return None


def describe_openblas(blas):
    if blas is None:
        return "no OpenBLAS mapped (see torch.__config__.show() for its BLAS)"
    version = " ".join(blas["config"].split()[:2]) if blas.get("config") else "OpenBLAS"
    return f"{blas['core']} kernels of {version} ({os.path.basename(blas['library'])})"


# --- PyTorch side --------------------------------------------------------------------------------------------------

def pytorch_rank(rank, world, port, args, text_path, queue):
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    C, H, L, V, T = args.width, args.heads, args.layers, 256, args.context

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.mask = torch.tril(torch.ones(T, T, dtype=torch.bool))  # a constant, not state DDP should sync

        def forward(self, x):
            B, Tl, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, Tl, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
            att = att.masked_fill(~self.mask[:Tl, :Tl], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, Tl, C)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f, self.lm_head = nn.LayerNorm(C), nn.Linear(C, V, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = GPT()
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    data = torch.tensor(list(open(text_path, "rb").read()), dtype=torch.long)
    local = args.batch // world
    gen = torch.Generator().manual_seed(args.seed)

    def step(i):
        starts = torch.randint(0, len(data) - T - 1, (args.batch,), generator=gen)[rank * local:(rank + 1) * local]
        x = torch.stack([data[s:s + T] for s in starts])
        y = torch.stack([data[s + 1:s + T + 1] for s in starts])
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for i in range(args.warmup):
        step(i)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        queue.put({"seconds": seconds, "loss": loss, "tokens_per_second": args.steps * args.batch * T / seconds,
                   "blas": openblas_of_this_process()})
    if world > 1:
        dist.destroy_process_group()


def run_pytorch(world, args, text_path):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=pytorch_rank, args=(r, world, port, args, text_path, queue)) for r in range(world)]
    for p in procs:
        p.start()
    import queue as queue_module
    while True:  # a rank that fails must not leave us waiting for the result forever
        try:
            result = queue.get(timeout=1)
            break
        except queue_module.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or all(p.exitcode is not None for p in procs):
                for p in procs:
                    p.kill()
                sys.exit(f"a PyTorch rank failed (exit codes {[p.exitcode for p in procs]}); see its error above")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"PyTorch rank exited with {p.exitcode}")
    return result


# --- tandem side ---------------------------------------------------------------------------------------------------

def tandem_blas(args, env):
    """What tiny_transformer --blas-core MODE --blas-info says: its lines, the kernels it runs on and their library."""
    cmd = [args.binary, "--blas-core", args.blas_core, "--blas-info"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("blas")]
    cores = [m.group(1) for m in (re.match(r"blas: (\S+) kernels", line) for line in lines) if m]
    library = [line.split(": ", 1)[1] for line in lines if line.startswith("blas library: ")]
    config = [line.split(": ", 1)[1] for line in lines if line.startswith("blas config: ")]
    if not cores:
        sys.exit(f"{' '.join(cmd)} did not say which BLAS kernels it runs on:\n{done.stdout}")
    return {"lines": lines, "core": cores[-1], "library": library[-1] if library else "",
            "config": config[-1] if config else "",
            "restarted": any("restarting with OPENBLAS_CORETYPE=" in line for line in lines)}


def run_tandem(ranks, args, text_path, workdir, env):
    out = os.path.join(workdir, f"tandem_{ranks}.csv")
    # --backend host: the comparison is of CPU ranks, also where a CUDA build sees enough GPUs to default to them.
    cmd = [args.binary, "--backend", "host", "--blas-core", args.blas_core, "--text", text_path, "--context",
           str(args.context), "--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads), "--batch", str(args.batch), "--steps",
           str(args.steps + args.warmup), "--untimed-steps", str(args.warmup), "--ranks", str(ranks), "--policy",
           "replicated", "--lr", "3e-4", "--seed", str(args.seed), "--csv", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    with open(out) as f:
        row = next(csv.DictReader(f))
    return {"seconds": float(row["seconds"]), "loss": float(row["final_loss"]),
            "tokens_per_second": float(row["tokens_per_second"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="the tiny_transformer example (a Release build)")
    ap.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the four runs; the median of each is reported")
    ap.add_argument("--blas-core", default="auto",
                    help="keep | auto | NAME: OpenBLAS kernels for both sides, checked by tiny_transformer (default: "
                         "auto, better ones than generic where they pass); an OPENBLAS_CORETYPE already set wins")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    # The same OpenBLAS kernels on both sides: tandem's choice (checked in a child process), given to PyTorch's ranks
    # through OPENBLAS_CORETYPE when PyTorch maps the same OpenBLAS file, so that the check holds for it too.
    tandem_env = dict(os.environ)
    probe = tandem_blas(args, tandem_env)
    for line in probe["lines"]:
        print(line)
    import torch  # noqa: F401  (maps PyTorch's BLAS into this process, to see which file it is)
    torch_blas = openblas_of_this_process()
    same_library = torch_blas is not None and torch_blas["library"] == os.path.realpath(probe["library"] or "-")
    coretype_origin = "set in the environment" if "OPENBLAS_CORETYPE" in os.environ else None
    if coretype_origin is None and probe["restarted"]:
        coretype_origin = f"chosen by tiny_transformer --blas-core {args.blas_core}"
        tandem_env["OPENBLAS_CORETYPE"] = probe["core"]
        if same_library:
            os.environ["OPENBLAS_CORETYPE"] = probe["core"]  # inherited by the spawned PyTorch ranks
        else:
            print(f"warning: PyTorch maps {describe_openblas(torch_blas)}, not tandem's {probe['library']}: "
                  f"it keeps its own kernels", file=sys.stderr)

    # Rounds of all four runs, interleaved, and the median of each: a shared VM's speed drifts by tens of percent
    # from one minute to the next, and interleaving exposes every run to the same drift.
    runs = {"tandem_1": lambda: run_tandem(1, args, text, workdir, tandem_env),
            "tandem_2": lambda: run_tandem(2, args, text, workdir, tandem_env),
            "pytorch_1": lambda: run_pytorch(1, args, text), "pytorch_2": lambda: run_pytorch(2, args, text)}
    samples = {key: [] for key in runs}
    with tempfile.TemporaryDirectory() as workdir:
        text = os.path.join(workdir, "text.txt")
        make_text(text)
        for _ in range(args.rounds):
            for key, run in runs.items():
                samples[key].append(run())
    results = {}
    for key, rows in samples.items():
        rows.sort(key=lambda r: r["tokens_per_second"])
        results[key] = rows[len(rows) // 2] | {"all_tokens_per_second": [r["tokens_per_second"] for r in rows]}
    results["speedup_vs_pytorch_ddp"] = results["tandem_2"]["tokens_per_second"] / results["pytorch_2"]["tokens_per_second"]
    results["tandem_scaling"] = results["tandem_2"]["tokens_per_second"] / results["tandem_1"]["tokens_per_second"]
    results["pytorch_scaling"] = results["pytorch_2"]["tokens_per_second"] / results["pytorch_1"]["tokens_per_second"]
    results["config"] = vars(args) | {"vocab": 256, "mlp_ratio": 4}
    pytorch_blas = results["pytorch_2"].get("blas")
    results["blas"] = {"tandem": {k: probe[k] for k in ("core", "config", "library")}, "pytorch": pytorch_blas,
                       "OPENBLAS_CORETYPE": tandem_env.get("OPENBLAS_CORETYPE"), "origin": coretype_origin}

    coretype = tandem_env.get("OPENBLAS_CORETYPE")
    print(f"\nBLAS: tandem on {describe_openblas(probe)}; PyTorch on {describe_openblas(pytorch_blas)}; "
          + (f"OPENBLAS_CORETYPE={coretype}, {coretype_origin}" if coretype else "OPENBLAS_CORETYPE unset"))
    if pytorch_blas is not None and pytorch_blas["core"].lower() != probe["core"].lower():
        print("warning: the two sides ran on different BLAS kernels: the comparison is not like for like",
              file=sys.stderr)
    print(f"\n{'run (median of ' + str(args.rounds) + ' rounds)':<32} {'tokens/s':>10} {'seconds':>9}")
    for key, name in [("tandem_1", "tandem, 1 rank"), ("tandem_2", "tandem, 2 ranks (Replicated)"),
                      ("pytorch_1", "PyTorch, 1 process"), ("pytorch_2", "PyTorch DDP gloo, 2 processes")]:
        print(f"{name:<32} {results[key]['tokens_per_second']:>10.0f} {results[key]['seconds']:>9.2f}")
    print(f"\ntandem 2 ranks / PyTorch DDP 2 ranks: {results['speedup_vs_pytorch_ddp']:.2f}x (goal >= 1.5x)")
    print(f"tandem scaling 1 -> 2 ranks: {results['tandem_scaling']:.2f}x (goal >= 1.85x); "
          f"PyTorch: {results['pytorch_scaling']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
