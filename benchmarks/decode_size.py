"""Greedy decode speed of compound's loop against model size, next to the memory-bandwidth bound.

At batch 1 a decode step reads every weight once, so its time cannot fall below (bytes read per step) / (memory
bandwidth). For each model of ``benchmarks/random_llama.py`` (SmolLM2 at W4 g64, whose width 576 no 128 divides;
the random ~1B and ~3B Llamas at W4 g128), quantized once with ``compound quantize --method rtn --stream``, a child
process per (model, threads, kernel, forward) loads the checkpoint the way ``compound decode`` does (fp32 float
tensors, int4 linears on a CPU int4 kernel of ``toolkit.runtime.cpu_int4``; the rescored bf16 LM head of greedy
decoding; the decoder's C++ step between the linears, ``toolkit.runtime.decode_step``, or with ``--forwards`` also its
torch forward, measured with the first kernel only), and measures:

- load: ``load_quantized`` to a ready ``Decoder`` (int4 weights packed for the kernel, the bf16 head copy made);
- prefill: the chat-templated prompt of ``PROMPT`` (about 40 tokens) in one forward;
- step: the median of ``--tokens`` single-token greedy forwards after it (what tokens/s is the inverse of);
- bytes per step: the packed int4 codes and their scales as the kernel reads them (compound's: fp32 scale and offset;
  torch's: the scale/zero pairs in bf16), the bf16 head, the KV cache at the mean position; embedding row and norms
  are below 0.1 % and left out;
- bandwidth: the best of five ``torch.sum`` over a 1 GiB float32 tensor with the same threads (a read-only stream,
  the pattern a decode step is);
- where a step's time goes: torch's profiler over eight steps, self CPU time by op, with every ``int4_mm_cpu`` call
  labelled ``int4_mm_cpu`` (compound's kernel is a pybind11 call, which the profiler does not see on its own); the
  "int4 op" column is that label's total time.

bound = bandwidth / bytes per step; ratio = bound / measured tokens/s (1.0 is the bound; issue #28 asks for at most
2). Nothing else may run during a measurement (the table header prints the load average).

    python benchmarks/decode_size.py [--sizes smollm2,1b,3b] [--threads 1,2] [--kernels avx512-bf16,avx2-fma,torch]
                                     [--forwards native,torch] [--tokens 32] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from random_llama import SIZES, make_model  # noqa: E402
from report import cpu_name, markdown_table, update_section  # noqa: E402

from toolkit.runtime.cpu_int4 import available_kernels  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache" / "decode-size"
PROMPT = "Explain what a Python list comprehension is, with an example."
SECTION = "Decode speed against model size (CPU, W4, batch 1)"
INT4_LABEL = "int4_mm_cpu"  # profiler label of every CPU int4 matmul (see ``measure``)


def group_size(size: str) -> int:
    """g64 for SmolLM2 (576 = 4.5 × 128), g128 for the others."""
    return 64 if size == "smollm2" else 128


def checkpoint(size: str) -> Path:
    """The W4 RTN checkpoint of ``size``, made once with the CLI (streamed: one layer in memory)."""
    out = CACHE / f"{size}-rtn-w4g{group_size(size)}"
    if not (out / "config.json").is_file():
        from toolkit.quant.configs import make_config
        from toolkit.quantize import QuantizeSettings

        subprocess.run(quantize_argv(make_config("rtn", bits=4, group_size=group_size(size)),
                                     QuantizeSettings(stream=True), model=make_model(size), output=out),
                       check=True, cwd=ROOT)
    return out


def read_bandwidth() -> float:
    """Bytes per second of a read-only pass over 1 GiB (best of five), with torch's current threads."""
    big = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - started)
    return big.nbytes / best


def step_bytes(decoder, position: int) -> dict[str, int]:
    """Bytes one decode step reads at cache ``position``: int4 weights (codes + scale/zero), head, KV cache."""
    weights = 0
    for layer in decoder.layers:
        packs = []
        for group in (layer.qkv, layer.gate_up):
            packs += [group._int4] if group._int4 is not None else [m._int4 for m in group.linears]
        packs += [layer.o_proj._int4, layer.down_proj._int4]
        weights += sum(p.read_bytes() for p in packs)
    head = decoder.lm_head
    head_bytes = getattr(head, "weight_bf16", head.weight).nbytes
    cache = decoder.cache
    kv = 2 * len(decoder.layers) * decoder.n_kv_heads * position * decoder.head_dim * cache.k.element_size()
    return {"weights": weights, "head": head_bytes, "kv": kv}


class LabelledStep:
    """The decoder's C++ step with each call labelled ``decode_step.<function>`` for the profiler (a pybind11 call,
    which it does not see on its own)."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        function = getattr(self.ops, name)

        def labelled(*args):
            with torch.profiler.record_function(f"decode_step.{name}"):
                return function(*args)

        return labelled


def measure(size: str, threads: int, kernel: str, forward: str, tokens: int) -> dict:
    """One child's measurement of ``size`` with ``threads`` torch threads, the CPU int4 ``kernel`` and the decoder's
    ``forward`` (``native``: its C++ step; ``torch``) (see the module docstring)."""
    from transformers import AutoTokenizer

    from toolkit.calibration import chat_prompt_ids
    from toolkit.decode import Decoder
    from toolkit.runtime import cpu_int4
    from toolkit.runtime.load import load_quantized

    torch.set_num_threads(threads)
    cpu_int4.default_kernel = lambda: kernel  # what every QuantLinear packs for in this child
    path = checkpoint(size)
    started = time.perf_counter()
    model, tokenizer = load_quantized(path)
    ids = chat_prompt_ids(tokenizer or AutoTokenizer.from_pretrained(path), PROMPT)
    decoder = Decoder.from_model(model, len(ids) + tokens + 16, fast_head=True)
    if forward == "torch":
        decoder.native_step = None
    elif decoder.native_step is None:
        raise SystemExit("the decoder's C++ step does not run on this machine; pass --forwards torch")
    decoder.prepare()
    load_s = time.perf_counter() - started
    prompt = torch.tensor(ids)
    with torch.inference_mode():
        started = time.perf_counter()
        logits, _ = decoder(prompt, 0)
        prefill_s = time.perf_counter() - started
        token, position, steps = int(logits[-1].argmax()), len(ids), []
        for _ in range(tokens):
            started = time.perf_counter()
            logits, _ = decoder(torch.tensor([token]), position)
            token = int(logits[-1].argmax())
            steps.append(time.perf_counter() - started)
            position += 1
        int4_mm_cpu = cpu_int4.int4_mm_cpu  # callers import it at call time, so the label reaches every call

        def labelled(*args, **kwargs):
            with torch.profiler.record_function(INT4_LABEL):
                return int4_mm_cpu(*args, **kwargs)

        cpu_int4.int4_mm_cpu = labelled
        if decoder.native_step is not None:
            decoder.native_step = LabelledStep(decoder.native_step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(8):
                logits, _ = decoder(torch.tensor([token]), position)
                token = int(logits[-1].argmax())
                position += 1
        cpu_int4.int4_mm_cpu = int4_mm_cpu
    events = profile.key_averages()
    ops = sorted(((e.key, e.self_cpu_time_total) for e in events), key=lambda kv: -kv[1])
    total = sum(t for _, t in ops)
    int4_s = sum(e.cpu_time_total for e in events if e.key == INT4_LABEL) / 1e6 / 8  # µs over 8 steps → s per step
    return {"size": size, "threads": threads, "load_s": load_s, "prefill_s": prefill_s, "prompt": len(ids),
            "kernel": kernel, "forward": forward, "step_s": statistics.median(steps), "bytes": step_bytes(decoder, len(ids) + tokens // 2),
            "bandwidth": read_bandwidth(), "int4_s": int4_s, "ops": [(name, t / total) for name, t in ops[:4]],
            "parameters": sum(p.numel() for p in model.parameters()) + sum(
                m.in_features * m.out_features for m in model.modules() if hasattr(m, "packed"))}


def row(result: dict) -> list[str]:
    """A table row of one measurement."""
    total = sum(result["bytes"].values())
    tokens_per_s = 1 / result["step_s"]
    bound = result["bandwidth"] / total
    ops = ", ".join(f"{name.removeprefix('aten::')} {share:.0%}" for name, share in result["ops"][:3])
    return [result["size"], f"{result['parameters'] / 1e9:.2f} B", str(result["threads"]), result["kernel"],
            result["forward"],
            f"{result['bytes']['weights'] / 1e6:.0f} + {result['bytes']['head'] / 1e6:.0f} + "
            f"{result['bytes']['kv'] / 1e6:.1f}", f"{result['bandwidth'] / 1e9:.1f}", f"{bound:.1f}",
            f"{tokens_per_s:.1f}", f"{bound / tokens_per_s:.2f}", f"{result['step_s'] * 1e3:.1f}",
            f"{result['bytes']['weights'] / result['int4_s'] / 1e9:.1f}",
            f"{result['prefill_s']:.2f}", f"{result['load_s']:.1f}", ops]


COLUMNS = ["model", "parameters", "threads", "int4 kernel", "forward", "MB read per step (int4 weights + head + KV)", "read bandwidth (GB/s)",
           "bound (tok/s)", "measured (tok/s)", "bound / measured", "step (ms)", "int4 op (GB/s in the step)", "prefill (s)", "load (s)",
           "self time by op (profiler, 8 steps)"]


FINDINGS = """Where a step's time goes, and what changed (issue #28, item 9). "native" rows run the decoder's C++ step
between the linears (`toolkit/runtime/decode_step.py`, 2026-12-06), "torch" rows its torch forward, the reference:

- 2026-12-04: the 0.2 tok/s of the 3B in "Quantizing models larger than memory" was mostly not decoding: the first
  forward packed every int4 weight for torch's op (28 s for the 3B) inside the timed 8 tokens. `Decoder.prepare()`
  now packs before decoding starts (`compound decode` prints it as load time), and GPTQ/AWQ unpacking is 1.3-3.5x
  faster. The rescored bf16 LM head runs its one-row product as torch's bf16 `mv`, half its matmul's time.
- 2026-12-05: torch's int4 op was 70-80 % of a 1B/3B step at about half the read bandwidth (it dequantizes every
  weight to fp32 and multiplies in fp32). compound's own kernel (`toolkit/runtime/cpu_int4_avx512.cpp`, the
  "avx512-bf16" rows) reads each code as the bf16 number 128 + q with one bitwise operation, multiplies 16 columns by
  two inputs with one `vdpbf16ps`, applies the exact fp32 scale and offset once per group, and prefetches 2 KiB
  ahead; it brought the 1B and 3B within 1.3-1.8x of the bound. Its fp32 scale and offset read 6-8 % more bytes than
  torch's bf16 pairs, counted in the bound.
- 2026-12-06: SmolLM2's step was dispatch-bound: of 13-15 ms on two threads, about 6 ms went to the ~200 torch
  operations per layer between the linears (norms, RoPE, cache writes, dtype casts, float64 attention, residual adds),
  1-3 µs each, more than its int4 products (the profiler column of a "torch" row lists `copy_` and friends). The C++
  step does that work in five calls per layer (RMSNorm with the residual add before it, q/k norms with RoPE and the
  cache write, float32 attention computed row by row, `silu(gate) * up`), and `int4_mm_cpu` lost its per-call casts
  (avx512-bf16 rounds fp32 x to bf16 itself): the SmolLM2 rows moved from 2.2-3.0x to within 2x of the bound on one
  and two threads, and the 1B/3B rows gained a few percent. What is left of a SmolLM2 step is the int4 products
  (about half: 120 small calls at 10-13 GB/s, where a large weight streams at 15-20) and the bf16 head (a quarter, at
  the bound's bandwidth).
- The "avx2-fma" rows are compound's kernel for CPUs without AVX-512 (`toolkit/runtime/cpu_int4_avx2.cpp`: a code
  becomes the fp32 number 1 + q/16 in three integer operations, one FMA per 8 columns, x exact in fp32), measured on
  this AVX-512 CPU: its speed against torch's op as an AVX2-only CPU runs it is in "Kernels (torch's op as on a CPU
  without AVX-512)" (1.7-1.9x faster at one row).
- Two runs of this table on the same day differ by up to 15 % in tokens/s and in the measured bandwidth, so read the
  ratios to about that."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="smollm2,1b,3b", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated CPU int4 kernels (default: every one this machine runs)")
    parser.add_argument("--forwards", default="native,torch",
                        help="comma-separated decoder forwards: native (its C++ step, every kernel), torch (its torch "
                             "forward, with the first kernel only)")
    parser.add_argument("--tokens", type=int, default=32, help="timed decode steps per run")
    parser.add_argument("--child", nargs=4, metavar=("SIZE", "THREADS", "KERNEL", "FORWARD"), help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    args.kernels = args.kernels or ",".join(available_kernels())  # after parsing: --help builds nothing
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.child[2], args.child[3], args.tokens)))
        return
    sizes = args.sizes.split(",")
    for size in sizes:
        checkpoint(size)  # made before any timing
    results = []
    for size in sizes:
        for threads in map(int, args.threads.split(",")):
            kernels, forwards = args.kernels.split(","), args.forwards.split(",")
            runs = [(kernel, "native") for kernel in kernels if "native" in forwards]
            runs += [(kernels[0], "torch")] if "torch" in forwards else []
            for kernel, forward in runs:
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                child = subprocess.run([sys.executable, "-P", __file__, "--child", size, str(threads), kernel, forward,
                                        "--tokens", str(args.tokens)], env=env, capture_output=True, text=True)
                if child.returncode:
                    sys.exit(f"{size}, {threads} threads, {kernel}, {forward} forward failed:\n{child.stderr[-3000:]}")
                results.append(json.loads(child.stdout.strip().splitlines()[-1]))
                print(markdown_table(COLUMNS, [row(results[-1])]), flush=True)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    body = (f"{cpu_name()}, torch {torch.__version__}, load average {load} after the runs, nothing else running. "
            f"Each checkpoint is `compound quantize --method rtn --bits 4 --stream` of a `benchmarks/random_llama.py` "
            f"model (SmolLM2 at g64, the random Llamas at g128, vocab 49152), loaded as `compound decode` loads it; "
            f"greedy steps after a {results[0]['prompt']}-token chat prompt, median of {args.tokens}. The bound reads "
            f"every byte of a step once at the measured read bandwidth of the same threads.\n\n"
            + markdown_table(COLUMNS, [row(r) for r in results]) + "\n\n" + FINDINGS
            + f"\n\nCommand: `{' '.join(['python benchmarks/decode_size.py', *sys.argv[1:]])}`")
    print(body)
    if not args.no_write:
        update_section(SECTION, body)


if __name__ == "__main__":
    main()
