"""``compound eval`` on tiny local models: the report's numbers against what they must be, its schema, its files."""

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import refused, tiny_model
from toolkit.cli import app
from toolkit.evaluate.report import KEYS, SLICE_KEYS
from toolkit.evaluate.slices import SLICES

FAST = ("--windows", "1", "--seq-len", "32", "--new-tokens", "4")
README = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def evaluate(tmp_path, *args, name="report"):
    out = tmp_path / name
    result = run("eval", *args, *FAST, "--output", out)
    assert result.exit_code == 0, result.output
    return json.loads((out / "eval.json").read_text()), out


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("perturbed")
    model = tiny_model("llama")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


def test_a_model_against_itself(tmp_path, tiny_llama_dir):
    report, out = evaluate(tmp_path, "--model", tiny_llama_dir, "--base", tiny_llama_dir)
    assert tuple(report) == KEYS and report["schema"] == "compound.eval/1"
    for row in [*report["slices"].values(), report["overall"]]:
        assert tuple(row) == SLICE_KEYS
    assert set(report["slices"]) == set(SLICES)
    overall = report["overall"]
    assert abs(overall["kl"]) < 1e-6 and overall["kl_above"] == 0
    assert overall["top1_agreement"] == overall["top5_agreement"] == 1.0 and overall["perplexity_ratio"] == 1.0
    assert overall["tokens"] == sum(row["tokens"] for row in report["slices"].values()) == 4 * 31
    assert sum(report["kl_histogram"]["counts"]) == overall["tokens"]
    for check in report["generation"].values():
        assert check["passed"]["model"] == check["passed"]["base"]
    assert report["generation"]["factual"]["same_as_base"] == 1.0
    assert {p.name for p in out.iterdir()} == {"eval.json", "eval.md", "slices.png", "kl_histogram.png"}
    assert all((out / png).read_bytes().startswith(b"\x89PNG") for png in ("slices.png", "kl_histogram.png"))


def test_a_perturbed_model_moves_and_the_report_names_where(tmp_path, tiny_llama_dir, perturbed_dir):
    report, out = evaluate(tmp_path, "--model", perturbed_dir, "--base", tiny_llama_dir, "--no-generation")
    slices = report["slices"]
    assert all(row["kl"] > 0 for row in slices.values()) and report["overall"]["kl"] > 0
    worst = max(slices, key=lambda name: slices[name]["perplexity_ratio"])
    assert report["worst_slice"] == worst and f"Degrades most: **{worst}**" in (out / "eval.md").read_text()
    assert report["generation"] is None and report["acceptance"] is None and report["layer_errors"] is None
    assert sum(report["kl_histogram"]["counts"]) == report["overall"]["tokens"]


def test_without_a_base_only_perplexity(tmp_path, tiny_llama_dir):
    report, out = evaluate(tmp_path, "--model", tiny_llama_dir, "--no-generation")
    assert report["base"] is None and report["worst_slice"] is None and report["kl_histogram"] is None
    assert all(row["perplexity"] > 1 and row["kl"] is None for row in report["slices"].values())
    assert not list(out.glob("*.png"))


def test_a_quantized_checkpoint_reports_its_per_layer_error(tmp_path, tiny_llama_dir):
    checkpoint = tmp_path / "rtn"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32",
               "--output", checkpoint).exit_code == 0
    report, out = evaluate(tmp_path, "--model", checkpoint, "--base", tiny_llama_dir, "--no-generation")
    recorded = json.loads((checkpoint / "compound.json").read_text())["layer_errors"]
    for index, mean in enumerate(report["layer_errors"]["layers"]):
        linears = [e for name, e in recorded["linears"].items() if re.search(rf"\.{index}\.", name)]
        assert len(linears) == 7 and mean == pytest.approx(sum(linears) / 7)
    assert len(report["layer_errors"]["layers"]) == 2 and 0 < report["overall"]["kl"]
    assert (out / "layer_errors.png").is_file() and "Per-layer error" in (out / "eval.md").read_text()


def test_heads_get_an_accepted_length_per_slice(tmp_path, tiny_llama_dir):
    from toolkit.heads.medusa import MedusaConfig, MedusaHeads
    from toolkit.heads.medusa_export import export_medusa

    torch.manual_seed(0)
    heads = export_medusa(MedusaHeads(MedusaConfig(64, 49152, num_heads=2)), tmp_path / "heads",
                          target=str(tiny_llama_dir), target_sha256=None, dtype=torch.float32)
    report, out = evaluate(tmp_path, "--model", tiny_llama_dir, "--heads", heads, "--no-generation",
                           "--head-prompts", "1", "--head-tokens", "4")
    assert "all" in report["acceptance"] and set(report["acceptance"]) <= {"all", *SLICES}
    for row in report["acceptance"].values():
        # untrained heads guess none of the target's tokens (vocabulary 49,152): each step keeps the target's own
        assert row["prompts"] == 1 and row["lossless"] is True and row["tree_accepted_length"] == 1.0
    assert "Speculative decoding with" in (out / "eval.md").read_text()


def test_an_existing_report_is_kept_without_overwrite(tmp_path, tiny_llama_dir):
    out = tmp_path / "report"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    result = run("eval", "--model", tiny_llama_dir, *FAST, "--output", out)
    assert result.exit_code != 0 and "already exists" in result.output
    assert (out / "eval.json").read_text() == "{}"


def test_the_readme_documents_every_key():
    text = README.read_text()
    for key in (*KEYS, *SLICE_KEYS):
        assert f"`{key}`" in text, key


@pytest.fixture
def runs(runs):
    """conftest's ``runs``, checked to be empty again when the case ends."""
    yield runs
    assert list(runs.iterdir()) == []


@pytest.mark.parametrize("args,needle", [
    (["--windows", "0", "--seq-len", "16"], "--windows must be >= 1, got 0"),
    (["--windows", "1", "--seq-len", "-5"], "--seq-len must be >= 2, got -5"),
])
def test_eval_sizes_out_of_range(runs, tiny_llama_dir, args, needle):
    text = refused(run("eval", "--model", tiny_llama_dir, *args, "--no-generation", "-o", runs / "report"), needle)
    assert "lower --seq-len" not in text
