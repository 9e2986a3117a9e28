"""Greedy decode speed of SmolLM2-135M-Instruct on this CPU, batch 1, and what an INT8 KV cache costs in quality.

Speed: 64 new tokens after a short chat prompt (prefill included in the time, as ``DecodeStats.total_s`` counts it),
median of ``--runs`` runs after one warm-up run, ``--threads`` torch threads, for

- ``transformers`` ``generate`` (fp32, its dynamic cache), the baseline;
- compound's loop (``toolkit.decode.generate`` over a static cache): fp32; bf16; fp32 with an INT8 KV cache;
- compound's loop on a W4 g64 GPTQ checkpoint (RTN) whose linears run torch's int4 CPU op (backend ``cpu-int4``),
  with the rest of the model (embedding / tied lm_head, norms) in fp32 and in bf16.

Greedy agreement: float rows against ``transformers``' fp32 tokens, W4 rows against the same
checkpoint on the dequantized reference (backend ``reference``, fp32), over the first ``--check-tokens`` tokens; at a
first difference the reference's logit margin between the two tokens is printed (a near-tie: rounding, not a bug).
Quality: perplexity through compound's loop (each held-out window prefilled into the cache, so every attention reads
the cache as stored) with a float and an INT8 cache, and the cache's memory at ``--cache-tokens`` slots.

    python benchmarks/decode.py [--checkpoint DIR] [--threads 2] [--runs 3] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
MODEL = "smollm2-135m"
PROMPT = "Write a short poem about the sea."


def make_checkpoint(out: Path) -> Path:
    """The W4 g64 RTN GPTQ checkpoint, made once with the CLI."""
    if not (out / "config.json").is_file():
        subprocess.run(["compound", "quantize", "--model", MODEL, "--method", "rtn", "--bits", "4", "--group-size", "64",
                        "--output", str(out), "--overwrite"], check=True, cwd=ROOT)
    return out


def chat_ids(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def time_compound(model, ids: list[int], new: int, runs: int, kv_dtype=None) -> tuple[float, list[int]]:
    """(median tokens/s, greedy tokens) of compound's loop; no end-of-sequence stop, so every run makes ``new``."""
    from toolkit.decode import Decoder, generate

    decoder = Decoder.from_model(model, len(ids) + new, kv_dtype)
    speeds = []
    for run in range(runs + 1):  # run 0 warms up (and prepares the int4 weights of a W4 model)
        out, stats = generate(decoder, ids, new)
        if run:
            speeds.append(stats.new_tokens / stats.total_s)
    return statistics.median(speeds), out[len(ids):].tolist()


def time_transformers(model, ids: list[int], new: int, runs: int) -> tuple[float, list[int]]:
    prompt = torch.tensor([ids])
    speeds = []
    for run in range(runs + 1):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        if run:
            speeds.append(new / (time.perf_counter() - start))
    return statistics.median(speeds), out[0, len(ids):].tolist()


def greedy(model, ids: list[int], new: int, kv_dtype=None) -> list[int]:
    from toolkit.decode import Decoder, generate

    out, _ = generate(Decoder.from_model(model, len(ids) + new, kv_dtype), ids, new)
    return out[len(ids):].tolist()


@torch.inference_mode()
def agreement(got: list[int], expected: list[int], n: int, oracle, ids: list[int]) -> str:
    """'n/n', or 'k/n' and, at the first difference k, the oracle's logit margin between its token and ours (a
    near-tie there means rounding, not a bug, picked the other token)."""
    from toolkit.decode import Decoder

    k = next((i for i, (a, b) in enumerate(zip(got[:n], expected[:n])) if a != b), n)
    if k == n:
        return f"{n}/{n}"
    prefix = torch.tensor(ids + expected[:k])
    logits, _ = Decoder.from_model(oracle, len(prefix))(prefix, 0)
    margin = (logits[-1, expected[k]] - logits[-1, got[k]]).item()
    return f"{k}/{n}: token {k} differs, reference margin {margin:.3f} logits"


@torch.inference_mode()
def loop_perplexity(model, windows: torch.Tensor, kv_dtype=None) -> float:
    """exp(mean NLL) of windows [W, T], each prefilled into compound's cache from slot 0."""
    from toolkit.decode import Decoder

    decoder = Decoder.from_model(model, windows.shape[1], kv_dtype)
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
    ids = chat_ids(tokenizer)
    new, runs, n = args.new_tokens, args.runs, args.check_tokens
    rows = []

    fp32 = load_model(MODEL, torch.float32)
    hf_speed, hf_tokens = time_transformers(fp32, ids, new, runs)
    rows.append(["transformers generate", "fp32", "float", f"{hf_speed:.1f}", "1.00×", "(the baseline)"])

    def add(name, weights, kv, speed, tokens, expected, oracle, against):
        rows.append([name, weights, kv, f"{speed:.1f}", f"{speed / hf_speed:.2f}×",
                     f"{agreement(tokens, expected, n, oracle, ids)} vs {against}"])

    speed, tokens = time_compound(fp32, ids, new, runs)
    add("compound loop", "fp32", "float", speed, tokens, hf_tokens, fp32, "transformers fp32")
    speed, tokens = time_compound(fp32, ids, new, runs, torch.int8)
    add("compound loop", "fp32", "INT8", speed, tokens, hf_tokens, fp32, "transformers fp32")
    windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
    ppl_float, ppl_int8 = loop_perplexity(fp32, windows), loop_perplexity(fp32, windows, torch.int8)
    float_bytes, int8_bytes = cache_bytes(fp32, args.cache_tokens), cache_bytes(fp32, args.cache_tokens, torch.int8)
    bf16_bytes = cache_bytes(fp32, args.cache_tokens, torch.bfloat16)

    bf16 = load_model(MODEL, torch.bfloat16)
    speed, tokens = time_compound(bf16, ids, new, runs)
    add("compound loop", "bf16", "float", speed, tokens, hf_tokens, fp32, "transformers fp32")
    del bf16, fp32

    reference, _ = load_quantized(checkpoint, torch.float32, backend="reference")
    w4_expected = greedy(reference, ids, n)
    for dtype, label in ((torch.float32, "W4 g64 (cpu-int4) + fp32"), (torch.bfloat16, "W4 g64 (cpu-int4) + bf16")):
        w4, _ = load_quantized(checkpoint, dtype, backend="cpu-int4")
        speed, tokens = time_compound(w4, ids, new, runs)
        add("compound loop", label, "float", speed, tokens, w4_expected, reference, "W4 dequantized reference")
        del w4

    columns = ["engine", "weights", "KV cache", "tokens/s", "vs transformers", f"greedy tokens equal (first {n})"]
    table = markdown_table(columns, rows)
    quality = markdown_table(
        ["KV cache", f"perplexity ({args.windows}×{args.seq_len} held-out, compound loop)",
         f"cache memory at {args.cache_tokens} tokens"],
        [["float (fp32)", f"{ppl_float:.3f}", f"{float_bytes / 2**20:.1f} MiB"],
         ["float (bf16)", "", f"{bf16_bytes / 2**20:.1f} MiB"],
         ["INT8 (+ fp32 scale per token and head)", f"{ppl_int8:.3f} ({ppl_int8 - ppl_float:+.3f})",
          f"{int8_bytes / 2**20:.1f} MiB ({1 - int8_bytes / float_bytes:.0%} less than fp32, "
          f"{1 - int8_bytes / bf16_bytes:.0%} less than bf16)"]])
    command = "python benchmarks/decode.py" + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
    body = (
        f"SmolLM2-135M-Instruct, greedy, batch 1, {new} new tokens after a {len(ids)}-token chat prompt "
        f"(\"{PROMPT}\"), prefill included; median of {runs} runs after a warm-up; torch threads = {args.threads}; "
        f"{cpu_name()}, torch {torch.__version__}. The W4 checkpoint is "
        f"`compound quantize --model {MODEL} --method rtn --bits 4 --group-size 64` (GPTQ layout), its linears on "
        "torch's int4 CPU op (`backend=\"cpu-int4\"`, bf16 compute); the tied embedding / lm_head stays in the "
        "model dtype.\n\n"
        "**Measured on a shared 2-core machine** (other jobs running): absolute tokens/s are noisy and low; the lead "
        "may rerun this on a quiet machine.\n\n"
        f"{table}\n\n{quality}\n\nCommand: `{command}`"
    )
    print(table, quality, sep="\n\n")
    if not args.no_write:
        update_section("Decode (CPU)", body)


if __name__ == "__main__":
    main()
