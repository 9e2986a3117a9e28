"""What the EAGLE-3 peer runners (``heads_speculators.py``, ``heads_specforge.py``) share: the options they take in
compound's ``train-heads`` names and defaults, the peer commands' environment, running a command into a log, the error
a failed run's log ends with, and ``--out/result.json``'s opening and close."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import heads_data

BIN = Path(sys.executable).parent  # the venv's console scripts (speculators, specforge, torchrun)


def parser(doc: str) -> argparse.ArgumentParser:
    """A runner's parser (described by the first paragraph of ``doc``) with the shared options; it adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    heads_data.add_data_options(ap)
    ap.add_argument("--aux-layers", default=None, help="comma-separated; must be the cache's (default: the cache's)")
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=6 * 3600)
    return ap


def start(args, peer: str, *packages: str, **env: str) -> tuple[Path, dict, dict]:
    """(``--out``, made; the peer commands' environment: no GPU, ``--threads`` threads, plus ``env``; result.json's
    opening: the peer, the versions of it, torch, transformers and ``packages``, the load average)."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", **env)
    result = {"peer": peer, "version": version(peer), **{p: version(p) for p in ("torch", "transformers", *packages)},
              "load_avg_at_start": os.getloadavg()}
    return out, env, result


def check_aux_layers(args, aux: list[int]) -> None:
    """Refuse an ``--aux-layers`` other than the cache's ``aux`` (the converted data fixes them)."""
    if args.aux_layers and [int(i) for i in args.aux_layers.split(",")] != aux:
        raise SystemExit(f"--aux-layers {args.aux_layers} != the cache's aux layers {aux}")


def run(cmd: list[str], log: Path, env: dict, timeout: float, cwd: Path | None = None) -> tuple[int, float]:
    """(exit status, 124 on timeout; seconds) of ``cmd`` with its output in ``log`` (after a ``$ cmd`` line)."""
    started = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                cwd=cwd).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - started


def error_tail(log: Path, lines: int = 12) -> str:
    """The exception line of a failed run's log (the last ``SomeError: message`` line that is not torchrun's own
    ChildFailedError; rich tracebacks box their frames, the message follows the box), else its last lines."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    found = [m.group(1) for line in text if (m := re.match(r"^(?:\[rank\d+\]: )?([\w.]*(?:Error|Exception)\b.*)", line))
             and "ChildFailedError" not in line]
    if found:
        return found[-1]
    plain = [line for line in text if line.strip() and not line.startswith(("│", "╭", "╰"))]
    return "\n".join(plain[-lines:])


def finish(result: dict, out: Path, started: float) -> None:
    """Close ``result`` (seconds since ``started``, load average); write it to ``out/result.json`` and stdout."""
    result["seconds_total"] = round(time.perf_counter() - started, 1)
    result["load_avg_at_end"] = os.getloadavg()
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result, indent=1, default=str))


def version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
