"""Recipes: schema errors name the file, line and key; every shipped recipe loads; a tiny pipeline runs every step,
reruns none of them when resumed, reruns only the heads and what reads them when the heads section changes, and
pushes nothing past a failed gate. The demo recipe on SmolLM2, pushed to a local Hub: tests/hub/test_demo_recipe.py."""

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import toolkit.evaluate.acceptance
import toolkit.evaluate.suite
import toolkit.hub
import toolkit.quantize
import toolkit.train_heads
import toolkit.validate
from conftest import cli, refused
from toolkit.cli import app
from toolkit.hub import PushResult
from toolkit.recipes import GateError, RecipeError, load_recipe, run_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
QUIET = Console(quiet=True)
# The verbs the steps call, by module: counted in every run test, so "cached" means "not called".
VERBS = {"quantize": (toolkit.quantize, "quantize"), "evaluate": (toolkit.evaluate.suite, "evaluate"),
         "validate": (toolkit.validate, "validate"), "heads": (toolkit.train_heads, "train_heads"),
         "heads_eval": (toolkit.evaluate.acceptance, "validate_heads")}

TINY = """\
model: {model}
output: {output}
calibration: {{dataset: sharegpt, samples: 4, seq_len: 64}}
quantize: {{method: rtn, bits: 4, group_size: 32}}
evaluate: {{windows: 2, seq_len: 64, generation_tokens: 4, prompts: 2, max_new_tokens: 6}}
heads:
  num_heads: 2
  samples: 4
  max_len: 96
  distill_tokens: 6
  distill_batch: 4
  target_dtype: float32
  train_dtype: float32
  steps: 2
  batch_size: 2
  micro_batch_size: 1
  warmup_steps: 1
  eval_every: 2
  eval_prompts: 1
  eval_tokens: 4
gates:
  max_perplexity_ratio: 1.5
  max_slice_perplexity_ratio: 1.5
  min_top1_agreement: 0.1
  max_kl: {max_kl}
  min_accepted_length: 1.0
push: {{repo: compound-test/tiny, tags: [test]}}
"""


def _tiny_recipe(tmp_path: Path, model, output: Path, max_kl: float = 1.0) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(model=model, output=output, max_kl=max_kl))
    return path


def _counting(monkeypatch) -> Counter:
    """Wrap every step's verb with a call counter and replace the Hub push with a recorder (push calls land in
    ``calls["push"]`` and ``calls.pushed``)."""
    calls: Counter = Counter()
    calls.pushed = []
    for step, (module, name) in VERBS.items():
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _step=step, **k: (calls.update([_step]),
                                                                                 _real(*a, **k))[1])

    def push(api, directory, repo_id, **options):
        calls.update(["push"])
        calls.pushed.append((Path(directory), repo_id, options))
        return PushResult(f"https://hub.test/{repo_id}", "0" * 40, ["model.safetensors"])

    monkeypatch.setattr(toolkit.hub, "push", push)
    return calls


@pytest.fixture(scope="module")
def first_run(tiny_llama_dir, tmp_path_factory, one_thread):
    """One full run of the tiny recipe: (recipe, summary, calls)."""
    root = tmp_path_factory.mktemp("recipe")
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _counting(monkeypatch)
        recipe = load_recipe(_tiny_recipe(root, tiny_llama_dir, root / "out"))
        summary = run_recipe(recipe, api=object(), console=QUIET)
    return recipe, summary, calls


@pytest.fixture
def copied(first_run, tmp_path):
    """The first run's recipe pointed at a copy of its output directory, so a test may change it."""
    recipe = first_run[0]
    shutil.copytree(recipe.output, tmp_path / "out")
    return dataclasses.replace(recipe, output=tmp_path / "out")


def _statuses(summary) -> dict[str, str]:
    return {s.name: s.status for s in summary.steps}


# ---- schema -------------------------------------------------------------------------------------------------------

BASE = "model: smollm2-135m\nquantize:\n  method: rtn\n  bits: 4\n  group_size: 64\n"


@pytest.mark.parametrize("text, line, message", [
    (BASE.replace("64", "100"), 5, "quantize.group_size: group_size must be one of (-1, 32, 64, 128), got 100"),
    (BASE.replace("group_size", "grup_size"), 5, "quantize.grup_size: unknown key; did you mean group_size?"),
    (BASE.replace("bits: 4", "bits: four"), 4, "quantize.bits: expected an integer, got 'four' (str)"),
    (BASE.replace("bits: 4", "bits: true"), 4, "quantize.bits: expected an integer, got True (bool)"),
    (BASE.replace("quantize:", "quantise:"), 2, "quantise: unknown key; did you mean quantize?"),
    (BASE + "  bits: 8\n", 6, "quantize.bits: given twice (first on line 4)"),
    (BASE + "  sym: false\n  format: gptq\n", 7, "quantize.format: gptq: "),
    (BASE + "  act_order: true\n", 6, "quantize.act_order: act_order is a GPTQ option"),
    (BASE + "heads:\n  head: hydra\n", 7, "heads.head: "),
    (BASE + "  device: tpu\n", 6, "quantize.device: --device must be one of auto, cpu, cuda"),
    (BASE + "heads:\n  device: gpu\n", 7, "heads.device: --device must be one of auto, cpu, cuda, got 'gpu'"),
    (BASE + "heads:\n  head: eagle3\n  aux_layers: [2, x]\n", 8, "heads.aux_layers: expected a list of integers"),
    (BASE + "heads:\n  batch_size: 6\n  micro_batch_size: 4\n", 7, "heads.batch_size: batch_size must be a multiple"),
    (BASE + "push:\n  private: true\n", 6, "push: repo is required"),
    (BASE + "push:\n  repo: no-owner\n", 7, "push.repo: must be owner/name"),
    (BASE + "push:\n  repo: a/b\n  tags: demo\n", 8, "push.tags: expected a list of strings, got 'demo'"),
    (BASE + "push:\n  repo: a/b\n  repo_id: a/c\n", 8, "push.repo_id: renamed repo, and push.repo is given too"),
    (BASE + "evaluate:\n  windows: 0\n", 7, "evaluate.windows: must be >= 1, got 0"),
    (BASE + "evaluate:\n  decode_dtype: float16\n", 7,
     "evaluate.decode_dtype: must be one of bfloat16, float32, got 'float16'"),
    (BASE + "evaluate:\n  categories: [code]\n", 7, "evaluate.categories: must include all"),
    (BASE + "gates:\n  accepted_length_mode: beam\n", 7, "gates.accepted_length_mode: must be one of tree, chain"),
    ("model: smollm2-135m\nheads: {}\ngates:\n  max_kl: 0.1\n", 4, "gates.max_kl: measures the quantized model, "
                                                                    "and the recipe has no quantize section"),
    ("quantize: {method: rtn}\n", 1, "model: is required"),
    ("model: smollm2-135m\n", 1, "a recipe needs a quantize or a heads section"),
    (BASE + "  skip: [lm_head\n", 7, "not valid YAML"),
])
def test_schema_errors_name_the_line_and_the_key(tmp_path, text, line, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"{path}:{line}: "), str(err.value)
    assert message in str(err.value)


def test_defaults_and_yaml_floats(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(BASE + "heads:\n  lr: 1e-3\npush:\n  repo: me/model\n")  # YAML 1.1 reads 1e-3 as text
    recipe = load_recipe(path)
    assert recipe.heads.parts["train"].lr == 0.001 and recipe.output == Path("out/mine") and recipe.source == path
    assert recipe.push.heads_repo_for(recipe.heads.head) == "me/model-medusa" and recipe.gates.lossless_required
    assert recipe.evaluate.windows == 8  # compound eval's default


def test_renamed_keys_are_read_with_a_warning_naming_the_new_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(BASE + "heads: {}\nevaluate:\n  new_tokens: 9\npush:\n  repo_id: me/model\n"
                           "  heads_repo_id: me/heads\n")
    with pytest.warns(FutureWarning) as caught:
        recipe = load_recipe(path)
    messages = [str(w.message) for w in caught]
    assert messages == [f"{path}:8: evaluate.new_tokens: deprecated, renamed max_new_tokens (the verbs' option "
                        "name); it is read as evaluate.max_new_tokens",
                        f"{path}:10: push.repo_id: deprecated, renamed repo (the verbs' option name); it is read as "
                        "push.repo",
                        f"{path}:11: push.heads_repo_id: deprecated, renamed heads_repo (the verbs' option name); it "
                        "is read as push.heads_repo"]
    assert (recipe.evaluate.max_new_tokens, recipe.push.repo, recipe.push.heads_repo) == (9, "me/model", "me/heads")


def test_the_device_is_a_key_outside_the_fingerprints(tmp_path):
    """Where a step computes (``device``) is not what it computes: a run resumed on a GPU reuses the CPU's steps."""
    from toolkit.recipes.plan import step_fingerprints

    prints = []
    for device in ("auto", "cpu"):
        path = tmp_path / f"{device}.yaml"
        path.write_text(BASE + f"  device: {device}\nheads:\n  device: {device}\n")
        recipe = load_recipe(path)
        assert recipe.quantize.settings.device == recipe.heads.device == device
        assert recipe.heads.job("m", tmp_path / "h", tmp_path / "w").device == device
        prints.append(step_fingerprints(dataclasses.replace(recipe, output=tmp_path / "out")))
    assert prints[0] == prints[1]


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_load(path):
    recipe = load_recipe(path)
    assert recipe.quantize and recipe.heads and recipe.push and recipe.output == Path("out") / path.stem
    assert recipe.gates.lossless_required and recipe.gates.validate_required


def test_the_four_recipes_are_shipped():
    assert {p.stem for p in RECIPES} >= {"smollm2-135m-demo", "smollm2-135m-full", "llama-3.1-8b-instruct",
                                         "llama-3.1-70b-instruct"}


# ---- runs on a tiny Llama ----------------------------------------------------------------------------------------

def test_a_run_executes_every_step_then_pushes_both_artifacts(first_run):
    recipe, summary, calls = first_run
    assert _statuses(summary) == {"quantize": "ran", "evaluate": "ran", "validate": "ran", "heads": "ran",
                                  "heads_eval": "ran", "gates": "ran", "push": "ran"}
    assert summary.passed and len(summary.gates) == 7 and all(g.passed for g in summary.gates)
    assert {k: calls[k] for k in (*VERBS, "push")} == {**dict.fromkeys(VERBS, 1), "push": 2}
    (ckpt, ckpt_repo, ckpt_options), (heads, heads_repo, heads_options) = calls.pushed
    assert (ckpt, ckpt_repo) == (recipe.checkpoint, "compound-test/tiny")
    assert (heads, heads_repo) == (recipe.heads_dir, "compound-test/tiny-medusa")
    assert ckpt_options["tags"] == ["test"] and ckpt_options["private"] is False
    assert ckpt_options["results"]["eval"] == json.loads((recipe.output / "eval" / "eval.json").read_text())
    assert [r["mode"] for r in heads_options["results"]["acceptance"]] == ["tree", "chain"]
    # heads are trained against the model they serve: the quantized checkpoint
    manifest = json.loads((recipe.heads_dir / "compound.json").read_text())
    assert manifest["target"] == str(recipe.checkpoint)
    evaluate = summary.step("evaluate").results
    assert evaluate["overall"]["tokens"] == 4 * 2 * 63 and evaluate["overall"]["perplexity_ratio"] > 0.9
    assert evaluate["overall"]["kl"] > 0 and evaluate["generation"]["json"]["prompts"] == 8
    assert summary.step("validate").results["ok"] and summary.step("heads_eval").results["chain"]["lossless"]
    stored = {p.stem for p in (recipe.output / ".steps").glob("*.json")}
    assert stored == {"quantize", "evaluate", "validate", "heads", "heads_eval", "push"}
    written = json.loads((recipe.output / "summary.json").read_text())
    assert written["passed"] and [s["name"] for s in written["steps"]][-1] == "push"


def test_resume_runs_no_step_again(copied, monkeypatch):
    calls = _counting(monkeypatch)
    summary = run_recipe(copied, api=object(), console=QUIET)
    assert set(_statuses(summary).values()) == {"cached", "ran"} and _statuses(summary)["gates"] == "ran"
    assert [s.name for s in summary.steps if s.status == "cached"] == ["quantize", "evaluate", "validate", "heads",
                                                                       "heads_eval", "push"]
    assert sum(calls.values()) == 0
    console = Console(record=True, width=200)
    without_token = run_recipe(copied, api=None, console=console)
    assert without_token.step("push").status == "skipped" and "no Hugging Face token" in console.export_text()
    assert sum(calls.values()) == 0


def test_changed_heads_rerun_only_heads_and_downstream(copied, monkeypatch):
    calls = _counting(monkeypatch)
    heads = copied.heads
    train = dataclasses.replace(heads.parts["train"], steps=4, eval_every=4)
    changed = dataclasses.replace(copied, heads=dataclasses.replace(heads, parts={**heads.parts, "train": train}))
    summary = run_recipe(changed, api=object(), console=QUIET)
    assert _statuses(summary) == {"quantize": "cached", "evaluate": "cached", "validate": "cached", "heads": "ran",
                                  "heads_eval": "ran", "gates": "ran", "push": "ran"}
    assert dict(calls) == {"heads": 1, "heads_eval": 1, "push": 2}
    assert summary.step("heads").results["best_step"] == 4


def test_a_failed_gate_stops_the_run_and_pushes_nothing(copied, monkeypatch):
    calls = _counting(monkeypatch)
    strict = dataclasses.replace(copied, gates=dataclasses.replace(copied.gates, max_kl=1e-12))
    with pytest.raises(GateError, match=r"max_kl: measured [0-9.e-]+, threshold <= 1e-12") as err:
        run_recipe(strict, api=object(), console=QUIET)
    assert [g.name for g in err.value.summary.gates if not g.passed] == ["max_kl"]
    assert err.value.summary.step("push") is None and calls["push"] == 0 and sum(calls.values()) == 0
    assert not json.loads((copied.output / "summary.json").read_text())["passed"]


def test_cli_exit_codes_and_messages(copied, tmp_path, tiny_llama_dir, monkeypatch):
    calls = _counting(monkeypatch)
    runner = CliRunner()
    strict = _tiny_recipe(tmp_path, tiny_llama_dir, copied.output, max_kl=1e-12)
    result = runner.invoke(app, ["run", str(strict)])
    text = " ".join(result.output.split())  # Rich wraps long lines
    assert result.exit_code == 1, result.output
    assert "gate failed max_kl: measured" in text and "threshold <= 1e-12" in text and calls["push"] == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("64", "100"))
    result = runner.invoke(app, ["run", str(bad)])
    flat = result.output.replace("\n", "")  # Rich wraps long lines, inside the path too (a deep tmp_path)
    assert result.exit_code == 2 and f"{bad}:5:" in flat and "quantize.group_size: group_size must be one of" in flat


def test_dry_run_does_nothing(copied, tmp_path, tiny_llama_dir, monkeypatch):
    calls = _counting(monkeypatch)
    fresh = dataclasses.replace(copied, output=tmp_path / "fresh")
    summary = run_recipe(fresh, dry_run=True, api=object(), console=QUIET)
    assert set(_statuses(summary).values()) == {"would run"} and not fresh.output.exists()
    planned = run_recipe(copied, dry_run=True, api=object(), console=QUIET)
    assert [s.name for s in planned.steps if s.status == "cached"] == ["quantize", "evaluate", "validate", "heads",
                                                                       "heads_eval", "push"]
    assert all(len(s.fingerprint) == 64 for s in planned.steps if s.name != "gates")
    no_resume = run_recipe(copied, resume=False, dry_run=True, api=object(), console=QUIET)
    assert [s.status for s in no_resume.steps][:5] == ["would run"] * 5
    result = CliRunner().invoke(app, ["run", str(_tiny_recipe(tmp_path, tiny_llama_dir, fresh.output)), "--dry-run"])
    assert result.exit_code == 0 and "would run" in result.output and not fresh.output.exists()
    assert sum(calls.values()) == 0


# ---- the demo recipe on SmolLM2 ----------------------------------------------------------------------------------


RUNS_END_EMPTY = True  # conftest's runs: every case here leaves it empty
run = cli




def test_recipe_that_is_not_utf8(tmp_path, runs):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(f"model: smollm2-135m\noutput: {runs / 'out'}\n# caf\xe9\n".encode("latin-1"))
    offset = recipe.read_bytes().index(b"\xe9")
    refused(run("run", recipe), f"latin1.yaml: not UTF-8 text (byte {offset})")
