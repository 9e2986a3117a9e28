"""Runs ``peer_logits.py`` jobs in the GPTQModel venv: one process per loader, side by side, so each loader starts
from a fresh interpreter (GPTQModel's loader patches transformers: in a process that has run ``GPTQModel.load``,
transformers' own integration reads MoE checkpoints it refuses in a fresh one) and imports GPTQModel and
transformers once for all its jobs."""

import json
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venvs" / "gptqmodel" / "bin" / "python"
PEER_LOGITS = Path(__file__).with_name("peer_logits.py")


def run_peer_jobs(jobs: dict, tokens: Path, directory: Path, timeout: int = 1800) -> dict:
    """{key: (loader, checkpoint directory)} → {key: (peer_logits.py's report, what the job printed, its logits or
    None where it raised)}; logits and logs are written under ``directory``."""
    outs = {key: directory / f"{'-'.join(map(str, key))}.pt" for key in jobs}
    procs = {
        loader: subprocess.Popen(
            [str(PEER_PYTHON), "-P", str(PEER_LOGITS), "--tokens", str(tokens), "--threads", "1",
             *(arg for key, (job_loader, model) in jobs.items() if job_loader == loader
               for arg in ("--job", loader, str(model), str(outs[key])))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for loader in dict.fromkeys(loader for loader, _ in jobs.values())
    }
    reports = {}
    for loader, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{loader}: {stderr[-6000:]}"
        keys = [key for key, (job_loader, _) in jobs.items() if job_loader == loader]
        reports.update(zip(keys, json.loads(stdout.strip().splitlines()[-1])))
    return {key: (reports[key], Path(reports[key]["log"]).read_text(),
                  None if "error" in reports[key] else torch.load(outs[key], weights_only=True)) for key in jobs}
