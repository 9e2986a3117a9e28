"""The demo recipe end to end on SmolLM2, pushed to a local Hub: ``compound run recipes/smollm2-135m-demo.yaml`` in a
fresh process pointed at the local server (tests/hub/local_hub.py) with a token. Every step runs, every gate passes
(``validate_required``: ``compound validate`` passed on the checkpoint), and the checkpoint and the heads land as
two repos whose model cards carry the measured results. Slow: 5-16 minutes on a shared 2-core machine."""

import json

import pytest
import yaml

from test_hub_push import hub, run_client  # noqa: F401  (hub is a fixture)

pytestmark = pytest.mark.slow
RECIPE = "recipes/smollm2-135m-demo.yaml"


def test_demo_recipe_runs_and_pushes(hub, tmp_path):  # noqa: F811
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "demo"
    report, done = run_client(hub, tmp_path, "cli", "run", str(root / RECIPE), "--output", str(out), timeout=1800)
    assert report["error"] is None and report["exit_code"] in (0, None), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"], summary
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    assert set(steps.values()) == {"ran"} and list(steps)[-1] == "push", steps
    push = yaml.safe_load((root / RECIPE).read_text())["push"]
    checkpoint_files = hub.files(push["repo"])
    heads_files = hub.files(push["heads_repo"])
    assert "compound.json" in checkpoint_files and "config.json" in heads_files
    card = checkpoint_files["README.md"].decode()
    assert card.startswith("---\n") and "perplexity" in card.lower()
    assert "Degrades most: **" in card and "| json | 8 |" in card  # the eval report's slices and generation checks
    generation = json.loads((out / "eval" / "eval.json").read_text())["generation"]
    assert generation["factual"]["passed"]["base"] >= 0.5  # the float model names Paris, Tokyo, ... in 24 tokens
    assert all(0 <= check["passed"]["model"] <= 1 and len(check["outputs"]["model"]) == check["prompts"]
               for check in generation.values())
    assert "medusa" in heads_files["README.md"].decode().lower()
