"""Greedy decode speed of SmolLM2-135M-Instruct on this CPU, batch 1, side by side with GPTQModel, and what an INT8
KV cache costs in quality.

Speed: 64 new tokens after each of ``PROMPTS`` (chat-templated; prefill included in the time, as
``DecodeStats.total_s`` counts it), median over prompts x ``--runs`` runs after one warm-up run, ``--threads`` torch
threads, for

- ``transformers`` ``generate`` (fp32, its dynamic cache), the baseline;
- compound's loop (``toolkit.decode.generate`` over a static cache): fp32; bf16; fp32 with an INT8 KV cache;
- compound's loop on a W4 g64 GPTQ checkpoint (RTN) whose linears run the CPU int4 kernel (backend ``cpu-int4``:
  compound's own where the CPU has AVX512-BF16 or AVX2, else torch's op),
  with the rest of the model (embedding / tied lm_head, norms) in fp32 and in bf16;
- GPTQModel (its own venv, ``benchmarks/peers/setup.sh gptqmodel``) on the same checkpoint and prompts, each of its
  CPU backends, in bf16 (its int4 kernels take fp16/bf16 only), through ``transformers`` ``generate``.

Greedy agreement, per prompt over the first ``--check-tokens`` tokens: float rows against ``transformers``' fp32
tokens, W4 rows against the same checkpoint on the dequantized reference (backend ``reference``) in the row's own
dtype; at a first difference the logit margin between the two tokens is printed (float rows: transformers fp32's; W4
rows: the fp32 reference's), a near-tie where rounding, not a bug, picked the other token. Quality: perplexity
through compound's loop (each held-out window prefilled into the cache, so every attention reads the cache as
stored) with a float and an INT8 cache, and the cache's memory at ``--cache-tokens`` slots.

    python benchmarks/decode.py [--checkpoint DIR] [--threads 2] [--runs 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from report import cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
GPTQMODEL_PYTHON = ROOT / "benchmarks" / ".venvs" / "gptqmodel" / "bin" / "python"
MODEL = "smollm2-135m"
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a Python list comprehension is, with an example.",
    "Give me a JSON object describing three fruits and their colors.",
    "What were the main causes of the French Revolution?",
)


def make_checkpoint(out: Path) -> Path:
    """The W4 g64 RTN GPTQ checkpoint, made once with the CLI."""
    if not (out / "config.json").is_file():
        from toolkit.quant.configs import make_config

        subprocess.run(quantize_argv(make_config("rtn", bits=4, group_size=64), model=MODEL, output=out), check=True,
                       cwd=ROOT)
    return out


def chat_ids(tokenizer) -> list[list[int]]:
    """Token ids of each prompt, chat-templated with the generation prompt."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for prompt in PROMPTS]


def time_compound(model, prompts: list[list[int]], new: int, runs: int, kv_dtype=None,
                  fast_head: bool = False) -> tuple[float, list]:
    """(median tokens/s over prompts x runs, greedy tokens per prompt) of compound's loop; no end-of-sequence stop,
    so every run makes ``new`` tokens."""
    from toolkit.decode import Decoder, generate

    decoder = Decoder.from_model(model, max(map(len, prompts)) + new, kv_dtype, fast_head=fast_head)
    speeds, tokens = [], []
    for ids in prompts:
        for run in range(runs + 1):  # run 0 warms up (and prepares the int4 weights of a W4 model)
            out, stats = generate(decoder, ids, new)
            if run:
                speeds.append(stats.new_tokens / stats.total_s)
        tokens.append(out[len(ids):].tolist())
    return statistics.median(speeds), tokens


def time_transformers(model, prompts: list[list[int]], new: int, runs: int) -> tuple[float, list]:
    speeds, tokens = [], []
    for ids in prompts:
        prompt = torch.tensor([ids])
        for run in range(runs + 1):
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            if run:
                speeds.append(new / (time.perf_counter() - start))
        tokens.append(out[0, len(ids):].tolist())
    return statistics.median(speeds), tokens


def time_gptqmodel(checkpoint: Path, prompts: list[list[int]], new: int, runs: int, threads: int) -> list[dict]:
    """GPTQModel's backends on ``checkpoint`` (``benchmarks/peers/decode_gptqmodel.py`` in its venv), one dict per
    backend; [] when its venv is missing."""
    if not GPTQMODEL_PYTHON.is_file():
        print(f"GPTQModel skipped: no venv at {GPTQMODEL_PYTHON} (bash benchmarks/peers/setup.sh gptqmodel)")
        return []
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompts, f)
        f.flush()
        done = subprocess.run([str(GPTQMODEL_PYTHON), str(ROOT / "benchmarks" / "peers" / "decode_gptqmodel.py"),
                               "--checkpoint", str(checkpoint), "--prompts", f.name, "--new", str(new),
                               "--runs", str(runs), "--threads", str(threads)],
                              capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def gptqmodel_version() -> str:
    done = subprocess.run([str(GPTQMODEL_PYTHON), "-P", "-c", "import gptqmodel; print(gptqmodel.__version__)"],
                          capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else "?"


def greedy(model, prompts: list[list[int]], new: int, kv_dtype=None) -> list[list[int]]:
    from toolkit.decode import Decoder, generate

    decoder = Decoder.from_model(model, max(map(len, prompts)) + new, kv_dtype)
    return [generate(decoder, ids, new)[0][len(ids):].tolist() for ids in prompts]


@torch.inference_mode()
def agreement(got: list[list[int]], expected: list[list[int]], n: int, oracle, prompts: list[list[int]]) -> str:
    """Per prompt, how many of the first ``n`` tokens equal the expected ones: "n/n on all P prompts", or each
    prompt's count and, at its first difference k, the oracle's logit margin between the expected token and ours
    after the expected prefix (a near-tie there means rounding, not a bug, picked the other token)."""
    from toolkit.decode import Decoder

    parts = []
    for ids, ours, theirs in zip(prompts, got, expected):
        k = next((i for i, (a, b) in enumerate(zip(ours[:n], theirs[:n])) if a != b), n)
        if k == n:
            parts.append(f"{n}")
            continue
        prefix = torch.tensor(ids + theirs[:k])
        logits, _ = Decoder.from_model(oracle, len(prefix))(prefix, 0)
        parts.append(f"{k} (margin {(logits[-1, theirs[k]] - logits[-1, ours[k]]).item():.3f})")
    if all(part == f"{n}" for part in parts):
        return f"{n}/{n} on all {len(parts)} prompts"
    return " · ".join(parts)


@torch.inference_mode()
def loop_perplexity(model, windows: torch.Tensor, kv_dtype=None, kv_scales=None) -> float:
    """exp(mean NLL) of windows [W, T], each prefilled into compound's cache from slot 0 (an INT8 cache with fixed
    ``kv_scales`` when given, else scaled per token and head)."""
    from toolkit.decode import Decoder

    decoder = Decoder.from_model(model, windows.shape[1], kv_dtype, kv_scales=kv_scales)
    nll, count = 0.0, 0
    for window in windows:
        logits, _ = decoder(window, 0)  # (T, vocab)
        nll += torch.nn.functional.cross_entropy(logits[:-1].float(), window[1:], reduction="sum").item()
        count += window.shape[0] - 1
    return float(torch.tensor(nll / count).exp())


def cache_bytes(model, slots: int, kv_dtype=None) -> int:
    from toolkit.decode import Decoder

    cache = Decoder.from_model(model, slots, kv_dtype).cache
    tensors = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.quantized else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None, help="W4 checkpoint (default: made with compound quantize)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=2048)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from toolkit.calibration import eval_windows
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    checkpoint = args.checkpoint or make_checkpoint(CACHE / "decode-smollm2-rtn-w4g64")
    tokenizer = load_tokenizer(MODEL)
    prompts = chat_ids(tokenizer)
    new, runs, n = args.new_tokens, args.runs, args.check_tokens
    rows = []

    fp32 = load_model(MODEL, torch.float32)
    hf_speed, hf_tokens = time_transformers(fp32, prompts, new, runs)
    rows.append(["transformers generate", "fp32", "float", f"{hf_speed:.1f}", "1.00×", "(the baseline)"])

    def add(name, weights, kv, speed, tokens, expected, oracle, against):
        rows.append([name, weights, kv, f"{speed:.1f}", f"{speed / hf_speed:.2f}×",
                     f"{agreement(tokens, expected, n, oracle, prompts)} vs {against}"])

    speed, tokens = time_compound(fp32, prompts, new, runs)
    add("compound loop", "fp32", "float", speed, tokens, hf_tokens, fp32, "transformers fp32")
    speed, tokens = time_compound(fp32, prompts, new, runs, torch.int8)
    add("compound loop", "fp32", "INT8", speed, tokens, hf_tokens, fp32, "transformers fp32")
    windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
    ppl_float, ppl_int8 = loop_perplexity(fp32, windows), loop_perplexity(fp32, windows, torch.int8)
    float_bytes, int8_bytes = cache_bytes(fp32, args.cache_tokens), cache_bytes(fp32, args.cache_tokens, torch.int8)
    bf16_bytes = cache_bytes(fp32, args.cache_tokens, torch.bfloat16)

    bf16 = load_model(MODEL, torch.bfloat16)
    speed, tokens = time_compound(bf16, prompts, new, runs)
    add("compound loop", "bf16", "float", speed, tokens, hf_tokens, fp32, "transformers fp32")
    del bf16, fp32

    # W4 rows: tokens against the dequantized reference in the row's dtype; margins from the fp32 reference's logits
    oracle, _ = load_quantized(checkpoint, torch.float32, backend="reference")
    w4_speed = {}
    for dtype, label, fast_head in ((torch.float32, "fp32", False), (torch.float32, "fp32", True),
                                    (torch.bfloat16, "bf16", False)):
        reference = oracle if dtype == torch.float32 else load_quantized(checkpoint, dtype, backend="reference")[0]
        expected = greedy(reference, prompts, n)
        w4, _ = load_quantized(checkpoint, dtype, backend="cpu-int4")
        name = f"W4 g64 (cpu-int4) + {label}" + (", rescored bf16 head" if fast_head else "")
        w4_speed[name], tokens = time_compound(w4, prompts, new, runs, fast_head=fast_head)
        add("compound loop", name, "float", w4_speed[name], tokens, expected, oracle,
            f"W4 dequantized reference ({label})")
        del w4
    peers = time_gptqmodel(checkpoint, prompts, new, runs, args.threads)
    for peer in peers:
        if "error" in peer:
            rows.append([f"GPTQModel {gptqmodel_version()}", f"W4 g64 ({peer['backend']}) + bf16", "float",
                         "–", "–", f"refused: {peer['error']}"])
            continue
        add(f"GPTQModel {gptqmodel_version()} (transformers generate)", f"W4 g64 ({peer['backend']}) + bf16",
            "float", peer["tokens_per_s"], peer["tokens"], expected, oracle, "W4 dequantized reference (bf16)")
    del reference, oracle

    columns = ["engine", "weights", "KV cache", "tokens/s", "vs transformers",
               f"greedy tokens equal (first {n}, per prompt)"]
    table = markdown_table(columns, rows)
    fastest = max((p for p in peers if "error" not in p), key=lambda p: p["tokens_per_s"], default=None)
    versus = ("" if fastest is None else
              f"\n\nAgainst GPTQModel's fastest CPU backend ({fastest['backend']}, {fastest['tokens_per_s']:.1f} "
              "tokens/s, same checkpoint, prompts and threads): "
              + ", ".join(f"compound {name} **{speed / fastest['tokens_per_s']:.2f}×**"
                          for name, speed in w4_speed.items()) + ".")
    quality = markdown_table(
        ["KV cache", f"perplexity ({args.windows}×{args.seq_len} held-out, compound loop)",
         f"cache memory at {args.cache_tokens} tokens"],
        [["float (fp32)", f"{ppl_float:.3f}", f"{float_bytes / 2**20:.1f} MiB"],
         ["float (bf16)", "", f"{bf16_bytes / 2**20:.1f} MiB"],
         ["INT8 (+ fp32 scale per token and head)", f"{ppl_int8:.3f} ({ppl_int8 - ppl_float:+.3f})",
          f"{int8_bytes / 2**20:.1f} MiB ({1 - int8_bytes / float_bytes:.0%} less than fp32, "
          f"{1 - int8_bytes / bf16_bytes:.0%} less than bf16)"]])
    from toolkit.runtime.cpu_int4 import default_kernel

    command = "python benchmarks/decode.py" + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (
        f"SmolLM2-135M-Instruct, greedy, batch 1, {new} new tokens after each of {len(prompts)} chat prompts "
        f"({len(min(prompts, key=len))}–{len(max(prompts, key=len))} tokens: "
        + "; ".join(f"\"{p}\"" for p in PROMPTS) +
        f"), prefill included; median over prompts × {runs} runs after a warm-up; torch threads = {args.threads}; "
        f"{cpu_name()}, torch {torch.__version__}, load average {load} at the end. The W4 checkpoint is "
        f"`compound quantize --model {MODEL} --method rtn --bits 4 --group-size 64` (GPTQ layout); compound runs its "
        f"linears on the CPU int4 kernel `{default_kernel()}` (`backend=\"cpu-int4\"`, q/k/v and gate/up fused into "
        "one call each), and a float32 model's work between them in its C++ decode step "
        "(`toolkit/runtime/decode_step.py`); the tied embedding / lm_head stays in the model dtype, or with the rescored head "
        "(`Decoder.from_model(..., fast_head=True)`, what `compound decode` uses for greedy decoding) runs as a bf16 "
        "matmul whose top 16 logits per row are recomputed in fp32. GPTQModel loads the same directory "
        "(`GPTQModel.load(..., backend=...)`, bf16) and decodes with `transformers` `generate`.\n\n"
        f"{table}{versus}\n\n"
        "Greedy agreement: with fp32 activations the int4 path reproduces the dequantized "
        "reference token for token on every prompt, with the exact or the rescored head; with the whole model in "
        "bf16 (norms, attention, residual stream, lm_head), greedy paths part where two tokens nearly tie, for "
        "GPTQModel as for compound, and the margin printed there is the fp32 reference's.\n\n"
        f"{quality}\n\nCommand: `{command}`"
    )
    print(table, versus, quality, sep="\n\n")
    if not args.no_write:
        update_section("Decode (CPU)", body)


if __name__ == "__main__":
    main()
