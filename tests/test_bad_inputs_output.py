"""Issue #26, what is shown: enumerated options are choice types with the same values in the CLI and the recipe (a
wrong value is exit 2 naming the flag and the valid values, before any work, leaving nothing behind); ``--kv-cache
int8`` scales are read by ``compound decode``; no ``torch.load`` unpickles arbitrary objects; every table the CLI
prints stays readable at 80 columns (nothing cut to "…", no line wider than 80)."""

from __future__ import annotations

import io
import re
import typing
from pathlib import Path

import pytest
import typer.main
from rich.console import Console
from typer.testing import CliRunner

from conftest import refused as conftest_refused
from toolkit.cli import app

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 80


def run(*args, **env):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(WIDTH), **env})


def refused(result, *names: str) -> str:
    """A refusal by typer's own choice check (a usage error in a box)."""
    return conftest_refused(result, *names, usage=True)

def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# ---- item 10: choices, declared once, the same in the CLI and the recipe -----------------------------------------

def _choices(command: str, flag: str) -> set[str] | None:
    """The values the CLI accepts for ``flag`` of ``command`` when it is a choice type, else None."""
    click_command = typer.main.get_command(app).commands[command]
    annotation = next(p for p in click_command.params if flag in p.opts).type_descriptor.annotation
    return set(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else None


def _enumerated():
    """(command, flag, the values declared for it) for every enumerated option of the CLI."""
    from toolkit.evaluate.options import HEADS_DTYPES
    from toolkit.convert import TARGETS
    from toolkit.decode.kv_cache import CACHE_DTYPES
    from toolkit.formats import gguf
    from toolkit.models import FLOAT_DTYPES
    from toolkit.quant.configs import METHODS
    from toolkit.quantize import QuantizeSettings

    settings = {f.name: f.metadata["compound.choices"] for f in QuantizeSettings.__dataclass_fields__.values()}
    return [("quantize", "--dtype", settings["dtype"]), ("quantize", "--format", settings["format"]),
            ("quantize", "--kv-cache", settings["kv_cache"]), ("quantize", "--method", tuple(METHODS)),
            ("train-heads", "--dtype", FLOAT_DTYPES), ("convert", "--format", TARGETS),
            ("convert", "--outtype", gguf.FLOAT_TYPES),
            ("decode", "--kv-cache-dtype", tuple(CACHE_DTYPES)), ("validate", "--dtype", HEADS_DTYPES)]


@pytest.mark.parametrize("command, flag, values", _enumerated(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_enumerated_option_is_a_choice_type(command, flag, values):
    assert _choices(command, flag) == {str(v) for v in values if v is not None}


@pytest.mark.parametrize("command", ["quantize", "train-heads"])
def test_dtype_bf16_is_refused_naming_the_valid_values(tmp_path, tiny_llama_dir, command):
    before = entries(tmp_path)
    result = run(command, "--model", tiny_llama_dir, "-o", tmp_path / "out", "--dtype", "bf16")
    refused(result, "--dtype", "'bf16'", "bfloat16", "float16", "float32")
    assert entries(tmp_path) == before  # no output, no work directory, no temporary directory


def test_recipe_dtype_takes_the_cli_values(tmp_path):
    from toolkit.recipes import RecipeError, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: smollm2-135m\nquantize:\n  method: rtn\n  dtype: float32\n")
    assert load_recipe(recipe).quantize.settings.dtype == "float32"  # the CLI takes it, so does the recipe
    recipe.write_text("model: smollm2-135m\nquantize:\n  method: rtn\n  dtype: bf16\n")
    with pytest.raises(RecipeError, match=r"r.yaml:4: quantize.dtype: .*float16, bfloat16, float32, got 'bf16'"):
        load_recipe(recipe)


def test_decode_kv_cache_is_a_choice(tiny_llama_dir):
    result = run("decode", "--model", tiny_llama_dir, "--prompt", "Hi", "--kv-cache", "fp8")
    refused(result, "--kv-cache", "'fp8'", "float", "int8")


def test_convert_format_is_a_choice_and_writes_nothing(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    before = entries(tmp_path)
    result = run("convert", "--model", source, "--format", "exl2", "-o", tmp_path / "out")
    refused(result, "--format", "'exl2'", "gptq", "awq", "compressed-tensors")
    assert entries(tmp_path) == before


def test_validate_heads_dtype_and_categories_are_checked_before_any_work(tmp_path):
    before = entries(tmp_path)
    heads = tmp_path / "heads"
    refused(run("validate", "--model", "smollm2-135m", "--heads", heads, "--dtype", "bf16"),
            "--dtype", "'bf16'", "float32", "bfloat16")
    text = refused(run("validate", "--model", "smollm2-135m", "--heads", heads, "--categories", "prose,poetry"),
                   "--categories", "poetry")
    assert "all, prose, code, non-english, structured" in text
    assert entries(tmp_path) == before


# ---- item 11: the calibrated INT8 KV-cache scales are what compound decode runs with, asked for ----------------------------

def test_decode_runs_with_a_checkpoints_int8_scales(tmp_path, tiny_llama_dir):
    import torch

    from toolkit.quant.configs import RTNConfig
    from toolkit.quant.kv_cache import decode_scales, int8_decode_scales
    from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize
    from toolkit.runtime.load import load_quantized, read_manifest

    calibration = CalibrationSpec(samples=2, seq_len=32)
    scaled = quantize(str(tiny_llama_dir), RTNConfig(group_size=32), tmp_path / "int8", calibration,
                      QuantizeSettings(kv_cache="int8")).output
    plain = quantize(str(tiny_llama_dir), RTNConfig(group_size=32), tmp_path / "plain").output
    for checkpoint, cache, scaling in ((scaled, "int8-static", "calibrated scales"), (scaled, "int8", "per-token scales"),
                                       (plain, "int8", "per-token scales")):
        result = run("decode", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "2", "--kv-cache-dtype", cache)
        assert result.exit_code == 0, result.output
        assert f"KV cache {cache}, {scaling}" in " ".join(result.output.split())
    conftest_refused(run("decode", "--model", plain, "--prompt", "Hi", "--kv-cache", "int8-static"),
                     "--kv-cache-dtype int8-static",
                     "has none")
    model, _ = load_quantized(scaled)
    manifest = read_manifest(scaled)
    torch.testing.assert_close(int8_decode_scales(model, manifest), decode_scales(model))
    fp8 = {**manifest, "kv_cache": {**manifest["kv_cache"], "dtype": "fp8"}}
    assert int8_decode_scales(model, fp8) is None  # amax / 448 would saturate an INT8 cache
    help_text = " ".join(run("quantize", "--help", COLUMNS="200").output.split())
    assert "compound decode --kv-cache-dtype int8-static" in help_text


# ---- item 13: torch.load never unpickles arbitrary objects --------------------------------------------------------

def test_every_torch_load_is_weights_only():
    sources = [p for folder in ("toolkit", "calibration", "kernels", "benchmarks", "scripts", "tests")
               for p in (ROOT / folder).rglob("*.py")
               if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]  # venvs and caches
    calls = [(p, m.group()) for p in sources for m in re.finditer(r"torch\.load\([^)]*\)", p.read_text())]
    assert calls and [(p, c) for p, c in calls if "weights_only=True" not in c] == []


# ---- item 14: every table readable at 80 columns ------------------------------------------------------------------

def rendered(*renderables) -> str:
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    for renderable in renderables:
        console.print(renderable)
    return console.export_text()


def readable(text: str, *cells: str) -> None:
    """Nothing cut, no line wider than the console, and every given cell all there (wrapped or folded)."""
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= WIDTH, text
    unwrapped = "".join(text.split())
    for cell in cells:
        assert "".join(cell.split()) in unwrapped, (cell, text)


NOTE = "Triton CPU interpreter (child process); other layers on the reference, transformers.generate agrees"


def test_validate_tables_fit_80_columns(tmp_path):
    from toolkit.cli.evaluate import paths_table, serving_table
    from toolkit.cli.render import fit
    from toolkit.validate import PathResult, ServingPreview

    paths = [PathResult("reference", 128, "all", None, None, None, True, "the torch reference"),
             PathResult("triton", 16, "1 of 30", 2.4e-07, 3.1e-07, 1.0, False, NOTE)]
    serving = ServingPreview("gptq", "4-bit, group 32, symmetric, act-order off/static", "gptq_marlin → Marlin",
                             "GPTQ uint4b8 (sym 4-bit), g32, every key present", "CPUWNA16LinearKernel",
                             "4-bit, even group, widths multiples of 32; fp16/bf16 activations only (fp32 fails)",
                             "vllm serve x", "vllm serve x", "python -m sglang.launch_server", ["interpreter refuses"])
    report = type("Report", (), {"paths": paths})
    text = rendered(fit(paths_table(report, "sharegpt", 2, 64)), fit(serving_table(serving)))
    readable(text, NOTE, "1 of 30", "2.4e-07", "100.00%", serving.vllm_cpu_why, "interpreter refuses")


def test_validate_heads_table_fits_80_columns(tmp_path):
    from toolkit.cli.evaluate import heads_table
    from toolkit.cli.render import fit
    from toolkit.evaluate.acceptance import AcceptanceReport

    reports = [AcceptanceReport("tree-code", "8-node tree, depth 4", 8, 1.934, [0.71, 0.42, 0.25, 0.1], True, 512,
                                41.3, 30.2, draft_ms_per_step=4.1, verify_ms_per_step=38.5)]
    title = f"heads {tmp_path / 'heads'} drafting for {tmp_path / 'model'} (float32): 8 held-out prompts × 64 tokens"
    readable(rendered(fit(heads_table(reports, title))), "tree-code", "8-node tree, depth 4", "0.71 0.42 0.25 0.10",
             "4.1 / 38.5", str(tmp_path / "heads"))


def test_train_heads_and_run_summary_tables_fit_80_columns(tmp_path):
    from toolkit.cli.heads import result_table
    from toolkit.cli.recipes import _summary_table
    from toolkit.cli.render import fit
    from toolkit.recipes.run import RunSummary, StepSummary
    from toolkit.train_heads import HeadsResult

    output = tmp_path / "a-directory-with-a-long-name" / "heads-for-smollm2-135m-instruct-eagle3"
    result = HeadsResult(output, 1536, 812345, 402211, 1200, {"mean_accepted_length": 1.93}, {"total": 4512.0})
    summary = RunSummary("smollm2-135m-demo", tmp_path / "out", dry_run=True, steps=[
        StepSummary("quantize", "would run", fingerprint="ab" * 32),
        StepSummary("gates", "would run", note="always checked"),
        StepSummary("push", "would run", fingerprint="cd" * 32, note="if every gate passes and a Hub token is set")])
    text = rendered(fit(result_table("compound train-heads: an eagle3 head for smollm2-135m", result)),
                    fit(_summary_table(summary)))
    readable(text, str(output), "1536 / 812,345 / 402,211", "abababababab",
             "if every gate passes and a Hub token is set")


def test_eval_tables_fit_80_columns():
    from toolkit.cli.render import fit
    from toolkit.evaluate.report import console_tables

    def row(ppl, base):
        return {"tokens": 25200, "windows": 400, "perplexity": ppl, "perplexity_ci95": [0.95 * ppl, 1.05 * ppl],
                "base_perplexity": base, "perplexity_ratio": ppl / base,
                "ratio_ci95": [0.99 * ppl / base, 1.01 * ppl / base],
                "kl": 0.02345, "kl_above": 0.051, "top1_agreement": 0.912, "top5_agreement": 0.991}

    slices = {"prose": row(1234.5, 1200.25), "code": row(14.0, 12.0), "non-english": row(31.2, 30.0),
              "structured": row(8.1, 8.0)}
    report = {"dataset": "a-local-dataset-file-with-a-long-name.jsonl", "base": "smollm2-135m", "kl_threshold": 0.1,
              "slices": slices, "overall": row(20.0, 19.0), "worst_slice": "code", "heads": "heads-dir",
              "generation": {"json": {"prompts": 8, "passed": {"model": 0.5, "base": 0.75}, "same_as_base": 0.25}},
              "acceptance": {"all": {"prompts": 8, "tree_accepted_length": 1.9, "chain_accepted_length": 1.6,
                                     "tree_speedup": 1.1, "lossless": True}}}
    readable(rendered(*map(fit, console_tables(report))), "non-english", "1234.50", "×1.029", "same as base",
             "1172.775–1296.225", "×1.018–1.039")


def test_quantize_and_decode_print_80_column_tables(tmp_path, tiny_llama_dir):
    out = tmp_path / "a-checkpoint-directory-whose-name-alone-is-long" / "smollm2-135m-rtn-w4-g32"
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32", "-o", out)
    assert result.exit_code == 0, result.output
    readable(result.stdout, str(out), "peak memory (RSS)", "size on disk")
    result = run("decode", "--model", out, "--prompt", "Hi", "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    readable(result.stdout.split("compound decode")[1], "wall time (prefill + decode)", "tokens/s")
