#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A tandem checkpoint opens in Hugging Face's `safetensors` (from PyPI), as users of PyTorch, JAX or NumPy open it.

    check_safetensors.py DIR CONSOLIDATED

DIR is a checkpoint directory (fp32 parameters: NumPy has no bfloat16), CONSOLIDATED the file
`tandem_checkpoint consolidate DIR CONSOLIDATED --all` wrote. Every shard and the consolidated file must load with
safetensors.numpy.load_file; the consolidated file must hold every tensor of every array (parameters, master weights,
optimizer state) whole, with the manifest's names and sizes, and the manifest's optimizer options in its metadata; and
the shards' slices must be exactly the consolidated tensors' elements, each element in one slice. Exit 77 (ctest: skipped) where safetensors or NumPy is not installed.
"""
import json
import os
import re
import sys

try:
    import numpy as np
    import safetensors
    from safetensors.numpy import load_file
except ImportError as e:
    print(f"check_safetensors.py: skipped: {e} (python3 -m pip install safetensors numpy)")
    sys.exit(77)

directory, consolidated = sys.argv[1], sys.argv[2]
with open(os.path.join(directory, "manifest.json")) as f:
    manifest = json.load(f)
names = [t["name"] for t in manifest["tensors"]]
prefixes = [""] + (["master/"] if manifest["param_dtype"] != "fp32" else [])
prefixes += [f"state{k}/" for k in range(manifest["state_count"])]

whole = load_file(consolidated)
expected = {p + n for p in prefixes for n in names}
if set(whole) != expected:
    sys.exit(f"the consolidated file holds {sorted(set(whole) ^ expected)[:5]} unexpectedly, or lacks them")
for t in manifest["tensors"]:
    for p in prefixes:
        if whole[p + t["name"]].shape != (t["numel"],) or whole[p + t["name"]].dtype != np.float32:
            sys.exit(f"{p + t['name']}: shape {whole[p + t['name']].shape}, dtype {whole[p + t['name']].dtype}")

# the optimizer options a load restores, in the file's metadata as in the manifest
with safetensors.safe_open(consolidated, "np") as f:
    metadata = f.metadata()
for key in ("optimizer_groups", "optimizer_group_of"):
    recorded = metadata.get("tandem_" + key)
    if (json.loads(recorded) if recorded is not None else None) != manifest.get(key):
        sys.exit(f"the consolidated file's tandem_{key} is {recorded}; the manifest's {manifest.get(key)}")
if "optimizer_groups" not in manifest:
    sys.exit("the manifest records no optimizer options")

covered = {k: np.zeros(v.shape, dtype=bool) for k, v in whole.items()}
slice_name = re.compile(r"^(.*?)(?:\[(\d+):(\d+)\])?$")
slices = 0
for entry in manifest["files"]:
    shard = load_file(os.path.join(directory, entry["name"]))
    for key, value in shard.items():
        match = slice_name.match(key)
        base = match.group(1)
        begin = int(match.group(2)) if match.group(2) else 0
        end = int(match.group(3)) if match.group(3) else whole[base].shape[0]
        if value.shape != (end - begin,):
            sys.exit(f"{entry['name']}: {key} has shape {value.shape}")
        if not np.array_equal(value.view(np.uint32), whole[base][begin:end].view(np.uint32)):
            sys.exit(f"{entry['name']}: {key} differs from the consolidated {base}[{begin}:{end}]")
        if covered[base][begin:end].any():
            sys.exit(f"{entry['name']}: {key} overlaps another slice")
        covered[base][begin:end] = True
        slices += 1
missing = [k for k, c in covered.items() if not c.all()]
if missing:
    sys.exit(f"no shard holds every element of {missing[:5]}")
print(f"safetensors {safetensors.__version__}: {len(manifest['files'])} shards ({slices} slices) and the consolidated "
      f"file ({len(whole)} tensors) agree bit for bit")
