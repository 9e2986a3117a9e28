"""Medusa heads for SmolLM2-135M-Instruct trained on this CPU: time per phase, accepted length on held-out ShareGPT
prompts (compound's loop, static tree and vLLM's top-1 chain), speedup over plain greedy, and what an 8B target on a
GPU would cost, extrapolated from the measured per-token costs.

Each variant (own output layers, then the shared lm_head) is a ``compound train-heads`` run in a subprocess (its argv
built from the job's option dataclasses: ``benchmarks/commands.py``; the second reuses the first's data and hidden
states in the same work directory); evaluation is ``compound validate --heads``'s ``validate_heads`` on prompts
disjoint from the ones the runs selected their checkpoints on.

    python benchmarks/heads.py [--samples 256] [--steps 250] [--prompts 6] [--new-tokens 64] [--reuse] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import train_heads_argv  # noqa: E402
from report import command_line, cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
MODEL = "smollm2-135m"

# An 8B Llama-3-class target, for the extrapolation: hidden, vocab, parameters, and an H100's bf16 tensor throughput
# at a utilisation typical of these workloads (stated, not measured here).
EIGHT_B = dict(hidden=4096, vocab=128256, params=8.0e9)
GPU_FLOPS, GPU_UTILISATION, GPU_BANDWIDTH = 989e12, 0.4, 3.35e12  # H100 SXM: dense bf16, HBM3 bytes/s


def heads_job(args, output: Path, work: Path, shared: bool):
    """The ``train-heads`` job of one variant: Medusa heads with their own output layers or the shared lm_head."""
    from toolkit.heads.options import DataOptions, MedusaOptions, SelectOptions
    from toolkit.heads.train import TrainConfig
    from toolkit.train_heads import HeadsJob

    return HeadsJob(model=MODEL, output=output, head="medusa", work_dir=work, overwrite=True,
                    medusa=MedusaOptions(num_heads=args.heads, shared_lm_head=shared),
                    data=DataOptions(samples=args.samples, max_len=768, distill_tokens=args.distill_tokens),
                    train=TrainConfig(lr=args.lr, steps=args.steps, batch_size=8, micro_batch_size=8,
                                      eval_every=args.eval_every, save_every=args.eval_every),
                    select=SelectOptions(eval_prompts=3, eval_tokens=48))


def extrapolate(tau: float, heads: int, distill_tokens: float, train_tokens: float, steps_tokens: float) -> str:
    """What the same recipe costs for an 8B target on one H100, from FLOP counts (compute-bound phases) and bytes
    read per token (batch-1 decode, memory-bound)."""
    H, V, P = EIGHT_B["hidden"], EIGHT_B["vocab"], EIGHT_B["params"]
    head_params = heads * (H * H + H + V * H)
    rate = GPU_FLOPS * GPU_UTILISATION
    distill_s = 2 * P * distill_tokens / rate  # generation, batched: ~2 FLOPs per parameter and token
    hidden_s = 2 * P * train_tokens / rate  # one target forward per training token
    train_s = 6 * head_params * steps_tokens / rate  # forward + backward over the heads
    target_ms = 2 * P / GPU_BANDWIDTH * 1e3  # bytes of bf16 weights read per decode step
    heads_ms = 2 * head_params / GPU_BANDWIDTH * 1e3
    speedup = tau / (1 + heads_ms / target_ms)
    return (
        f"Extrapolation to an 8B Llama-3-class target (H {H}, V {V}) on one H100 (bf16 {GPU_FLOPS / 1e12:.0f} TFLOP/s "
        f"at {GPU_UTILISATION:.0%} utilisation, {GPU_BANDWIDTH / 1e12:.2f} TB/s), same recipe and token counts, from "
        f"FLOP counts: self-distillation ≈ {distill_s:.0f} s, hidden states ≈ {hidden_s:.0f} s, head training "
        f"≈ {train_s:.0f} s ({heads} heads = {head_params / 1e9:.2f} B parameters, {6 * head_params / 1e9:.1f} "
        f"GFLOP per trained token): an hour of it covers over 100× the data used here, which is what the accepted length "
        f"needs. Decode at batch 1 is bound by weight reads: {target_ms:.1f} ms per target step, "
        f"{heads_ms:.2f} ms for the heads, so at the same accepted length ({tau:.2f}) the bound on speedup is "
        f"≈ {speedup:.2f}× (tree verification adds compute that is free at batch 1 while memory-bound). The "
        f"accepted length itself does not transfer: heads of a larger target, trained on more data, reach 2.3-3.6 "
        f"in tree mode in the Medusa paper (arXiv 2401.10774)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--distill-tokens", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--variants", default="own,shared", help="lm-head variants: own and/or shared")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="target dtypes in the decode loop")
    parser.add_argument("--output", type=Path, default=CACHE / "heads-smollm2-medusa")
    parser.add_argument("--reuse", action="store_true", help="evaluate existing outputs without training")
    parser.add_argument("--keep-work", action="store_true",
                        help="resume the work directory's data and hidden states instead of timing them afresh")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()

    from toolkit.evaluate.acceptance import validate_heads

    work = args.output.with_name(args.output.name + ".work")
    if not args.reuse and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)  # time the whole recipe, data generation included
    rows, phases, trainings = [], [], {}
    for variant in args.variants.split(","):
        output = args.output.with_name(f"{args.output.name}-{variant}")
        job = heads_job(args, output, work, variant == "shared")
        wall = None
        if not args.reuse:
            started = time.perf_counter()
            subprocess.run(train_heads_argv(job), check=True)
            wall = time.perf_counter() - started
        timings = json.loads((job.train_dir / "timings.json").read_text())
        training = json.loads((output / "compound.json").read_text())["training"]
        trainings[variant] = training
        phases.append([variant, f"{timings['data_and_hidden_states']:.0f}", f"{timings['training']:.0f}",
                       f"{wall:.0f}" if wall is not None else f"{timings['total']:.0f}", str(training["best_step"])])
        torch.set_num_threads(2)
        for dtype in args.dtypes.split(","):
            for r in validate_heads(MODEL, output, args.prompts, args.new_tokens, dtype=getattr(torch, dtype)):
                rows.append([f"{variant} lm_head", dtype, r.mode, str(r.nodes), f"{r.mean_accepted_length:.2f}",
                             " / ".join(f"{a:.2f}" for a in r.acceptance_rate), f"{r.greedy_tokens_per_s:.1f}",
                             f"{r.speculative_tokens_per_s:.1f}", f"{r.speedup:.2f}×",
                             f"{r.draft_ms_per_step:.0f} / {r.verify_ms_per_step:.0f}",
                             f"{r.break_even_accepted_length:.2f}", "yes" if r.lossless else "NO"])
                print(rows[-1], flush=True)
    table = markdown_table(["heads", "target dtype", "proposal", "nodes", "accepted length τ",
                            "acceptance per head (depth)", "greedy tok/s", "speculative tok/s", "speedup",
                            "draft / verify ms per step", "break-even τ", "lossless"], rows)
    phase_table = markdown_table(["variant", "data + hidden states, s", "training incl. evaluations, s",
                                  "whole command, s", "best step"], phases)
    training = next(iter(trainings.values()))
    tau = max(float(row[4]) for row in rows)
    steps_tokens = training["steps"] * 8 * training["tokens"] / max(1, training["examples"])
    body = (
        f"{args.heads} Medusa heads (1 residual block each) for SmolLM2-135M-Instruct, with their own output layers "
        f"(own) or sharing the target's frozen lm_head (shared, vLLM `original_lm_head`), trained on "
        f"{training['examples']} self-distilled ShareGPT train-split conversations ({training['tokens']:,} tokens, "
        f"{training['trained_tokens']:,} assistant tokens trained), {training['steps']} steps of 8 examples, the "
        f"checkpoint chosen by accepted length on 3 held-out prompts. The second variant reuses the first's data and "
        f"hidden states (same work directory). {cpu_name()}, 2 torch threads, torch {torch.__version__}; **a shared "
        f"2-core machine**, so seconds are upper bounds.\n\n"
        f"Held-out: {args.prompts} ShareGPT eval-split prompts (disjoint from the selection prompts), "
        f"{args.new_tokens} new tokens each, greedy, compound's decode loop; heads draft in bf16.\n\n"
        f"{table}\n\n{phase_table}\n\n"
        f"{extrapolate(tau, args.heads, training['examples'] * args.distill_tokens, training['tokens'], steps_tokens)}"
        f"\n\nCommand: `{command_line()}`"
    )
    print(table, phase_table, sep="\n\n")
    if not args.no_write:
        update_section("Draft heads (Medusa, SmolLM2, CPU)", body)


if __name__ == "__main__":
    main()
