"""``compound train-heads --head eagle3`` on CUDA: 30 steps on a random tiny target run there (hidden states,
training, selection by accepted length, export), losslessly, with its steps/s and peak GPU memory recorded."""

import json

import pytest
import torch
from gpu_models import GPU_REASON, LLAMA_TINY, gpu_memory, random_llama, record, sharegpt_stand_in, work_dir
from gpu_models import write_conversations
from typer.testing import CliRunner

from toolkit.cli import app

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)]

STEPS = 30


def test_eagle3_trains_on_cuda(tmp_path, monkeypatch):
    target = random_llama(work_dir(tmp_path) / "llama-tiny", LLAMA_TINY)
    stand_in = sharegpt_stand_in(tmp_path / "site")  # the held-out selection prompts come from the embedded data
    if stand_in is not None:
        monkeypatch.syspath_prepend(str(stand_in))
    data = write_conversations(tmp_path / "chat.jsonl", 400)
    torch.cuda.reset_peak_memory_stats()
    result = CliRunner().invoke(app, [
        "train-heads", "--head", "eagle3", "--model", str(target), "--output", str(tmp_path / "heads"),
        "--dataset", str(data), "--dataset-answers", "--samples", "64", "--max-len", "128", "--draft-vocab", "256",
        "--steps", str(STEPS), "--warmup-steps", "5", "--eval-every", str(STEPS), "--save-every", str(STEPS),
        "--eval-prompts", "2", "--eval-tokens", "16", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    work = tmp_path / "heads.work"
    timings = json.loads(next(work.glob("train-*/timings.json")).read_text())
    lines = [json.loads(line) for line in next(work.glob("train-*/train.jsonl")).read_text().splitlines()]
    manifest = json.loads((tmp_path / "heads" / "compound.json").read_text())
    step_seconds = sum(line["tokens"] / line["tokens_per_s"] for line in lines if line["tokens_per_s"])
    record("heads", {"target": "random Llama, hidden 256, 4 layers", "steps": STEPS,
                     "steps_per_s": round(STEPS / step_seconds, 2),
                     "trained_tokens_per_s": round(lines[-1]["tokens_per_s"]),
                     "training_phase_s": round(timings["training"], 1), "total_s": round(timings["total"], 1),
                     **gpu_memory(),
                     "best_metrics": manifest["training"]["best_metrics"]})
    assert lines[-1]["step"] == STEPS and lines[-1]["loss"] is not None
    assert (tmp_path / "heads" / "model.safetensors").is_file()
