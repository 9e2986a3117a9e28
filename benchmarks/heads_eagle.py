"""EAGLE-3 and EAGLE-1 heads for SmolLM2-135M-Instruct trained on this CPU: time per phase, accepted length on
held-out ShareGPT prompts (all, code, non-English) in compound's loop for SGLang's dynamic tree and vLLM's chain,
tokens/s against plain greedy, the shape ``compound validate`` recommends, Medusa on the same prompts, and the two
levers stacked (W4 target + EAGLE-3).

Training is a ``compound train-heads`` run per head in a subprocess (its argv built from the job's option dataclasses:
``benchmarks/commands.py``; both heads share one work directory, so the second reuses the first's self-distilled
data); evaluation is
``toolkit.evaluate.acceptance.validate_heads`` (what ``compound validate --heads`` runs) on prompts disjoint from the
ones the runs selected their checkpoints on.

    python benchmarks/heads_eagle.py [--kinds eagle3,eagle] [--reuse] [--threads 1] [--section TITLE] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import train_heads_argv  # noqa: E402
from decode import make_checkpoint  # noqa: E402
from report import command_line, cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
MODEL = "smollm2-135m"
W4_CHECKPOINT = CACHE / "decode-smollm2-rtn-w4g64"  # made by benchmarks/decode.py (RTN W4 g64, GPTQ layout)
MEDUSA = CACHE / "heads-smollm2-medusa-own"  # made by benchmarks/heads.py


def heads_job(args, kind: str):
    """The ``train-heads`` job of one head kind (``eagle3`` or ``eagle``), selected on SGLang's default tree."""
    from toolkit.heads.options import DataOptions, EagleOptions, SelectOptions
    from toolkit.heads.train import TrainConfig
    from toolkit.train_heads import HeadsJob

    return HeadsJob(model=MODEL, output=CACHE / f"heads-smollm2-{kind}", head=kind, work_dir=args.work, overwrite=True,
                    eagle=EagleOptions(draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, depth=5, top_k=4,
                                       draft_tokens=8),
                    data=DataOptions(samples=args.samples, max_len=768, distill_tokens=128),
                    train=TrainConfig(lr=1e-3, steps=args.steps, batch_size=8, micro_batch_size=4, eval_every=200,
                                      save_every=200),
                    select=SelectOptions(eval_prompts=3, eval_tokens=48))


def report_row(name: str, r) -> list[str]:
    return [name, r.mode, r.shape, f"{r.mean_accepted_length:.2f}", " / ".join(f"{a:.2f}" for a in r.acceptance_rate),
            f"{r.greedy_tokens_per_s:.1f}", f"{r.speculative_tokens_per_s:.1f}", f"{r.speedup:.2f}×",
            f"{r.draft_ms_per_step:.0f} / {r.verify_ms_per_step:.0f}", f"{r.break_even_accepted_length:.2f}",
            "yes" if r.lossless else "NO"]


def stacked(args, head_dir: Path, shape) -> list[list[str]]:
    """fp32 greedy, W4 greedy and W4 + EAGLE-3 (the head trained on the float target) in compound's loop."""
    from toolkit.decode import greedy_outputs
    from toolkit.evaluate.acceptance import heldout_prompts, measure_eagle
    from toolkit.heads.eagle_export import load_eagle
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    tokenizer = load_tokenizer(MODEL)
    prompts = heldout_prompts(tokenizer, args.prompts, skip=4)
    rows = []
    fp32 = load_model(MODEL, torch.float32)
    out, seconds = greedy_outputs(fp32, prompts, args.new_tokens, tokenizer.eos_token_id)
    base = sum(len(o) - len(p) for o, p in zip(out, prompts)) / seconds
    rows.append(["fp32", "greedy", "-", f"{base:.1f}", "1.00×", "-"])
    del fp32
    w4, _ = load_quantized(W4_CHECKPOINT, torch.float32, backend="cpu-int4")
    out, seconds = greedy_outputs(w4, prompts, args.new_tokens, tokenizer.eos_token_id)
    w4_rate = sum(len(o) - len(p) for o, p in zip(out, prompts)) / seconds
    rows.append(["W4 g64 RTN (cpu-int4)", "greedy", "-", f"{w4_rate:.1f}", f"{w4_rate / base:.2f}×", "-"])
    head = load_eagle(head_dir).float().attach(w4)
    r = measure_eagle(w4, head, prompts, args.new_tokens, shape, "stacked", tokenizer.eos_token_id, out, seconds)
    rows.append(["W4 g64 RTN (cpu-int4)", f"+ EAGLE-3, {r.shape}", f"{r.mean_accepted_length:.2f}",
                 f"{r.speculative_tokens_per_s:.1f}", f"{r.speculative_tokens_per_s / base:.2f}×",
                 "yes" if r.lossless else "NO (vs W4 greedy)"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="eagle3,eagle")
    parser.add_argument("--samples", type=int, default=768)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for training and evaluation")
    parser.add_argument("--section", default="Draft heads (EAGLE, SmolLM2, CPU)", help="BENCHMARKS.md section")
    parser.add_argument("--work", type=Path, default=CACHE / "heads-smollm2-eagle.work")
    parser.add_argument("--reuse", action="store_true", help="evaluate existing outputs without training")
    parser.add_argument("--distilled-earlier", default=None, help="how the work directory's conversations were made "
                        "when an earlier run made them (its timings then show no self-distillation), for the text")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()

    from toolkit.evaluate.acceptance import recommended, validate_heads
    from toolkit.heads.kinds.eagle import trained_shape

    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    rows, phases, recommendations, outputs = [], [], [], {}
    for kind in kinds:
        job = heads_job(args, kind)
        outputs[kind] = job.output
        if not args.reuse:
            subprocess.run(train_heads_argv(job), check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        timings = json.loads((job.train_dir / "timings.json").read_text())
        training = json.loads((job.output / "compound.json").read_text())["training"]
        phases.append([kind, str(training["examples"]), f"{training['tokens']:,}",
                       f"{timings['data_and_hidden_states']:.0f}", f"{timings['training']:.0f}",
                       f"{timings['total'] / 60:.1f}", f"{training['best_step']} of {training['steps']}"])
        reports = validate_heads(MODEL, job.output, args.prompts, args.new_tokens,
                                 categories=("all", "code", "non-english"))
        rows += [report_row(kind, r) for r in reports]
        best = recommended([r for r in reports if "(" not in r.mode])
        recommendations.append(f"{kind}: {best.mode} ({best.shape}), {best.speedup:.2f}×")
        for row in rows[-len(reports):]:
            print(row, flush=True)
    if MEDUSA.exists():
        rows += [report_row("medusa (own lm_heads)", r) for r in validate_heads(MODEL, MEDUSA, args.prompts,
                                                                                 args.new_tokens)]
    stack_rows = stacked(args, outputs["eagle3"], trained_shape(outputs["eagle3"])[0]) \
        if "eagle3" in kinds and make_checkpoint(W4_CHECKPOINT) else []

    table = markdown_table(["head", "prompts / proposal", "shape", "accepted length τ", "acceptance per depth",
                            "greedy tok/s", "speculative tok/s", "speedup", "draft / verify ms per step",
                            "break-even τ", "lossless"], rows)
    phase_table = markdown_table(["head", "conversations", "tokens", "data + hidden states, s",
                                  "training incl. evaluations, s", "whole command, min", "best step"], phases)
    stack_table = markdown_table(["target", "decoding", "τ", "tokens/s", "vs fp32 greedy", "lossless"], stack_rows)
    names = {"eagle3": f"EAGLE-3 (draft vocabulary {args.draft_vocab}, aux layers 2/15/27, training-time test of "
                       f"{args.ttt_steps} steps)", "eagle": "EAGLE-1"}
    threads = "one thread" if args.threads == 1 else f"{args.threads} threads"
    body = (
        " and ".join(names[kind] for kind in kinds) + (" heads" if len(kinds) > 1 else " head")
        + " for SmolLM2-135M-Instruct, trained on " + ("the same " if len(kinds) > 1 else "")
        + f"{args.samples} self-distilled ShareGPT train-split conversations, {args.steps} steps of 8, checkpoint "
        f"chosen by accepted length (dynamic tree: depth 5, top-4, 8 nodes) on 3 held-out prompts. {cpu_name()}, "
        f"torch {torch.__version__}, training and evaluation on "
        + ("**one torch thread** (the machine is shared: two processes with 2 threads each on 2 cores spin in OpenMP "
           "barriers and run 20× slower)." if args.threads == 1 else
           f"**{args.threads} torch threads** with nothing else running.")
        + (f" Self-distillation: {args.distilled_earlier}" if args.distilled_earlier else "") + "\n\n"
        f"Held-out: {args.prompts} ShareGPT eval-split prompts per set (the non-English set has only the few that "
        f"exist), {args.new_tokens} new tokens each, greedy, target in fp32. `tree` is SGLang's kind of proposal "
        f"(`--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 9`), `chain` vLLM's "
        f"(`num_speculative_tokens` 5); the other shapes are what `compound validate --heads` tries to recommend "
        f"the fastest. Heads draft in bf16, the target verifies in fp32."
        + (" Medusa: the heads of the section above (256 conversations, 250 steps), same prompts." if MEDUSA.exists()
           else "") + "\n\n"
        f"{table}\n\nRecommended (most tokens/s, all prompts): " + "; ".join(recommendations) + f"\n\n{phase_table}\n\n"
        + (f"Both levers (same {args.prompts} prompts, {threads}; the EAGLE-3 head was trained against the float "
           f"target):\n\n{stack_table}\n\n" + "The W4 rows' lossless column compares speculative with plain greedy decoding of the same W4 model: torch's "
           "int4 CPU op computes in bf16, and a tree forward (9 rows) rounds differently from a one-token forward, so "
           "near-ties can flip, as in the bf16 rows of the Medusa section (the likely cause; the flipped margins were "
           "not inspected here); on the fp32 target every row is token-identical. " + "\n\n" if stack_rows else "")
        + "Peers: SpecForge 0.2.0 pins torch 2.11.0 and sglang 0.5.14 (a CUDA build), so it cannot install beside "
        "torch 2.13 CPU. speculators 0.9.0 would install in a venv of its own (torch <= 2.14.1, transformers <= "
        "5.19), but its data path asks a vLLM server for the hidden states (`speculators.data_generation.vllm_client`) "
        "and its trainer targets an accelerator (`torch.accelerator`, FSDP); it was not run here, so there is no "
        "side-by-side training time or accepted length.\n\n"
        + f"Command: `{command_line()}`"
    )
    print(table, phase_table, stack_table, sep="\n\n")
    if not args.no_write:
        update_section(args.section, body)


if __name__ == "__main__":
    main()
