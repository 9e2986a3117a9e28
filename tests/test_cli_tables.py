"""The CLI's tables (toolkit/cli/render.py): every table the CLI prints stays readable at 80 columns (nothing cut
to "…", no line wider than 80)."""

import io

from rich.console import Console
from typer.testing import CliRunner

from toolkit.cli import app

WIDTH = 80


def run(*args, **env):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(WIDTH), **env})


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
