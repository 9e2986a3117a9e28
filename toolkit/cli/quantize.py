"""``compound quantize``, ``convert`` and ``decode``: checkpoints made, re-packed and run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from toolkit.cli import flags
from toolkit.cli.common import RichProgress, app, console, dir_size, fail, progress_bar, start, user_errors
from toolkit.cli.render import fit
from toolkit.decode.kv_cache import CACHE_DTYPES
from toolkit.convert import ConvertOptions
from toolkit.decode.options import DecodeOptions
from toolkit.engine.threads import ThreadSettings
from toolkit.evaluate.perplexity import EVAL_WINDOWS
from toolkit.quant.configs import METHODS, MethodChoice, describe_act_order
from toolkit.quantize import CalibrationSpec, QuantizeSettings


@app.command()
@flags.derived(MethodChoice, QuantizeSettings, CalibrationSpec, ThreadSettings, methods=METHODS.values())
def quantize(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="Model: alias (smollm2-135m, gemma3-270m), local directory, .gguf file or Hub id."),
    output: Path = typer.Option(..., "--output", "-o", help="Checkpoint directory to create."),
    evaluate: bool = typer.Option(False, "--eval", help="Also report held-out perplexity of the result and of the float model."),
    eval_windows: int = typer.Option(EVAL_WINDOWS, help="Held-out windows of --seq-len tokens for --eval (the "
                                     "perplexities print with their 95 % interval over windows)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    **options,
):
    """Quantize a causal LM layer by layer and write a deployable checkpoint."""
    from toolkit.evaluate.perplexity import compare_perplexity, ratio_interval
    from toolkit.methods import error_measure
    from toolkit.quant.configs import make_config
    from toolkit.quantize import quantize as run_quantize

    threads = start(ctx, options)
    try:
        method = flags.build(MethodChoice, options).method
        config = make_config(method, **flags.method_options(METHODS.values(), options))
        calibration = flags.build(CalibrationSpec, options)
        if evaluate:
            _check_eval(eval_windows, calibration)
        rank = int(os.environ.get("RANK", "0"))  # under torchrun rank 0 reports, the others run quietly
        with progress_bar(disable=rank > 0) as bar:
            result = run_quantize(model, config, output, calibration, flags.build(QuantizeSettings, options),
                                  overwrite=overwrite,
                                  progress=RichProgress(bar, error_measure(config)) if rank == 0 else None)
        if rank > 0:
            return
        config = result.config
        table = Table(title=f"compound quantize: {method} W{config.bits} g{config.group_size}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        table.add_row("output", str(result.output))
        for name, choice in result.choices.items():
            table.add_row(name, choice)
        table.add_row("act-order", describe_act_order(config.act_order, config.static_groups, config.group_size))
        if result.experts:
            table.add_row("experts calibrated on", _experts_line(result.experts))
            table.add_row("experts rounded to nearest", ", ".join(result.experts["rounded_to_nearest"]) or "none")
        table.add_row("quantize wall time", f"{result.seconds:.1f} s")
        table.add_row("peak memory (RSS)", f"{result.peak_rss_mb:.0f} MiB")
        table.add_row("memory estimate", f"{result.memory.total / 2**20:.0f} MiB")
        table.add_row("size on disk", f"{dir_size(result.output) / 2**20:.1f} MiB")
        table.add_row("threads", str(threads))
    except user_errors() as err:
        fail(err)
    if evaluate:
        started = time.perf_counter()
        with progress_bar() as bar:
            tasks = {}

            def advance(spec, n):
                if spec not in tasks:
                    which = "quantized" if spec == str(result.output) else "float model"
                    tasks[spec] = bar.add_task(f"perplexity, {which}", total=eval_windows)
                bar.advance(tasks[spec], n)

            try:
                quantized, base = compare_perplexity(str(result.output), result.model, calibration.dataset,
                                                     eval_windows, calibration.seq_len, on_batch=advance)
            except (*user_errors(), ValueError) as err:
                Console().print(fit(table))
                fail(ValueError(f"--eval failed, the checkpoint did not: {result.output} is complete and valid. "
                                f"{err} Evaluate it with: compound eval --model {result.output} --base {model} "
                                f"--dataset {calibration.dataset}"))
        eval_seconds = time.perf_counter() - started
        table.add_row("perplexity, float model", _with_interval(base))
        table.add_row("perplexity, quantized", _with_interval(quantized))
        ratio = ratio_interval(quantized.window_nll, base.window_nll)
        table.add_row("quantized / float", f"×{quantized.perplexity / base.perplexity:.3f}" +
                      (f" (95 % CI ×{ratio[0]:.3f}–{ratio[1]:.3f}, paired)" if ratio else ""))
        table.add_row("held-out tokens scored", f"{quantized.tokens} ({len(quantized.window_nll)} windows)")
        table.add_row("eval wall time", f"{eval_seconds:.1f} s")
        table.add_row("total wall time", f"{result.seconds + eval_seconds:.1f} s")
    Console().print(fit(table))


def _with_interval(score) -> str:
    """A perplexity with its 95 % interval over windows, when there are two windows or more."""
    from toolkit.evaluate.perplexity import perplexity_interval

    interval = perplexity_interval(score.window_nll)
    return f"{score.perplexity:.3f}" + (f" ({interval[0]:.3f}–{interval[1]:.3f})" if interval else "")


def _check_eval(windows: int, calibration: CalibrationSpec) -> None:
    """Refuse --eval's options before any work, so that a bad one never fails after the checkpoint is written."""
    from toolkit.quant.configs import ConfigError

    if windows < 1:
        raise ConfigError(f"--eval-windows must be >= 1, got {windows}")
    calibration.check_source()


@app.command()
@flags.derived(ConvertOptions, ThreadSettings)
def convert(
    ctx: typer.Context,
    model: str = typer.Option(..., help="A compound checkpoint directory; for --format gguf also any model spec (a "
                                        "float export in --outtype)."),
    output: Path = typer.Option(..., "--output", "-o", help="Checkpoint directory (or .gguf file) to create."),
    overwrite: bool = typer.Option(False, help="Replace an existing output."),
    **options,
):
    """Re-pack a checkpoint into another layout, bit-exact, without re-quantizing (refused where the math differs)."""
    from toolkit.convert import convert as run_convert

    start(ctx, options)

    try:
        target = flags.build(ConvertOptions, options)
        out = run_convert(model, target.format, output, overwrite=overwrite, outtype=target.outtype)
    except user_errors() as err:
        fail(err)
    size = out.stat().st_size if out.is_file() else dir_size(out)
    console.print(f"wrote {target.format} {'file' if out.is_file() else 'checkpoint'} {out} ({size / 2**20:.1f} MiB)")


@app.command()
@flags.derived(DecodeOptions, ThreadSettings)
def decode(
    ctx: typer.Context,
    model: str = typer.Option(..., help="A compound checkpoint directory (runs its packed weights), or any model spec (float)."),
    prompt: str = typer.Option(..., help="The user message; rendered with the model's chat template."),
    **options,
):
    """Generate a reply with compound's decode loop (static KV cache) and print its statistics."""
    import torch

    from toolkit.calibration import chat_prompt_ids
    from toolkit.decode import DecodeError, Decoder, SamplingConfig, check_context, generate
    from toolkit.engine.devices import resolve
    from toolkit.models import resolve_model
    from toolkit.quant.kv_cache import int8_decode_scales
    from toolkit.runtime.load import load_model_or_checkpoint, read_manifest

    threads = start(ctx, options)
    started = time.perf_counter()
    try:
        settings = flags.build(DecodeOptions, options)
        max_new_tokens, temperature, kv_cache = settings.max_new_tokens, settings.temperature, settings.kv_cache_dtype
        sampling = SamplingConfig(temperature, seed=settings.seed) if temperature > 0 else None
        device = resolve(settings.device)
        loaded, tokenizer = load_model_or_checkpoint(resolve_model(model), torch.float32)
        loaded.to(device)
        ids = chat_prompt_ids(tokenizer, prompt)
        check_context(loaded.config, len(ids), max_new_tokens)
        scales = int8_decode_scales(loaded, read_manifest(model)) if kv_cache == "int8-static" else None
        if kv_cache == "int8-static" and scales is None:
            raise ValueError(f"--kv-cache-dtype int8-static needs a checkpoint with INT8 KV-cache scales; {model} has "
                             "none (make one with compound quantize --kv-cache int8, or use --kv-cache-dtype int8)")
        decoder = Decoder.from_model(loaded, len(ids) + max_new_tokens, CACHE_DTYPES[kv_cache], scales,
                                     fast_head=sampling is None)  # greedy: the argmax is all it reads
        decoder.prepare()  # int4 packing belongs to loading, not to the tokens/s below
        load_s = time.perf_counter() - started
        out, stats = generate(decoder, ids, max_new_tokens, sampling, eos_token_id=tokenizer.eos_token_id)
    except (*user_errors(), DecodeError, ValueError) as err:
        fail(err)
    Console().print(tokenizer.decode(out[len(ids):], skip_special_tokens=True), markup=False, highlight=False)
    scaling = {"float": "", "int8": ", per-token scales", "int8-static": ", calibrated scales"}[kv_cache]
    table = Table(title=f"compound decode: {'greedy' if sampling is None else f'T={temperature}'}, "
                        f"KV cache {kv_cache}{scaling}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("load (read weights, pack int4)", f"{load_s:.1f} s")
    table.add_row("prompt tokens", str(len(ids)))
    table.add_row("new tokens", str(stats.new_tokens))
    table.add_row("forward passes", str(stats.target_forwards))
    table.add_row("wall time (prefill + decode)", f"{stats.total_s:.2f} s")
    table.add_row("tokens/s", f"{stats.tokens_per_s:.1f}")
    table.add_row("threads", str(threads))
    table.add_row("CPU kernels", _kernels_line(loaded, decoder))
    Console().print(fit(table))


def _kernels_line(model, decoder) -> str:
    """What runs a decode step on the CPU: the int4 kernel (where the model has int4 linears) and the forward; on a
    GPU, whether the int4 linears run the Triton kernels."""
    import torch

    from toolkit.runtime.cpu_int4 import default_kernel
    from toolkit.runtime.quant_linear import QuantLinear

    if decoder.device.type != "cpu":
        triton = any(isinstance(m, QuantLinear) and m.path(torch.empty(1, m.in_features, device=decoder.device)) ==
                     "triton" for m in model.modules())
        return f"none (on {decoder.device}{': int4 linears run the Triton kernels' if triton else ''})"
    forward = "C++ decode step" if decoder.native_step is not None else "torch forward"
    int4 = any(isinstance(m, QuantLinear) and m.takes_cpu_int4() for m in model.modules())
    return f"int4 {default_kernel()}, {forward}" if int4 else forward


def _experts_line(report: dict) -> str:
    """The experts row of the summary: calibration mode and tokens per expert."""
    tokens = report["tokens_per_expert"]
    mode = "routed tokens" if report["calibration"] == "routed" else "every token"
    return (f"{mode} (--moe-calibration {report['calibration']}); routed tokens per expert min {tokens['min']} / "
            f"median {tokens['median']} / max {tokens['max']}; fewer than {report['min_tokens']}: round to nearest")
