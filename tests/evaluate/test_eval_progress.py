"""``compound eval`` shows every phase with counts, decodes the generation checks in batches, prints 95 % intervals
over windows, and titles its plots (the per-layer error on a log axis)."""

import json
import math

import pytest
import torch
from conftest import tiny_model
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.decode import greedy_outputs
from toolkit.decode.batched import greedy_batch
from toolkit.evaluate import report as report_module
from toolkit.evaluate.generation import SETS, prompt_set
from toolkit.evaluate.perplexity import Z95, perplexity_interval, ratio_interval
from toolkit.evaluate.slices import SLICES


def test_every_phase_reports_its_counts_in_order(tmp_path, tiny_llama_dir):
    out = tmp_path / "report"
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, [
        "eval", "--model", str(tiny_llama_dir), "--base", str(tiny_llama_dir), "--windows", "2", "--seq-len", "32",
        "--new-tokens", "3", "--output", str(out), "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    expected = [f"scoring {name}: {row['windows']}/{row['windows']} done" for name, row in report["slices"].items()
                if row["windows"]]
    expected += [f"generation checks: {name}, {model}: {n}/{n} done" for name in SETS
                 for model, n in (("model", len(prompt_set(name))), ("base", len(prompt_set(name))))]
    found = [next(i for i, line in enumerate(lines) if line.endswith(phase)) for phase in expected]
    assert found == sorted(found) and len(expected) >= 7  # a slice at least, then 3 sets × 2 models, in order
    assert lines[0] == "threads: 1 thread (--threads)"
    assert "95 % intervals over windows" in result.output and "×1.000–1.000" in result.output  # paired, itself
    assert "on 1 thread (--threads)" in " ".join(lines)


def test_intervals_in_the_report(tmp_path, tiny_llama_dir):
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_llama_dir), "--windows", "3", "--seq-len", "32",
                                      "--no-generation", "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    for row in [*report["slices"].values(), report["overall"]]:
        if row["windows"] >= 2:
            low, high = row["perplexity_ci95"]
            assert low < row["perplexity"] < high
        assert row["ratio_ci95"] is None  # no base
    assert "| 95 % CI |" in (out / "eval.md").read_text()


def test_interval_numbers():
    nll = [2.0, 2.2, 2.4, 2.6]
    se = torch.tensor(nll, dtype=torch.float64).std().item() / 2
    low, high = perplexity_interval(nll)
    assert math.log(low) == pytest.approx(2.3 - Z95 * se) and math.log(high) == pytest.approx(2.3 + Z95 * se)
    assert perplexity_interval([2.0]) is None
    shifted = [x + 0.1 for x in nll]  # the same windows, every one 0.1 nats worse: no spread in the difference
    assert ratio_interval(shifted, nll) == pytest.approx((math.exp(0.1), math.exp(0.1)))
    assert ratio_interval(nll, nll[:3]) is None


def test_batched_greedy_matches_batch_one(smol_tokenizer, one_thread):
    model = tiny_model("llama")
    prompts = [torch.tensor(smol_tokenizer(text)["input_ids"]) for text in
               ("Hello there, how are you today?", "Hi", "Name three colours of the rainbow, please.")]
    eos = int(greedy_outputs(model, prompts[:1], 3)[0][0][-1])  # a token the model emits: some rows stop early
    for eos_token_id in (None, eos):
        expected, _ = greedy_outputs(model, prompts, 6, eos_token_id)
        counted = []
        got = greedy_batch(model, prompts, 6, eos_token_id, batch_size=2, on_prompts=counted.append)
        assert counted == [2, 1]
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_plots_have_titles_and_the_layer_error_a_log_axis(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn = {}
    monkeypatch.setattr(report_module, "_save", lambda fig, directory, name: drawn.setdefault(name, fig) and name)
    slices = {name: {"tokens": 10, "perplexity_ratio": 1.1} for name in SLICES}
    report = {"base": "b", "slices": slices, "kl_histogram": {"lower_edges": [0.0, 0.1], "counts": [5, 3]},
              "layer_errors": {"measure": "Hessian-weighted squared error (GPTQ loss)", "layers": [0.1, 1.0, 900.0]}}
    report_module._plots(report, tmp_path)
    axes = {name: fig.axes[0] for name, fig in drawn.items()}
    assert all(ax.get_title() for ax in axes.values()) and set(axes) == set(report_module.PLOTS.values())
    assert axes["layer_errors.png"].get_yscale() == "log"
    assert "Hessian-weighted squared error" in axes["layer_errors.png"].get_title()
    plt.close("all")
