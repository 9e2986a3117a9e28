"""The benchmark scripts: every one answers ``--help`` (each in a process of its own, as a user runs it), the
compound command lines they build (``benchmarks/commands.py``) parse back, through the real CLI, into the options
they were built from, and every section of BENCHMARKS.md states the one command that regenerates it."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from toolkit.cli import app, flags
from toolkit.engine.threads import ThreadSettings
from toolkit.heads.options import DataOptions, EagleOptions, MedusaOptions, SelectOptions
from toolkit.heads.train import TrainConfig
from toolkit.quant.configs import METHODS, make_config
from toolkit.quantize import CalibrationSpec, QuantizeSettings
from toolkit.train_heads import HeadsJob

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def load_commands():
    spec = importlib.util.spec_from_file_location("benchmark_commands", ROOT / "benchmarks" / "commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsed(argv: list[str]) -> dict:
    """The options ``compound`` would run ``argv`` (``["compound", verb, ...]``) with, parsed by the real CLI."""
    assert argv[0] == "compound"
    command = typer.main.get_command(app).commands[argv[1]]
    return command.make_context(argv[1], argv[2:]).params


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"heads.py", "heads_eagle.py", "heads_vs_peers.py", "decode.py"} <= names
    assert "report.py" not in names and "commands.py" not in names  # helpers, not scripts


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_script_answers_help(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout


@pytest.mark.parametrize("head", ["medusa", "eagle3"])
def test_train_heads_argv_parses_back_into_the_same_job(head, tmp_path):
    job = HeadsJob(model="smollm2-135m", output=tmp_path / "out", head=head, work_dir=tmp_path / "work",
                   overwrite=True, medusa=MedusaOptions(num_heads=3, shared_lm_head=True),
                   eagle=EagleOptions(aux_layers=(2, 15, 27), draft_vocab=8192, ttt_steps=3, loss="ce"),
                   data=DataOptions(samples=256, max_len=512, distill_tokens=128, self_distill=False),
                   train=TrainConfig(lr=0.002, warmup_steps=3, steps=30, micro_batch_size=8, eval_every=10),
                   select=SelectOptions(eval_prompts=3, eval_tokens=48, select_mode="chain"))
    argv = load_commands().train_heads_argv(job)
    assert "--dataset-answers" in argv and "--shared-lm-head" in argv and "--aux-layers" in argv
    assert "--batch-size" not in argv  # a default is left to the CLI
    options = parsed(argv)
    again = HeadsJob(model=options["model"], output=options["output"], head=options["head"],
                     work_dir=options["work_dir"], overwrite=options["overwrite"],
                     **{name: flags.build(cls, options) for name, cls in HeadsJob.parts().items()})
    assert again == job


def test_quantize_argv_parses_back_into_the_same_config():
    config = make_config("gptq", bits=4, group_size=64, sym=False, act_order=True)
    calibration = CalibrationSpec(samples=16, seq_len=256)
    settings = QuantizeSettings(stream=True, batch_size=1)
    argv = load_commands().quantize_argv(config, calibration, settings, ThreadSettings(threads="1"),
                                         model="smollm2-135m", output="out")
    options = parsed(argv)
    assert make_config(options["method"], **flags.method_options(METHODS.values(), options)) == config
    assert flags.build(CalibrationSpec, options) == calibration
    assert flags.build(QuantizeSettings, options) == settings
    assert options["threads"] == "1" and options["output"] == Path("out") and options["overwrite"]


def test_every_benchmarks_section_states_its_one_command():
    text = (ROOT / "BENCHMARKS.md").read_text()
    sections = re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert len(sections) > 10
    for title, body in sections:
        commands = re.findall(r"^Commands?: (.*)$", body, re.M)
        assert len(commands) == 1 and not body.count("\nCommands:"), f"{title}: {commands}"
        scripts = re.findall(r"python (\S+\.py)", commands[0])
        assert scripts, f"{title}: no script regenerates it (a settled one belongs in docs/investigations.md)"
        assert all((ROOT / script).is_file() for script in scripts), f"{title}: {scripts}"


def load_frontier():
    spec = importlib.util.spec_from_file_location("benchmark_frontier", ROOT / "benchmarks" / "frontier.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("hidden, intermediate, heads, head_dim, refused", [
    (576, 1536, 9, 64, "576 (hidden) % 128 = 64, 576 (attention output) % 128 = 64"),  # SmolLM2: no W4 g128
    (640, 2048, 4, 256, None),  # Gemma-3 270M: 640 = 5 × 128
])
def test_frontier_runs_a_group_size_only_where_it_divides_every_width(tmp_path, hidden, intermediate, heads,
                                                                      head_dim, refused):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "intermediate_size": intermediate,
                                                      "num_attention_heads": heads, "head_dim": head_dim}))
    frontier = load_frontier()
    assert frontier.skipped(tmp_path, 128) == refused
    assert frontier.skipped(tmp_path, 64) is None


@pytest.mark.parametrize("precisions, grid, samples, suffix", [
    (["w4g64"], "asym", 32, ""), (["w3g64"], "full", 32, " (symmetric full-range grid)"),
    (["w4g128"], "asym", 32, " (group size 128)"),
    (["w4g64", "w4g128"], "sym", 32, " (symmetric grid) (group size 128)"),
    (["w4g64"], "asym", 128, " (128 calibration samples)"),
])
def test_frontier_writes_one_section_per_grid_group_size_and_calibration(precisions, grid, samples, suffix):
    import argparse

    frontier = load_frontier()
    title = frontier.section_title(argparse.Namespace(precisions=precisions, grid=grid, calib_samples=samples))
    assert title == frontier.TITLE + suffix  # a W4 g128 run leaves the g64 tables of the same grid alone


def test_frontier_defaults_change_one_setting_at_a_time(tmp_path):
    import argparse

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "intermediate_size": 1536,
                                                      "num_attention_heads": 9, "head_dim": 64}))
    frontier = load_frontier()
    args = argparse.Namespace(methods=["rtn", "gptq"], default_samples=[32, 128], calib_samples=128, iters=50)
    runs = frontier.defaults_runs(args, tmp_path, 4)
    assert [run.setting for run in runs] == [
        "defaults", "symmetric grid", "group size 32",  # RTN: no calibration; 128 does not divide 576
        "defaults", "symmetric grid", "act-order off", "min/max ranges", "32 calibration samples", "group size 32"]
    config = frontier.compound_config(runs[6], bits=4, group_size=None, grid=None)
    assert not config.mse_clip and config.act_order and not config.sym  # only the changed setting moved


def test_frontier_records_a_failed_run_by_its_own_error_line(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("Quantizing layer 3\nTraceback (most recent call last):\n  File x\n"
                   "ValueError: Only one block-quantization config is allowed\n\nprogress 100%\n")
    assert load_frontier().last_message(log) == "ValueError: Only one block-quantization config is allowed"
    log.write_text("grid check FAILED: off grid\n")
    assert load_frontier().last_message(log) == "grid check FAILED: off grid"


@pytest.mark.parametrize("grid", ["asym", "full"])
def test_frontier_argv_for_signround_with_rotation_parses_back(grid):
    frontier = load_frontier()
    run = frontier.Run("compound", "signround", "hadamard", iters=2)
    config = frontier.compound_config(run, bits=3, group_size=64, grid=grid)
    argv = load_commands().quantize_argv(config, CalibrationSpec(samples=4), model="m", output="o")
    options = parsed(argv)
    assert make_config(options["method"], **flags.method_options(METHODS.values(), options)) == config
    assert config.rotate == "hadamard" and config.iters == 2 and config.bits == 3
    assert (config.sym, config.full_range) == ((False, False) if grid == "asym" else (True, True))


@pytest.mark.parametrize("iters, autoround_iters", [(50, [50, 200]), (200, [200])])
def test_frontier_runs_autoround_at_its_defaults_once_whatever_the_iterations(iters, autoround_iters):
    import argparse

    frontier = load_frontier()
    args = argparse.Namespace(methods=["gptq", "signround"], float_targets_methods=[], min_max_methods=["gptq"],
                              refit_methods=[],
                              rotations=["none"],
                              rotated_methods=[], signround_batch_sizes=[4], skip=set(), iters=iters,
                              peers=["autoround", "autoround-defaults", "autoround-iters0"])
    runs = frontier.frontier_runs(args, "smollm2-135m")
    assert [run.iters for run in runs if run.tool == "autoround"] == [*autoround_iters, 0]
    assert [run.name for run in runs if run.tool == "compound"] == [
        "compound_gptq", "compound_gptq_mse-clip-False", f"compound_signround_iters{iters}",
        f"compound_signround_iters{iters}_batch-size-4"]
    assert runs[1].label == "gptq (min/max ranges)"
    args.skip = {("smollm2-135m", "autoround-iters0"), ("smollm2-135m", "signround")}
    runs = frontier.frontier_runs(args, "smollm2-135m")
    assert [run.name for run in runs] == ["compound_gptq", "compound_gptq_mse-clip-False",
                                          *(f"autoround_signround_iters{n}" for n in autoround_iters)]
    assert frontier.parse_skips("gemma3-270m:autoround-defaults") == {("gemma3-270m", "autoround-defaults")}
    args.rotations, args.rotated_methods, args.skip = ["none", "hadamard"], ["gptq"], set()
    assert "compound_gptq_rot-hadamard" in [run.name for run in frontier.frontier_runs(args, "smollm2-135m")]
    args.skip = frontier.parse_skips("smollm2-135m:gptq@hadamard")
    names = [run.name for run in frontier.frontier_runs(args, "smollm2-135m")]
    assert "compound_gptq" in names and "compound_gptq_rot-hadamard" not in names
    args.skip, args.float_targets_methods = set(), ["gptq"]  # float targets rotated too; min/max unrotated only
    names = [run.name for run in frontier.frontier_runs(args, "smollm2-135m") if run.tool == "compound"]
    assert names[:5] == ["compound_gptq", "compound_gptq_float-targets-True", "compound_gptq_mse-clip-False",
                         "compound_gptq_rot-hadamard", "compound_gptq_rot-hadamard_float-targets-True"]
    args.refit_methods = ["gptq"]  # refits rotated too
    runs = [run for run in frontier.frontier_runs(args, "smollm2-135m") if run.tool == "compound"]
    assert [run.name for run in runs][:7] == [
        "compound_gptq", "compound_gptq_float-targets-True", "compound_gptq_refit-rounds-3",
        "compound_gptq_mse-clip-False", "compound_gptq_rot-hadamard", "compound_gptq_rot-hadamard_float-targets-True",
        "compound_gptq_rot-hadamard_refit-rounds-3"]
    assert runs[2].label == "gptq (3 scale refits)"


def test_frontier_argv_for_a_signround_batch_size_parses_back():
    frontier = load_frontier()
    run = frontier.Run("compound", "signround", iters=50, change=(("batch_size", 4),))
    config = frontier.compound_config(run, bits=4, group_size=64, grid="asym")
    argv = load_commands().quantize_argv(config, CalibrationSpec(samples=32), QuantizeSettings(batch_size=4),
                                         model="m", output="o")
    options = parsed(argv)
    assert options["batch_size"] == 4 and options["samples"] == 32
    assert make_config(options["method"], **flags.method_options(METHODS.values(), options)) == config
    assert run.label == "signround (50 iters) (batch 4)"


def load_gguf_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_llamacpp_gguf", ROOT / "benchmarks" / "llamacpp_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gguf_benchmark_reads_the_linears_types_and_bits_per_weight_from_the_file(tmp_path):
    """A GGUF file written by the gguf package with one K-quant linear, one Q8_0 fallback of width 64, a norm and the
    embeddings: only the two linears count, each at its type's bytes (Q4_K: 144 per 256 weights, Q8_0: 34 per 32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "mix.gguf"
    writer = GGUFWriter(str(path), "llama")
    rows_bytes = {"blk.0.ffn_down.weight": ("Q4_K", 2, 144), "blk.0.attn_q.weight": ("Q8_0", 3, 2 * 34)}
    for name, (type_name, rows, row_bytes) in rows_bytes.items():  # 256 and 64 weights per row
        writer.add_tensor(name, np.zeros((rows, row_bytes), dtype=np.uint8), raw_dtype=GGMLQuantizationType[type_name])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.ones((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    types, bits, fallback_widths = load_gguf_benchmark().linear_types(path)
    assert types == {"Q4_K": 1, "Q8_0": 1}
    assert bits == pytest.approx(8 * (2 * 144 + 3 * 2 * 34) / (2 * 256 + 3 * 64))
    assert fallback_widths == {64: 1}


def test_frontier_goals_read_sharegpt_for_smollm2_and_both_sets_for_gemma3():
    """Issue #38's perplexity goals: SmolLM2 within ×1.05 on ShareGPT; Gemma-3 within ×1.08 on the unlike text too."""
    frontier = load_frontier()

    def rows(ratio, unlike_ratio):
        scores = {"sharegpt": {"kl": 0.1, "perplexity": 20 * ratio, "base_perplexity": 20.0},
                  "unlike": {"kl": 0.2, "perplexity": 10 * unlike_ratio, "base_perplexity": 10.0}}
        return [(frontier.Run("compound", "gptq"), {"scores": scores, "seconds": 100.0})]

    smollm2, = frontier.findings("smollm2-135m", "w4g64", rows(1.04, 1.2))
    assert "goal ×1.05 (ShareGPT): met" in smollm2
    gemma3, = frontier.findings("gemma3-270m", "w4g64", rows(1.04, 1.2))
    assert "goal ×1.08 (both held-out sets): missed by 0.120" in gemma3
    assert "goal" not in frontier.findings("gemma3-270m", "w3g64", rows(1.04, 1.2))[0]
