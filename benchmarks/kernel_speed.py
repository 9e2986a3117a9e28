"""W4A16 kernel benchmarks against dense matmul, for the linear shapes of SmolLM2-135M, Llama-3-8B and Llama-3-70B.

CPU: the CPU int4 kernels of ``toolkit.runtime.cpu_int4`` this machine runs (compound's AVX512-BF16 and AVX2-FMA ones,
torch's op; fp32 activations, as compound's decoder gives them) vs fp32 and bf16 ``torch.matmul``. To see torch's
side as a CPU without AVX-512 runs it, set ``ATEN_CPU_CAPABILITY=avx2`` (torch then dispatches its AVX2 kernels;
compound's AVX2-FMA kernel is the same code on either CPU) and pass ``--section``, so the default table stays.
CUDA (when present): the Triton GPTQ / AWQ / compressed-tensors kernels vs fp16 ``torch.matmul``, with the fraction
of the GPU's peak memory bandwidth each reaches.

Time is the median per call over ``--repeats`` calls after warm-up. Effective bandwidth = (bytes of the weight as the
path stores it + bytes of x) / time: packed codes + scales + zeros for int4, the dense matrix otherwise. At M ≤ 16
a linear is memory-bound, so bandwidth, not FLOP/s, is the figure of merit. On a shared, oversubscribed CPU pass
``--threads 1``: a multi-threaded op waits for its slowest thread, which the scheduler may park for a whole time
slice (2 threads at load 14 on 2 cores put a ~20 ms floor under every call).

    python benchmarks/kernel_speed.py                       # all models, M = 1 and 16, print the table
    python benchmarks/kernel_speed.py --models smollm2-135m --m 1 512 --threads 1
    python benchmarks/kernel_speed.py --write BENCHMARKS.md  # also replace the "## Kernels" section of that file
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/kernel_speed.py --kernels avx2-fma torch --section "Kernels (AVX2)" ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import command_line, cpu_name, update_section  # noqa: E402

from toolkit.runtime.cpu_int4 import KERNELS, available_kernels, int4_mm_cpu, prepare_int4_cpu  # noqa: E402

# (linear, in_features K, out_features N); q/o and k/v and gate/up share shapes.
SHAPES = {
    "smollm2-135m": [("q/o_proj", 576, 576), ("k/v_proj", 576, 192), ("gate/up_proj", 576, 1536), ("down_proj", 1536, 576)],
    "llama-3-8b": [("q/o_proj", 4096, 4096), ("k/v_proj", 4096, 1024), ("gate/up_proj", 4096, 14336),
                   ("down_proj", 14336, 4096)],
    "llama-3-70b": [("q/o_proj", 8192, 8192), ("k/v_proj", 8192, 1024), ("gate/up_proj", 8192, 28672),
                    ("down_proj", 28672, 8192)],
}
# Peak HBM bandwidth by device name (vendor datasheets, GB/s); others fall back to a measured device-to-device copy.
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
             "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "RTX 4090": 1008}


def group_size_for(K: int) -> int:
    """128, the common checkpoint choice, where it divides K; else 64 (SmolLM2's 576 = 9 · 64)."""
    return 128 if K % 128 == 0 else 64


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _random_quantized(N: int, K: int, group_size: int, gen: torch.Generator):
    """Codes uint8 [N, K], scale [N, G], zero [N, G]: speed does not depend on the values."""
    G = K // group_size
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scale = 0.01 + 0.01 * torch.rand(N, G, generator=gen)
    zero = torch.randint(1, 16, (N, G), generator=gen, dtype=torch.int32)
    return codes, scale, zero


# ---- CPU --------------------------------------------------------------------------------------------------------


def bench_cpu(models: list[str], ms: list[int], repeats: int, kernels: list[str]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in models:
        for linear, K, N in SHAPES[model]:
            group_size = group_size_for(K)
            codes, scale, zero = _random_quantized(N, K, group_size, gen)
            handles = {kernel: prepare_int4_cpu(codes, scale, zero, group_size, kernel=kernel) for kernel in kernels}
            del codes
            W = torch.randn(N, K, generator=gen)  # (N, K) fp32
            W_bf16 = W.bfloat16()
            for M in ms:
                x = torch.randn(M, K, generator=gen)
                x_bf16 = x.bfloat16()
                t_fp32 = median_seconds(lambda: x @ W.t(), repeats)
                t_bf16 = median_seconds(lambda: x_bf16 @ W_bf16.t(), repeats)
                rows.append({
                    "model": model, "linear": linear, "K": K, "N": N, "M": M, "group_size": group_size,
                    "fp32_us": t_fp32 * 1e6, "bf16_us": t_bf16 * 1e6,
                    "fp32_gbps": (W.numel() * 4 + x.numel() * 4) / t_fp32 / 1e9,
                    "bf16_gbps": (W.numel() * 2 + x.numel() * 2) / t_bf16 / 1e9,
                    "int4": {},
                })
                for kernel, handle in handles.items():
                    t_int4 = median_seconds(lambda: int4_mm_cpu(x, handle), repeats)
                    rows[-1]["int4"][kernel] = (t_int4 * 1e6, (handle.read_bytes() + x.numel() * 4) / t_int4 / 1e9)
                print(_cpu_line(rows[-1]), flush=True)
            del W, W_bf16, handles
    return rows


def _cpu_line(r: dict) -> str:
    """One row: dense times, then each int4 kernel's time and bandwidth, fastest kernel first."""
    fastest_us = next(iter(r["int4"].values()))[0]
    kernels = " | ".join(f"{us:.0f}" for us, _ in r["int4"].values())
    bandwidths = " / ".join(f"{gbps:.1f}" for _, gbps in r["int4"].values())
    return (f"| {r['model']} | {r['linear']} | {r['K']}→{r['N']} | {r['M']} | {r['fp32_us']:.0f} | {r['bf16_us']:.0f} | "
            f"{kernels} | {r['fp32_us'] / fastest_us:.2f}× | {r['bf16_us'] / fastest_us:.2f}× | "
            f"{r['fp32_gbps']:.1f} / {r['bf16_gbps']:.1f} / {bandwidths} |")


def cpu_markdown(rows: list[dict], kernels: list[str], threads: int, load: tuple[float, float, float]) -> str:
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    header = [
        f"CPU: {cpu_name()}, torch {torch.__version__}"
        + (f" with ATEN_CPU_CAPABILITY={capability} (torch's kernels as a CPU with only that runs them)" if capability else "")
        + f", {threads} thread(s), load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} during the run. int4 "
        "kernels on fp32 activations: " + ", ".join(f"`{k}`" for k in kernels) + " (`avx512-bf16` and `avx2-fma`: "
        "compound's, `toolkit/runtime/cpu_int4_avx512.cpp` and `cpu_int4_avx2.cpp`; `torch`: "
        "`_weight_int4pack_mm_for_cpu` in bf16, its fp32/fp16 paths being a scalar fallback, 50–300× slower); "
        f"the ratios are the first ({kernels[0]}). Group size 128, or 64 where 128 does not divide K. "
        "Bandwidth = (weight bytes as the kernel reads them + x bytes) / time.",
        "",
        f"| model | linear | K→N | M | fp32 mm µs | bf16 mm µs | {' | '.join(f'int4 {k} µs' for k in kernels)} | "
        f"int4 vs fp32 | int4 vs bf16 | GB/s fp32 / bf16 / {' / '.join(kernels)} |",
        "|---|---|---|---|---|---|" + "---|" * len(kernels) + "---|---|---|",
    ]
    return "\n".join(header + [_cpu_line(r) for r in rows])


# ---- CUDA -------------------------------------------------------------------------------------------------------


def _peak_gbps() -> tuple[float, str]:
    name = torch.cuda.get_device_name()
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps, f"{name} datasheet"
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    import triton.testing

    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6, f"{name} measured copy"


def bench_cuda(models: list[str], ms: list[int], peak: float) -> list[dict]:
    import triton.testing

    from toolkit.kernels import reference as R
    from toolkit.kernels.w4a16_awq import awq_w4a16
    from toolkit.kernels.w4a16_ct import ct_w4a16
    from toolkit.kernels.w4a16_gptq import gptq_w4a16

    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in models:
        for linear, K, N in SHAPES[model]:
            group_size = group_size_for(K)
            codes, scale, zero = _random_quantized(N, K, group_size, gen)
            g_idx = torch.arange(K, dtype=torch.int32) // group_size
            gptq = {k: v.cuda() for k, v in R.pack_gptq(codes, scale, zero, g_idx).items()}
            awq = {k: v.cuda() for k, v in R.pack_awq(codes, scale, zero).items()}
            ct = {k: v.cuda() for k, v in R.pack_ct(codes, scale, None).items()}
            W = torch.randn(N, K, device="cuda", dtype=torch.float16)
            packed_bytes = N * K // 2 + scale.numel() * 2 + zero.numel() // 2
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                runs = {
                    "fp16 mm": (lambda: x @ W.t(), W.numel() * 2),
                    "gptq": (lambda: gptq_w4a16(x, gptq["qweight"], gptq["qzeros"], gptq["scales"], gptq["g_idx"],
                                                group_size), packed_bytes),
                    "awq": (lambda: awq_w4a16(x, awq["qweight"], awq["qzeros"], awq["scales"], group_size), packed_bytes),
                    "ct": (lambda: ct_w4a16(x, ct["weight_packed"], ct["weight_scale"], group_size), packed_bytes),
                }
                row = {"model": model, "linear": linear, "K": K, "N": N, "M": M}
                for name, (fn, weight_bytes) in runs.items():
                    t_ms = triton.testing.do_bench(fn, return_mode="median")
                    row[name] = (t_ms * 1e3, (weight_bytes + x.numel() * 2) / t_ms / 1e6 / peak)
                rows.append(row)
                print(_cuda_line(row), flush=True)
    return rows


def _cuda_line(r: dict) -> str:
    cells = " | ".join(f"{r[name][0]:.1f} ({100 * r[name][1]:.0f}%)" for name in ("fp16 mm", "gptq", "awq", "ct"))
    return f"| {r['model']} | {r['linear']} | {r['K']}→{r['N']} | {r['M']} | {cells} |"


def cuda_markdown(rows: list[dict], peak: float, source: str) -> str:
    return "\n".join([
        f"GPU: peak bandwidth {peak:.0f} GB/s ({source}). Cells: µs per call (fraction of peak bandwidth); "
        "fp16 activations, group size 128 (64 where 128 does not divide K).",
        "",
        "| model | linear | K→N | M | fp16 mm | Triton GPTQ | Triton AWQ | Triton CT |",
        "|---|---|---|---|---|---|---|---|",
        *[_cuda_line(r) for r in rows],
    ])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--m", nargs="+", type=int, default=[1, 16], help="rows of x (tokens per call)")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per measurement (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--kernels", nargs="+", default=None, choices=KERNELS,
                        help="CPU int4 kernels to time (default: every one this machine runs, fastest first)")
    parser.add_argument("--write", metavar="PATH", help="replace the --section section of this markdown file")
    parser.add_argument("--section", default="Kernels", help="the section --write replaces")
    args = parser.parse_args(argv)
    runs = available_kernels()  # after parsing: --help builds nothing
    if missing := [kernel for kernel in args.kernels or () if kernel not in runs]:
        parser.error(f"--kernels {' '.join(missing)}: not built on this machine; it runs {' '.join(runs)}")
    args.kernels = args.kernels or runs
    if args.threads:
        torch.set_num_threads(args.threads)

    parts = []
    rows = bench_cpu(args.models, args.m, args.repeats, args.kernels)
    parts.append(cpu_markdown(rows, args.kernels, torch.get_num_threads(), os.getloadavg()))
    if torch.cuda.is_available():
        peak, source = _peak_gbps()
        parts.append(cuda_markdown(bench_cuda(args.models, args.m, peak), peak, source))
    else:
        parts.append("GPU: no CUDA device in this run (none was lent to the task that wrote it), so the Triton "
                     "kernels' GPU table is still to be measured; they are tested under TRITON_INTERPRET=1.")
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    parts.insert(0, f"Command: `{command_line(f'ATEN_CPU_CAPABILITY={capability}' if capability else '')}`")
    markdown = "\n\n".join(parts)
    print(markdown)
    if args.write:
        update_section(args.section, markdown, Path(args.write))
    return markdown


if __name__ == "__main__":
    main()
