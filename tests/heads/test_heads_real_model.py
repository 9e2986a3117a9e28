"""Real-model smoke run: ``compound train-heads`` on SmolLM2 for a few steps, then ``compound validate --heads``
decodes held-out prompts losslessly in both proposal modes. Slow (~3 CPU-minutes): SmolLM2 loads three times."""

import json

import pytest
from typer.testing import CliRunner

from toolkit.cli import app

pytestmark = pytest.mark.slow


def test_train_heads_then_validate_on_smollm2(tmp_path):
    out = tmp_path / "medusa"
    runner = CliRunner()
    trained = runner.invoke(app, [
        "train-heads", "--model", "smollm2-135m", "-o", str(out), "--num-heads", "3", "--samples", "8",
        "--max-len", "256", "--distill-tokens", "32", "--distill-batch", "8", "--steps", "6", "--batch-size", "4",
        "--micro-batch-size", "4", "--eval-every", "3", "--save-every", "3", "--eval-prompts", "2",
        "--eval-tokens", "16"])
    assert trained.exit_code == 0, trained.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["vocab_size"] == 49152
    manifest = json.loads((out / "compound.json").read_text())
    assert manifest["training"]["examples"] == 8 and manifest["training"]["best_step"] in (3, 6)

    report = tmp_path / "report.json"
    validated = runner.invoke(app, ["validate", "--model", "smollm2-135m", "--heads", str(out), "--prompts", "2",
                                    "--max-new-tokens", "24", "--json", str(report)])
    assert validated.exit_code == 0, validated.output
    reports = json.loads(report.read_text())
    assert [r["mode"] for r in reports] == ["tree", "chain"]
    assert all(r["lossless"] and r["tokens"] > 0 and r["mean_accepted_length"] >= 1.0 for r in reports)
