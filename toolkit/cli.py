"""The ``compound`` command line: parse options into a config, call one verb, render the result with Rich."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(help="Quantize LLMs to INT4, train draft heads, validate and push deployable checkpoints.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(stderr=True)

DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


class _RichProgress:
    """Renders the engine's progress: one bar over decoder layers, the current step as its description."""

    def __init__(self, progress: Progress):
        self.progress, self.task = progress, None

    def start(self, total_layers):
        self.task = self.progress.add_task("quantizing layers", total=total_layers)

    def step(self, message):
        if self.task is None:
            console.log(message)
        else:
            self.progress.update(self.task, description=message)

    def layer_done(self, index, errors):
        worst_name, worst = max(errors.items(), key=lambda item: item[1], default=("-", 0.0))
        self.progress.console.log(f"layer {index}: {len(errors)} linears, largest error {worst:.4g} ({worst_name})")
        self.progress.update(self.task, advance=1, description=f"layer {index} done")


def _progress(disable: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False, disable=disable)


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(2)


def _user_errors() -> tuple[type[Exception], ...]:
    from toolkit.calibration import CalibrationError
    from toolkit.engine.loop import ActivationError
    from toolkit.models import ModelError
    from toolkit.quant.configs import ConfigError
    from toolkit.runtime.load import CheckpointError

    return (ConfigError, ModelError, CalibrationError, CheckpointError, ActivationError, FileExistsError,
            FileNotFoundError)


def _int_list(text: Optional[str], option: str) -> Optional[tuple[int, ...]]:
    """``"2,15,27"`` -> (2, 15, 27); None stays None."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers such as 2,15,27, got {text!r}") from None


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _measure_perplexity(spec: str, dataset: str, windows: int, seq_len: int):
    import torch

    from toolkit.calibration import eval_windows
    from toolkit.evaluate.perplexity import perplexity
    from toolkit.runtime.load import load_model_or_checkpoint

    model, tokenizer = load_model_or_checkpoint(spec, torch.float32)
    tokens = eval_windows(tokenizer, dataset, windows, seq_len)
    with _progress() as bar:
        task = bar.add_task(f"perplexity of {spec}", total=windows)
        return perplexity(model, tokens, on_batch=lambda n: bar.advance(task, n))


@app.command()
def quantize(
    model: str = typer.Option("smollm2-135m", help="Model: alias (smollm2-135m), local directory, .gguf file or Hub id."),
    output: Path = typer.Option(..., "--output", "-o", help="Checkpoint directory to create."),
    method: str = typer.Option("rtn", help="rtn | gptq | awq | awq+gptq (AWQ's scaling, then GPTQ's rounding)"),
    bits: int = typer.Option(4, help="Weight bits (2..8; the GPTQ format stores 2, 3, 4 or 8)."),
    group_size: int = typer.Option(128, help="Input columns per scale: 32, 64, 128, or -1 for per channel."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric grid (default: the method's own)."),
    dataset: str = typer.Option("sharegpt", help="Calibration data: sharegpt, a .json/.jsonl/.parquet/.txt file, or a datasets id."),
    samples: int = typer.Option(128, help="Calibration sequences."),
    seq_len: int = typer.Option(512, help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, help="Seed for calibration sampling and any random choice."),
    fmt: str = typer.Option("auto", "--format", help="Checkpoint layout: auto | gptq | awq | compressed-tensors (auto: gptq when symmetric, awq when asymmetric 4-bit)."),
    dtype: str = typer.Option("float16", help="dtype of unquantized tensors and scales: float16 | bfloat16."),
    skip: list[str] = typer.Option(["lm_head"], help="Module names (or suffixes) left unquantized; repeatable."),
    damp: Optional[float] = typer.Option(None, help="GPTQ: dampening relative to the mean Hessian diagonal."),
    block_size: Optional[int] = typer.Option(None, help="GPTQ: columns per lazy update block."),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order", help="GPTQ: decreasing-Hessian column order, static groups (default on)."),
    evaluate: bool = typer.Option(False, "--eval", help="Also report held-out perplexity of the result and of the float model."),
    eval_windows: int = typer.Option(80, help="Held-out windows of --seq-len tokens for --eval."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    trust_remote_code: bool = typer.Option(False, help="Allow model code from the checkpoint (off by default)."),
    kv_cache: Optional[str] = typer.Option(None, help="Also calibrate static KV-cache scales: fp8 (vLLM --kv-cache-dtype fp8; read from compressed-tensors checkpoints) | int8 (compound's decode loop)."),
    kv_cache_strategy: str = typer.Option("tensor", help="KV-cache scales per layer (tensor) or per KV head (attn_head)."),
    stream: bool = typer.Option(False, "--stream/--no-stream", help="Load each decoder layer from the safetensors shards of a local model directory only when it is quantized, and write it out at once: for models larger than memory."),
    offload_activations: bool = typer.Option(False, help="Keep calibration activations between layers on disk (next to --output) instead of in memory."),
    batch_size: int = typer.Option(8, help="Calibration sequences run through a layer at once; fewer need less memory."),
):
    """Quantize a causal LM layer by layer and write a deployable checkpoint."""
    import torch

    from toolkit.quant.configs import make_config
    from toolkit.quantize import CalibrationSpec
    from toolkit.quantize import quantize as run_quantize

    try:
        config = make_config(method, bits=bits, group_size=group_size, sym=sym, seed=seed, skip=tuple(skip),
                             damp=damp, block_size=block_size, act_order=act_order)
        rank = int(os.environ.get("RANK", "0"))  # under torchrun rank 0 reports, the others run quietly
        with _progress(disable=rank > 0) as bar:
            result = run_quantize(model, config, output, CalibrationSpec(dataset, samples, seq_len), fmt=fmt,
                                  dtype=getattr(torch, DTYPES.get(dtype, "float16")), overwrite=overwrite,
                                  trust_remote_code=trust_remote_code,
                                  progress=_RichProgress(bar) if rank == 0 else None,
                                  kv_cache=kv_cache, kv_cache_strategy=kv_cache_strategy, stream=stream,
                                  offload_activations=offload_activations, batch_size=batch_size)
        if rank > 0:
            return
        table = Table(title=f"compound quantize: {method} W{bits} g{group_size}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        table.add_row("output", str(result.output))
        table.add_row("wall time", f"{result.seconds:.1f} s")
        table.add_row("peak memory (RSS)", f"{result.peak_rss_mb:.0f} MiB")
        table.add_row("memory estimate", f"{result.memory.total / 2**20:.0f} MiB")
        table.add_row("size on disk", f"{_dir_size(result.output) / 2**20:.1f} MiB")
        if evaluate:
            quantized = _measure_perplexity(str(result.output), dataset, eval_windows, seq_len)
            base = _measure_perplexity(model, dataset, eval_windows, seq_len)
            table.add_row("perplexity, float model", f"{base.perplexity:.3f}")
            table.add_row("perplexity, quantized", f"{quantized.perplexity:.3f} (+{quantized.perplexity - base.perplexity:.3f})")
            table.add_row("held-out tokens scored", str(quantized.tokens))
        Console().print(table)
    except _user_errors() as err:
        _fail(err)


@app.command()
def convert(
    model: Path = typer.Option(..., help="A compound checkpoint directory."),
    fmt: str = typer.Option(..., "--format", help="Target layout: gptq | awq | compressed-tensors."),
    output: Path = typer.Option(..., "--output", "-o", help="Checkpoint directory to create."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
):
    """Re-pack a checkpoint into another layout, bit-exact, without re-quantizing (refused where the math differs)."""
    from toolkit.convert import convert as run_convert

    try:
        out = run_convert(model, fmt, output, overwrite=overwrite)
    except _user_errors() as err:
        _fail(err)
    console.print(f"wrote {fmt} checkpoint {out} ({_dir_size(out) / 2**20:.1f} MiB)")


@app.command("eval")
def evaluate(
    model: str = typer.Option(..., help="A compound checkpoint directory, or any model spec (float)."),
    base: Optional[str] = typer.Option(None, help="The model to compare with (e.g. the float original): KL, agreement, perplexity ratios."),
    heads: Optional[Path] = typer.Option(None, help="Medusa or EAGLE heads trained for --model: accepted length per slice."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Report directory (eval.json, eval.md, plots); default: <model>.eval next to a checkpoint, else eval-<model>."),
    dataset: str = typer.Option("sharegpt", help="Held-out source (its eval split)."),
    windows: int = typer.Option(16, help="Held-out windows per slice."),
    seq_len: int = typer.Option(512, help="Tokens per window."),
    kl_threshold: float = typer.Option(1.0, help="Report the share of tokens whose KL(base ‖ model) exceeds this (nats): where the model breaks."),
    generation: bool = typer.Option(True, "--generation/--no-generation", help="Run the JSON / code / factual generation checks."),
    new_tokens: int = typer.Option(96, help="Tokens decoded per generation-check prompt."),
    head_prompts: int = typer.Option(4, help="With --heads: held-out prompts per slice."),
    head_tokens: int = typer.Option(64, help="With --heads: tokens decoded per prompt."),
    overwrite: bool = typer.Option(False, help="Replace an existing report directory."),
):
    """Task-level quality on held-out slices (prose, code, non-English, structured), generation checks, accepted
    length per slice; writes eval.json and eval.md."""
    from toolkit.evaluate.generation import SETS
    from toolkit.evaluate.report import console_tables
    from toolkit.evaluate.suite import evaluate as run_eval

    path = Path(model)
    output = output or (path.with_name(path.name + ".eval") if path.is_dir() else Path(f"eval-{path.name}"))
    try:
        report = run_eval(model, output, base=base, heads=heads, dataset=dataset, windows=windows, seq_len=seq_len,
                          kl_threshold=kl_threshold, generation_sets=SETS if generation else (),
                          new_tokens=new_tokens, head_prompts=head_prompts, head_tokens=head_tokens,
                          overwrite=overwrite, say=console.log)
    except _user_errors() as err:
        _fail(err)
    for table in console_tables(report):
        Console().print(table)
    if report["worst_slice"]:
        Console().print(f"degrades most: {report['worst_slice']}")
    console.print(f"wrote {output}/eval.json and {output}/eval.md")


@app.command()
def validate(
    model: str = typer.Option(..., help="A quantized checkpoint directory (GPTQ, AWQ or compressed-tensors); with --heads, the target model (any model spec)."),
    heads: Optional[Path] = typer.Option(None, help="A draft-head directory (from train-heads): measure its accepted length on --model instead."),
    prompts: int = typer.Option(8, help="With --heads: held-out prompts decoded."),
    max_new_tokens: int = typer.Option(64, help="With --heads: tokens generated per prompt."),
    heads_dtype: str = typer.Option("float32", "--dtype", help="With --heads: the target's dtype in the decode loop (float32 | bfloat16)."),
    categories: str = typer.Option("all", help="With --heads: held-out prompt sets, comma-separated, each reported apart: all, prose, code, non-english, structured."),
    dataset: str = typer.Option("sharegpt", help="Held-out source (its eval split)."),
    windows: int = typer.Option(2, help="Held-out windows run on every path."),
    seq_len: int = typer.Option(64, help="Tokens per window (at most 256, where cpu-int4 hands over to the reference)."),
    triton_layers: Optional[int] = typer.Option(None, help="Decoder layers run on the Triton kernels (default: all on CUDA, 1 under the CPU interpreter)."),
    triton_tokens: Optional[int] = typer.Option(None, help="Tokens of window 0 run on Triton (default: all on CUDA, 16 under the CPU interpreter)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report to this JSON file."),
):
    """Check a checkpoint's hashes, run held-out tokens on every runtime path, and preview how engines serve it;
    with --heads, measure the heads' accepted length, per-head acceptance and speedup, lossless checked."""
    from toolkit.validate import validate as run_validate

    if heads is not None:
        _validate_heads(model, heads, prompts, max_new_tokens, heads_dtype, categories, json_out)
        return

    try:
        report = run_validate(model, dataset=dataset, windows=windows, seq_len=seq_len,
                              triton_layers=triton_layers, triton_tokens=triton_tokens)
    except (*_user_errors(), ValueError) as err:
        _fail(err)
    out = Console()
    out.print(f"manifest: {report.manifest_files} files, SHA-256 intact" if report.manifest_files
              else "manifest: none (compound.json absent), bytes not checked")
    paths = Table(title=f"runtime paths vs the reference ({dataset}, {windows}×{seq_len} held-out tokens)")
    for column in ("path", "layers", "positions", "max |Δ logit|", "/ max |logit|", "top-1 agreement", "ok", "note"):
        paths.add_column(column, justify="left" if column in ("path", "layers", "note") else "right")
    for p in report.paths:
        numbers = ("-", "-", "-") if p.max_logit_diff is None else \
            (f"{p.max_logit_diff:.3g}", f"{p.relative_diff:.1e}", f"{p.top1_agreement:.2%}")
        paths.add_row(p.path, p.layers, str(p.positions), *numbers, "yes" if p.ok else "[bold red]NO[/]", p.note)
    out.print(paths)
    s = report.serving
    serving = Table(title=f"serving preview: {s.quant_method}, {s.scheme}", show_lines=True)
    serving.add_column("engine")
    serving.add_column("path")
    serving.add_column("why")
    serving.add_row("vLLM, GPU", s.vllm_gpu, s.vllm_gpu_why)
    serving.add_row("vLLM, CPU", s.vllm_cpu, s.vllm_cpu_why)
    for problem in s.problems:
        serving.add_row("[bold red]problem[/]", "", problem)
    out.print(serving)
    out.print("serve it with (vLLM on GPU, vLLM on CPU, SGLang):")
    for command in (s.vllm_command, s.vllm_cpu_command, s.sglang_command):  # unwrapped, to copy and paste
        out.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
    if json_out:
        json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if not report.ok:
        console.print("[bold red]validation failed:[/] a runtime path disagrees with the reference, or an engine "
                      "cannot serve the checkpoint (see the tables above)")
        raise typer.Exit(1)


def _validate_heads(model: str, heads: Path, prompts: int, max_new_tokens: int, dtype: str, categories: str,
                    json_out: Optional[Path]) -> None:
    import torch

    from toolkit.evaluate.acceptance import recommended, validate_heads

    try:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
        reports = validate_heads(model, heads, prompts, max_new_tokens, dtype=getattr(torch, dtype),
                                 categories=[c.strip() for c in categories.split(",") if c.strip()])
    except (*_user_errors(), ValueError) as err:
        _fail(err)
    table = Table(title=f"heads {heads} drafting for {model} ({dtype}): {prompts} held-out prompts × "
                        f"{max_new_tokens} tokens")
    for column in ("mode", "shape", "accepted length", "acceptance per depth", "tokens/s", "greedy tokens/s",
                   "speedup", "draft / verify ms per step", "break-even length", "lossless"):
        table.add_column(column, justify="left" if column in ("mode", "shape", "acceptance per depth") else "right")
    for r in reports:
        table.add_row(r.mode, r.shape, f"{r.mean_accepted_length:.3f}",
                      " ".join(f"{a:.2f}" for a in r.acceptance_rate), f"{r.speculative_tokens_per_s:.1f}",
                      f"{r.greedy_tokens_per_s:.1f}", f"{r.speedup:.2f}x",
                      f"{r.draft_ms_per_step:.1f} / {r.verify_ms_per_step:.1f}", f"{r.break_even_accepted_length:.2f}",
                      "yes" if r.lossless else "[bold red]NO[/]")
    Console().print(table)
    Console().print("break-even length: the accepted length at which a step (draft + verify) costs what plain "
                    "greedy decoding takes for one token; speedup ≈ accepted length / break-even length")
    best = recommended(reports)
    Console().print(f"recommended: {best.mode} ({best.shape}), {best.speculative_tokens_per_s:.1f} tokens/s, "
                    f"{best.speedup:.2f}x plain greedy")
    if json_out:
        json_out.write_text(json.dumps([r.to_dict() for r in reports], indent=2) + "\n")
    if not all(r.lossless for r in reports):
        console.print("[bold red]validation failed:[/] speculative output differs from plain greedy decoding")
        raise typer.Exit(1)


@app.command("train-heads")
def train_heads(
    model: str = typer.Option("smollm2-135m", help="Target: alias, local directory, .gguf, Hub id, or a compound checkpoint (train against the model you serve)."),
    output: Path = typer.Option(..., "--output", "-o", help="Head directory to create."),
    head: str = typer.Option("medusa", help="Head type: medusa | eagle (EAGLE-1/2) | eagle3."),
    num_heads: int = typer.Option(4, help="Medusa: heads (tokens drafted beyond the target's own)."),
    num_layers: int = typer.Option(1, help="Medusa: residual blocks per head."),
    aux_layers: Optional[str] = typer.Option(None, help="eagle3: target layers fused, as transformers hidden_states indices = vLLM ids, e.g. 2,15,27 (default: 2, N/2, N-3)."),
    draft_vocab: int = typer.Option(32000, help="eagle3: draft vocabulary size, the most frequent trained tokens (capped at the target's vocabulary)."),
    ttt_steps: int = typer.Option(5, help="eagle3: unrolled draft steps of the training-time test."),
    depth: int = typer.Option(5, help="EAGLE: draft steps (tree depth; chain length in --select-mode chain)."),
    top_k: int = typer.Option(4, help="EAGLE: children per expanded node of the EAGLE-2 dynamic tree."),
    draft_tokens: int = typer.Option(8, help="EAGLE: tree nodes verified per step."),
    shared_lm_head: bool = typer.Option(False, "--shared-lm-head/--own-lm-heads", help="Heads share one frozen copy of the target's lm_head (Medusa-2, vLLM original_lm_head: one output product for all heads) instead of one trained output layer each."),
    dataset: str = typer.Option("sharegpt", help="Conversations: sharegpt, a .json/.jsonl/.parquet file, or a datasets id (its train split)."),
    samples: int = typer.Option(1000, help="Conversations trained on."),
    max_len: int = typer.Option(1024, help="Tokens per example at most."),
    self_distill: bool = typer.Option(True, "--self-distill/--dataset-answers", help="Answer the first user turns again with the target (default), or train on the dataset's own assistant turns."),
    distill_tokens: int = typer.Option(256, help="Self-distillation: new tokens per answer at most."),
    distill_batch: int = typer.Option(16, help="Self-distillation: prompts generated together."),
    dtype: str = typer.Option("bfloat16", help="Target dtype for self-distillation and hidden states."),
    online: bool = typer.Option(False, help="Compute hidden states while training instead of caching them."),
    stream_target: bool = typer.Option(False, "--stream-target", help="Cache the hidden states with the target read one decoder layer at a time from the shards of a local safetensors directory (a target larger than memory; needs --dataset-answers). Training and checkpoint selection still load the target."),
    batch_tokens: int = typer.Option(4096, help="Padded tokens per target forward while caching hidden states (raise it with --stream-target: each forward reads every layer)."),
    steps: int = typer.Option(600, help="Optimizer steps."),
    batch_size: int = typer.Option(8, help="Examples per optimizer step (all ranks together)."),
    micro_batch_size: int = typer.Option(4, help="Examples per forward on one rank (gradient accumulation makes up the rest)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW, warmup then cosine)."),
    warmup_steps: int = typer.Option(20, help="Linear warmup steps."),
    train_dtype: str = typer.Option("bf16", help="Head training precision: bf16 (autocast) | fp32."),
    eval_every: int = typer.Option(100, help="Steps between acceptance evaluations (and checkpoint selection)."),
    save_every: int = typer.Option(100, help="Steps between resumable checkpoints."),
    eval_prompts: int = typer.Option(4, help="Held-out prompts for checkpoint selection."),
    eval_tokens: int = typer.Option(64, help="Tokens decoded per selection prompt."),
    select_mode: str = typer.Option("tree", help="Select the checkpoint by accepted length in: tree (compound's loop) | chain (vLLM's)."),
    layout: str = typer.Option("vllm", help="Export layout: vllm (vLLM's Medusa) | medusa (FasterDecoding's)."),
    work_dir: Optional[Path] = typer.Option(None, help="Where data, hidden states and training checkpoints go (default: OUTPUT.work); rerun to resume."),
    seed: int = typer.Option(0, help="Seed for data order and initialisation."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    dry_run: bool = typer.Option(False, help="Show one rendered example with its trained tokens highlighted, then stop."),
):
    """Train draft heads on the target's own hidden states and export them for vLLM (runs under torchrun too)."""
    from toolkit.train_heads import HeadsJob
    from toolkit.train_heads import train_heads as run_train_heads
    from toolkit.heads.train import TrainConfig

    try:
        config = TrainConfig(lr=lr, warmup_steps=warmup_steps, max_steps=steps, batch_size=batch_size,
                             micro_batch_size=micro_batch_size, dtype=train_dtype, eval_every=eval_every,
                             save_every=save_every, seed=seed)
        job = HeadsJob(model=model, output=output, head=head, num_heads=num_heads, num_layers=num_layers,
                       shared_lm_head=shared_lm_head, aux_layers=_int_list(aux_layers, "--aux-layers"),
                       draft_vocab=draft_vocab, ttt_steps=ttt_steps, depth=depth, top_k=top_k,
                       draft_tokens=draft_tokens,
                       dataset=dataset, samples=samples, max_len=max_len, self_distill=self_distill,
                       distill_tokens=distill_tokens, distill_batch=distill_batch, dtype=dtype, online=online,
                       stream_target=stream_target, batch_tokens=batch_tokens, train=config, eval_prompts=eval_prompts, eval_tokens=eval_tokens, select_mode=select_mode,
                       layout=layout, work_dir=work_dir, overwrite=overwrite)
        result = run_train_heads(job, console, dry_run=dry_run)
    except (*_user_errors(), ValueError) as err:
        _fail(err)
    if result.output is None:
        return
    shape = f"{num_heads} medusa heads" if head == "medusa" else f"an {head} head"
    table = Table(title=f"compound train-heads: {shape} for {model}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("output", str(result.output))
    table.add_row("examples / tokens / trained tokens", f"{result.examples} / {result.tokens:,} / {result.trained_tokens:,}")
    table.add_row("best step", str(result.best_step))
    for key, value in result.best_metrics.items():
        table.add_row(key, f"{value:.3f}")
    for key, value in result.seconds.items():
        table.add_row(f"seconds, {key.replace('_', ' ')}", f"{value:.0f}")
    Console().print(table)
    if head != "medusa":
        _print_eagle_serving(result.output, depth, top_k, draft_tokens)


def _print_eagle_serving(output: Path, depth: int, top_k: int, draft_tokens: int) -> None:
    """The flags that serve an exported EAGLE head: vLLM's chain and SGLang's chain and tree."""
    from toolkit.heads.eagle_export import serving_flags

    flags = serving_flags(output, str(output), depth)
    out = Console()
    out.print(f"serve it with vLLM (chain of {depth}):")
    out.print(f"  vllm serve TARGET {flags['vllm']}", soft_wrap=True, markup=False, highlight=False)
    if "sglang" in flags:
        tree = flags["sglang"].replace("--speculative-eagle-topk 1", f"--speculative-eagle-topk {top_k}").replace(
            f"--speculative-num-draft-tokens {depth + 1}", f"--speculative-num-draft-tokens {draft_tokens + 1}")
        out.print("with SGLang (chain, then the EAGLE-2 tree it was selected with):")
        for line in (flags["sglang"], tree):
            out.print(f"  python -m sglang.launch_server --model-path TARGET {line}", soft_wrap=True, markup=False,
                      highlight=False)


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="A recipe YAML file (see recipes/)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Skip steps whose fingerprint and outputs are unchanged."),
    dry_run: bool = typer.Option(False, help="Print the plan (steps, fingerprints, which are cached) and run nothing."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory (default: the recipe's output, out/<recipe name>)."),
):
    """Run a recipe: quantize → evaluate → validate → heads → gates → push, each step cached by fingerprint.
    Exit status 1 when a gate fails (nothing is pushed), 2 for a bad recipe or an input a step refuses."""
    from toolkit.hub import HubError
    from toolkit.recipes import GateError, RecipeError, load_recipe, run_recipe

    try:
        loaded = load_recipe(recipe)
    except RecipeError as err:
        _fail(err)
    if output is not None:
        loaded = dataclasses.replace(loaded, output=output)
    wants_push = loaded.push is not None and loaded.push.enabled and not dry_run
    try:
        run_recipe(loaded, resume=resume, dry_run=dry_run, api=_hub_client() if wants_push else None, console=console)
    except GateError:
        raise typer.Exit(1)  # the failed gates and the summary are printed already
    except (*_user_errors(), HubError, ValueError) as err:
        _fail(err)


def _hub_client():
    """An ``HfApi`` when a Hugging Face token is configured (HF_TOKEN or ``hf auth login``), else None: no push."""
    from huggingface_hub import HfApi, get_token

    return HfApi() if get_token() else None


@app.command()
def push(
    directory: Path = typer.Argument(..., help="An artifact directory compound wrote (checkpoint or heads, with compound.json)."),
    repo: str = typer.Option(..., "--repo", help="Hub repo id, namespace/name; created when missing."),
    private: bool = typer.Option(False, "--private", help="Create the repo private (an existing repo keeps its visibility)."),
    revision: Optional[str] = typer.Option(None, help="Branch to commit to (created from main when missing); default main."),
    tag: list[str] = typer.Option([], "--tag", help="Extra model-card tag; repeatable."),
    results: Optional[Path] = typer.Option(None, help="Measured results (JSON) for the model card's tables (toolkit.hub documents the keys), or an eval.json."),
):
    """Publish an artifact with its model card as one commit; the token comes from HF_TOKEN or `hf auth login`."""
    from huggingface_hub import HfApi

    from toolkit.hub import HubError, card_results
    from toolkit.hub import push as run_push

    try:
        measured = card_results(json.loads(results.read_text())) if results else None
        out = run_push(HfApi(), directory, repo, private=private, revision=revision, tags=tag, results=measured)
    except (HubError, OSError, json.JSONDecodeError) as err:
        _fail(err)
    Console().print(f"pushed {len(out.files)} files to {out.repo_url}\ncommit {out.commit_oid}", markup=False,
                    highlight=False, soft_wrap=True)  # unwrapped, to copy


@app.command()
def decode(
    model: str = typer.Option(..., help="A compound checkpoint directory (runs its packed weights), or any model spec (float)."),
    prompt: str = typer.Option(..., help="The user message; rendered with the model's chat template."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate at most (stops early at end-of-sequence)."),
    temperature: float = typer.Option(0.0, help="0: greedy; above 0: sample at this temperature."),
    kv_cache: str = typer.Option("float", help="KV cache: float (the model dtype) | int8 (per token and head scales)."),
    seed: int = typer.Option(0, help="Sampling seed."),
):
    """Generate a reply with compound's decode loop (static KV cache) and print its statistics."""
    import torch

    from toolkit.decode import DecodeError, Decoder, SamplingConfig, generate
    from toolkit.runtime.load import load_model_or_checkpoint

    if kv_cache not in ("float", "int8"):
        _fail(ValueError(f"--kv-cache must be float or int8, got {kv_cache!r}"))
    try:
        sampling = SamplingConfig(temperature, seed=seed) if temperature > 0 else None
        loaded, tokenizer = load_model_or_checkpoint(model, torch.float32)
        ids = _chat_prompt(tokenizer, prompt)
        decoder = Decoder.from_model(loaded, len(ids) + max_new_tokens, torch.int8 if kv_cache == "int8" else None,
                                     fast_head=sampling is None)  # greedy: the argmax is all it reads
        out, stats = generate(decoder, ids, max_new_tokens, sampling, eos_token_id=tokenizer.eos_token_id)
    except (*_user_errors(), DecodeError, ValueError) as err:
        _fail(err)
    Console().print(tokenizer.decode(out[len(ids):], skip_special_tokens=True), markup=False, highlight=False)
    table = Table(title=f"compound decode: {'greedy' if sampling is None else f'T={temperature}'}, KV cache {kv_cache}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("prompt tokens", str(len(ids)))
    table.add_row("new tokens", str(stats.new_tokens))
    table.add_row("forward passes", str(stats.target_forwards))
    table.add_row("wall time (prefill + decode)", f"{stats.total_s:.2f} s")
    table.add_row("tokens/s", f"{stats.tokens_per_s:.1f}")
    Console().print(table)


def _chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn with the generation prompt, or plain ids without a chat template."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(text)["input_ids"]
