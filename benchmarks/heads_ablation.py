"""Issue #24's remaining gap: what makes SpecForge's EAGLE-3 head ahead of compound's at 30 steps? The differences
between the two runs of ``benchmarks/heads_vs_peers.py`` are switched one at a time on compound's own 30-step run
(``compound kl, 30 steps``: same data, draft shape, optimizer and steps), each head scored as that benchmark scores:

* ``--schedule specforge``: the learning rate of every step is SpecForge's own scheduler's
  (``specforge/lr_scheduler.py``'s ``CosineAnnealingWarmupLR``, built as ``BF16Optimizer`` builds it: warmup
  ``int(warmup_ratio × steps)`` steps, the ratio being ``heads_specforge.py``'s warmup / steps), the file loaded from
  ``--specforge-src`` and run under this torch; compound's own is ``toolkit.heads.train.lr_factor``;
* ``--lm-head random|target``: the draft ``lm_head`` starts as SpecForge's does (``post_init`` of a transformers
  ``PreTrainedModel``: normal, std the target's ``initializer_range``), compound's default since this ablation, or
  as the target's ``lm_head`` rows of the draft vocabulary (compound's init before it); ``--norm ones``: the
  draft's final ``norm`` starts as ones, as SpecForge's, instead of the target's final norm.

All are patches of this process only (nothing in ``toolkit`` changes); the run is ``compound train-heads`` in
process, with the benchmark's 30-step command, on a work directory of its own whose data and hidden states are hard
links to ``DATA`` (the benchmark's ``heads-vs-peers-30.work``, made by its 30-step run), so every variant trains from scratch on the same
conversations.

    python -P benchmarks/heads_ablation.py train NAME [--schedule compound|specforge] [--lm-head target|random]
                                                      [--norm target|ones] [--seed 0] [--threads 1]
                                                      [--steps 30 --warmup-steps 3]   # 300 / 20: the long runs
    python -P benchmarks/heads_ablation.py lr [--specforge-src PATH]     # both schedules, step by step
    python -P benchmarks/heads_ablation.py score NAME [NAME ...] [--chains 3 5]   # vLLM CPU τ (heads_vs_peers)
    python -P benchmarks/heads_ablation.py report [--no-write]    # the table, into BENCHMARKS.md

Heads go to ``benchmarks/.cache/heads-ablation/NAME``; ``train`` appends NAME's settings, training seconds, peak RSS
and train-heads' own evaluation to ``benchmarks/.cache/heads-ablation/results.jsonl``, ``score`` its vLLM τ,
``report`` groups the runs by settings (seeds side by side) and writes the section ``SECTION``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
CACHE = ROOT / "benchmarks" / ".cache"
OUT = CACHE / "heads-ablation"
RESULTS = OUT / "results.jsonl"
DATA = CACHE / "heads-vs-peers-30.work"
STEPS, WARMUP, LR = 30, 3, 1e-3
SECTION = "Draft heads vs peers: what SpecForge's head had that compound's lacked (EAGLE-3, SmolLM2, CPU)"


def specforge_lrs(src: Path, steps: int = STEPS, warmup: int = WARMUP, lr: float = LR) -> list[float]:
    """The learning rate of each of SpecForge's ``steps`` optimizer steps (the group's lr when ``optimizer.step()``
    runs; ``BF16Optimizer.step`` calls ``scheduler.step()`` after it), from SpecForge's own scheduler class."""
    import torch

    spec = importlib.util.spec_from_file_location("specforge_lr_scheduler", src)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr, weight_decay=0.0)
    ratio = min(warmup / steps, 1.0)  # heads_specforge.py's training.warmup_ratio
    scheduler = module.CosineAnnealingWarmupLR(optimizer, total_steps=steps, warmup_steps=int(ratio * steps))
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def compound_lrs(steps: int = STEPS, warmup: int = WARMUP, lr: float = LR) -> list[float]:
    from toolkit.heads.train import lr_factor

    return [lr * lr_factor(step, warmup, steps) for step in range(steps)]


def default_specforge_src() -> str | None:
    found = glob.glob(str(ROOT / ".venvs" / "specforge" / "lib" / "python*" / "site-packages" / "specforge" /
                          "lr_scheduler.py"))
    return found[0] if found else None


def work_copy(name: str) -> Path:
    """A fresh work directory for ``name``: ``DATA``'s pieces as hard links (made-for.json copied), no train-*."""
    if not (DATA / "made-for.json").is_file():
        raise SystemExit(f"{DATA} has no data yet: run the benchmark's 30-step command first")
    work = OUT / f"{name}.work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for item in DATA.iterdir():
        if item.name.startswith("train-"):
            continue
        if item.is_dir():
            shutil.copytree(item, work / item.name, copy_function=os.link)
        elif item.name == "made-for.json":
            shutil.copy(item, work / item.name)
        else:
            os.link(item, work / item.name)
    return work


def train(args) -> None:
    import torch

    import toolkit.heads.train as train_module
    from toolkit.cli import app
    from toolkit.heads.eagle import EagleHead

    settings = {"name": args.name, "schedule": args.schedule, "lm_head": args.lm_head, "norm": args.norm,
                "seed": args.seed, "steps": args.steps, "warmup_steps": args.warmup_steps}
    if args.schedule == "specforge":
        src = args.specforge_src or default_specforge_src()
        if not src:
            raise SystemExit("--specforge-src: SpecForge's lr_scheduler.py (scripts/setup_specforge.sh installs it)")
        lrs = specforge_lrs(Path(src), args.steps, args.warmup_steps)
        settings["specforge_src"] = str(src)

        def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
            if (warmup_steps, max_steps) != (args.warmup_steps, args.steps):
                raise RuntimeError(f"schedule table is for {args.warmup_steps} warmup of {args.steps} steps")
            return lrs[step] / LR

        train_module.lr_factor = lr_factor  # _run looks it up in the module at every step
    if args.lm_head == "target" or args.norm == "ones":
        original = EagleHead.from_target.__func__

        def from_target(cls, target, kind="eagle3", aux_layers=None, draft_vocab=None):
            head = original(cls, target, kind, aux_layers, draft_vocab)
            with torch.no_grad():
                if args.lm_head == "target":  # the draft vocabulary's rows of the target's lm_head
                    vocab = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
                    head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab].float())
                if args.norm == "ones":
                    head.norm.weight.fill_(1.0)
            return head

        EagleHead.from_target = classmethod(from_target)

    out = OUT / args.name
    work = work_copy(args.name)
    every = max(1, args.steps // (1 if args.steps == STEPS else 3))  # heads_vs_peers.py: 1 evaluation at 30, 3 at 300
    argv = ["train-heads", "--model", "smollm2-135m", "--head", "eagle3", "-o", str(out), "--work-dir", str(work),
            "--loss", "kl", "--samples", "256", "--max-len", "512", "--distill-tokens", "128", "--draft-vocab", "8192",
            "--aux-layers", "2,15,27", "--ttt-steps", "3", "--depth", "5", "--top-k", "4", "--draft-tokens", "8",
            "--steps", str(args.steps), "--batch-size", "8", "--micro-batch-size", "4", "--lr", str(LR),
            "--warmup-steps", str(args.warmup_steps), "--eval-every", str(every), "--save-every", str(every),
            "--eval-prompts", "3",
            "--eval-tokens", "48", "--overwrite", "--seed", str(args.seed), "--threads", str(args.threads)]
    started = time.perf_counter()
    try:
        app(argv, standalone_mode=False)
    finally:
        seconds = time.perf_counter() - started
    manifest = json.loads((out / "compound.json").read_text()) if (out / "compound.json").is_file() else {}
    train_dir = next(work.glob("train-*"))
    timings = json.loads((train_dir / "timings.json").read_text())
    logged = [json.loads(line) for line in (train_dir / "train.jsonl").read_text().splitlines()]
    record = {**settings, "wall_seconds": round(seconds, 1), "timings": timings,
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "eval": manifest.get("training", {}).get("best_metrics"),
              "logged": [{k: r[k] for k in ("step", "loss", "lr")} for r in logged]}
    OUT.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


def score(args) -> None:
    from heads_vs_peers import FLOAT_DIR, MODEL, vllm_acceptance
    from toolkit.evaluate.acceptance import heldout_prompts
    from toolkit.models import load_tokenizer

    heads = {}
    for name in args.names:
        path = Path(name) if "/" in name else OUT / name
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path}: no head")
        heads[name] = path
    prompts = [p.tolist() for p in heldout_prompts(load_tokenizer(MODEL), args.prompts, skip=4)]
    for k in args.chains:
        started = time.perf_counter()
        result = vllm_acceptance(FLOAT_DIR, heads, prompts, args.new_tokens, k, "float32")
        seconds = time.perf_counter() - started
        with RESULTS.open("a") as f:
            for name, row in result.items():
                f.write(json.dumps({"name": name, "chain": k, "vllm": row, "prompts": args.prompts,
                                    "new_tokens": args.new_tokens}) + "\n")
        print(f"chain {k} ({seconds:.0f} s): {json.dumps(result)}", flush=True)


def report(args) -> None:
    """``results.jsonl`` as one row per (steps, schedule, lm_head, norm): each seed's vLLM τ (chain of 3), their
    mean, chain of 5 where scored, train-heads' own tree τ, training seconds and peak RSS; into ``SECTION``."""
    from report import markdown_table, update_section

    runs, taus = {}, {}
    for line in RESULTS.read_text().splitlines():
        record = json.loads(line)
        if "chain" in record:
            taus[(record["name"].rstrip("/").rsplit("/", 1)[-1], record["chain"])] = record["vllm"].get("tau")
        else:
            runs[record["name"]] = record
    rows = {}
    for name, run in runs.items():
        key = (run.get("steps", STEPS), run["schedule"], run["lm_head"], run.get("norm", "target"))
        rows.setdefault(key, []).append((run["seed"], name, run))
    table = []
    for (steps, schedule, lm_head, norm), seeds in sorted(rows.items()):
        seeds.sort()
        chain3 = [taus.get((name, 3)) for _, name, _ in seeds]
        scored = [t for t in chain3 if t is not None]
        chain5 = [f"{taus[(name, 5)]:.3f}" for _, name, _ in seeds if (name, 5) in taus]
        trees = [run["eval"]["mean_accepted_length"] for _, _, run in seeds if run.get("eval")]
        table.append([str(steps), schedule, lm_head, norm, ", ".join(str(seed) for seed, _, _ in seeds),
                      ", ".join("-" if t is None else f"{t:.3f}" for t in chain3),
                      f"{sum(scored) / len(scored):.3f}" if scored else "-", ", ".join(chain5) or "-",
                      ", ".join(f"{t:.2f}" for t in trees) or "-",
                      ", ".join(f"{run['timings']['training']:.0f}" for _, _, run in seeds),
                      ", ".join(f"{run['peak_rss_gib']:.2f}" if "peak_rss_gib" in run else "-" for _, _, run in seeds)])
    body = (
        "Issue #24: at 30 steps SpecForge's head reached vLLM τ 1.164 (chain of 3) against compound's 1.135-1.159 "
        "(\"Draft heads vs peers\"). Each difference between the two runs is switched on compound's own run of that "
        "benchmark (same 256 conversations and hidden states, draft shape, AdamW, lr 0.001), one at a time, and every "
        "head is scored as the benchmark scores it (vLLM CPU, float32 target, 8 held-out prompts, 64 new tokens; every "
        "output identical to plain greedy). schedule: compound's warmup-then-cosine or SpecForge's own "
        "`CosineAnnealingWarmupLR` (its warmup reaches the peak one step earlier and its chained cosine runs 0.34 % "
        "above the peak at 30 steps); lm_head: the draft `lm_head` started from the target's rows of the draft "
        "vocabulary (compound's init before this) or random (normal, std `initializer_range` 0.02, as SpecForge's); "
        "norm: the draft's final norm started from the target's or at ones (SpecForge). The tree τ is train-heads' "
        "own evaluation (EAGLE-2 tree, 3 prompts × 48 tokens). One torch thread; beside the runs: the test suite on "
        "the other core (training seconds vary ±15 % with it).\n\n"
        + markdown_table(["steps", "schedule", "lm_head", "norm", "seeds", "vLLM τ, chain of 3 (per seed)",
                          "mean", "vLLM τ, chain of 5", "compound τ, tree", "training, s", "peak RSS, GiB"], table)
        + "\n\nThe draft `lm_head`'s init is the whole gap: started random, compound's head reaches 1.200-1.206 over "
        "three seeds at 30 steps (SpecForge 1.164) and 1.50 against 1.44 at 300 steps; SpecForge's schedule moves τ "
        "by 0.003, within seed noise, and a final norm at ones helps alone but not beside a random `lm_head`. "
        "`EagleHead.from_target` now starts the `lm_head` random; the \"Draft heads vs peers\" table was measured "
        "before that change (its compound rows started from the target's rows). Started from the target's rows, the training loss "
        "at step 10 is 26-28 against about 15 from random (`train.jsonl` of each run); why the copied rows start "
        "worse was not isolated.\n\n"
        "SpecForge's peak RSS over a 3-step run (its trainer process, `os.wait4`, warm torch-inductor cache): 3.35 "
        "GiB; compound's 30-step runs above: 3.1-3.3 GiB.\n\n"
        "Commands: `python -P benchmarks/heads_ablation.py train NAME [--schedule specforge] [--lm-head target] "
        "[--norm ones] [--seed N] [--steps 300 --warmup-steps 20]`, `... score NAME... --chains 3 5`, "
        "`python -P benchmarks/heads_ablation.py report`.")
    print(body)
    if not args.no_write:
        update_section(SECTION, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train")
    p.add_argument("name")
    p.add_argument("--schedule", choices=("compound", "specforge"), default="compound")
    p.add_argument("--lm-head", choices=("target", "random"), default="random")
    p.add_argument("--norm", choices=("target", "ones"), default="target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--warmup-steps", type=int, default=WARMUP)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--specforge-src", default=None)
    p = sub.add_parser("lr")
    p.add_argument("--specforge-src", default=None)
    p = sub.add_parser("score")
    p.add_argument("names", nargs="+")
    p.add_argument("--chains", type=int, nargs="+", default=[3])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p = sub.add_parser("report")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.command == "train":
        train(args)
    elif args.command == "score":
        score(args)
    elif args.command == "report":
        report(args)
    else:
        src = args.specforge_src or default_specforge_src()
        specforge = specforge_lrs(Path(src)) if src else None
        for step, lr in enumerate(compound_lrs()):
            print(step + 1, f"{lr:.6g}", "-" if specforge is None else f"{specforge[step]:.6g}")


if __name__ == "__main__":
    main()
