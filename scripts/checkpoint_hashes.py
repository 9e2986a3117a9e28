"""SHA-256 of every tensor of the RTN, GPTQ, AWQ and AWQ+GPTQ checkpoints of SmolLM2 from one fixed calibration.

A refactor must leave these bit-identical. Record the hashes before the change, compare after it:

    python scripts/checkpoint_hashes.py --write hashes.json      # before
    python scripts/checkpoint_hashes.py --check hashes.json      # after: exit 1 on any differing tensor
    python scripts/checkpoint_hashes.py                          # print each checkpoint's tensors and hash only

Every run quantizes SmolLM2-135M-Instruct (embedded GGUF) at W4 g64 with 16×256 ShareGPT calibration tokens (the
same seed), through the ``compound quantize`` command line, so it measures exactly what users run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

RUNS = {  # name: extra command-line arguments
    "rtn": ["--method", "rtn"],
    "gptq": ["--method", "gptq", "--asym"],
    "awq": ["--method", "awq"],
    "awq+gptq": ["--method", "awq+gptq"],
}
COMMON = ["--model", "smollm2-135m", "--bits", "4", "--group-size", "64", "--samples", "16", "--seq-len", "256"]


def tensor_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of each tensor's dtype, shape and bytes, by tensor name, over every safetensors file."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).contiguous()
                digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(-1).view(dtype=torch.uint8).numpy().tobytes())
                out[name] = digest.hexdigest()
    return out


def run_all() -> dict[str, dict[str, str]]:
    """Quantize every run into a temporary directory and hash its tensors."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            output = Path(tmp) / name.replace("+", "_")
            cmd = ["compound", "quantize", *COMMON, *extra, "--output", str(output)]
            print("running", " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            results[name] = tensor_hashes(output)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, help="Write the hashes to this JSON file.")
    mode.add_argument("--check", type=Path, help="Compare with the hashes in this JSON file.")
    args = parser.parse_args()
    results = run_all()
    for name, hashes in results.items():
        combined = hashlib.sha256("".join(f"{k}={v}" for k, v in sorted(hashes.items())).encode()).hexdigest()
        print(f"{name:9s} {len(hashes):4d} tensors  sha256 {combined}")
    if args.write:
        args.write.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if not args.check:
        return 0
    expected = json.loads(args.check.read_text())
    differing = [f"{run}: {tensor}" for run in expected for tensor in sorted(set(expected[run]) | set(results[run]))
                 if expected[run].get(tensor) != results[run].get(tensor)]
    for line in differing[:20]:
        print("differs:", line)
    print("bit-identical" if not differing else f"{len(differing)} tensors differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
