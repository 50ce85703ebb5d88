#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The peer of bench_cuda's cuda_adamw/fp32: PyTorch's fused AdamW, torch.optim.AdamW(fused=True), on one flat fp32
parameter of --elements elements on the GPU, with tandem's default options (lr 1e-3, betas 0.9 and 0.999, eps 1e-8,
weight decay 1e-2) and the data bench_cuda's case has: every element of the parameter, the gradient and both moments
0.186 (bytes 0x3e), not zeros. tools/gpu-check's `peer` step runs it and divides
tandem's bytes/s by these.

Timing: CUDA events around --per-event steps (the Python dispatch of one step then overlaps the GPU's work on the one
before, which favours PyTorch), --rounds times after --warmup untimed steps; the median per step is reported. Traffic
is what bench_cuda counts for fp32 parameters: read the parameter, the gradient and both moments, write the parameter
and both moments, 28 bytes per element.

Prints one JSON line: {"name", "elements", "seconds", "bytes_per_second", "torch"}; exit status 2 without a GPU.
"""
import argparse
import json
import statistics
import struct
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-event", type=int, default=5)
    args = ap.parse_args()
    if args.elements < 1 or args.warmup < 0 or args.rounds < 1 or args.per_event < 1:
        ap.error("--elements, --rounds and --per-event must be positive, --warmup at least 0")

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device", "torch": torch.__version__}))
        return 2
    value = struct.unpack("<f", b"\x3e" * 4)[0]  # bench_cuda's cudaMemset(p, 0x3e, ...)
    param = torch.full((args.elements,), value, dtype=torch.float32, device="cuda", requires_grad=True)
    param.grad = torch.full_like(param, value)
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, fused=True)
    with torch.no_grad():
        optimizer.step()  # creates the moments (zeros), which then start as bench_cuda's do
        param.fill_(value)
        for moment in ("exp_avg", "exp_avg_sq"):
            optimizer.state[param][moment].fill_(value)
        for _ in range(args.warmup):
            optimizer.step()
        torch.cuda.synchronize()
        per_step = []
        for _ in range(args.rounds):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.per_event):
                optimizer.step()
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) / 1e3 / args.per_event)
    seconds = statistics.median(per_step)
    traffic = 28 * args.elements
    print(json.dumps({"name": f"torch_adamw_fused/fp32/{args.elements}", "elements": args.elements,
                      "seconds": seconds, "bytes_per_second": traffic / seconds, "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
