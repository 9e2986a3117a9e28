"""EAGLE-3 heads for SmolLM2-135M-Instruct side by side: compound (``--loss kl`` and ``--loss ce`` on the float
target, ``--loss kl`` on the W4 target) and the peers speculators and SpecForge, at the same data, draft shape and
optimizer steps, every head scored the same way:

* vLLM CPU serving the head as a chain of 3 and of 5 draft tokens, greedy, on held-out ShareGPT prompts: the mean
  accepted length vLLM's own spec-decode counters give (``tests/integration/vllm_spec.py``), and whether its output
  equals vLLM's plain greedy output;
* compound's loop (``validate_heads``: the EAGLE-2 tree the head was selected with, and vLLM's chain of 5);
* wall time of data + training (``timings.json`` of the run) and the training process's peak RSS.

The W4 target (RTN W4 g64, ``benchmarks/decode.py``'s checkpoint) is also served with the head trained on the float
target and the one trained on the W4 target's own answers and hidden states (issue #24 item 4).

Peers run in their own venvs (``scripts/setup_speculators.sh``, ``scripts/setup_specforge.sh``) through
``benchmarks/peers/heads_<peer>.py`` on compound's cached conversations and hidden states (converted by
``benchmarks/peers/heads_data.py``), for ``--peer-steps`` steps (SpecForge's KL loss is a Triton kernel that runs
interpreted on a CPU, a minute per step here), next to a compound head trained for as many steps on the same cache
(hard-linked into a work directory of its own); a peer that cannot train here keeps its row with the error it gave
(``PEER_RUNS/<peer>/result.json``).

    python benchmarks/heads_vs_peers.py [--samples 256] [--steps 300] [--peer-steps 30] [--reuse] [--threads 1]
                                        [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import train_heads_argv  # noqa: E402
from decode import make_checkpoint  # noqa: E402
from report import command_line, cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
MODEL = "smollm2-135m"
W4_CHECKPOINT = CACHE / "decode-smollm2-rtn-w4g64"
PEER_RUNS = CACHE / "heads-peers-runs"
PEERS = ("speculators", "specforge")
VLLM_PYTHON = ROOT / ".venvs" / "vllm" / "bin" / "python"
FLOAT_DIR = CACHE / "smollm2-135m-hf"  # benchmarks/peers/export_float.py: the float target vLLM serves
CHAINS = (3, 5)
SECTION = "Draft heads vs peers (EAGLE-3, SmolLM2, CPU)"


FLOAT_WORK = CACHE / "heads-vs-peers.work"
RSS_FILE = CACHE / "heads-vs-peers-rss.json"  # peak RSS of each training run, kept for --reuse


def variants(args) -> dict[str, dict]:
    """compound's runs: name → target, loss, steps, warmup and work directory (kl and ce share one work directory,
    so the same conversations and hidden states; the peers' budget gets a copy of it, ``budget_work``)."""
    common = dict(steps=args.steps, warmup=args.warmup, evals=3)
    return {"compound kl": dict(target=MODEL, loss="kl", work=FLOAT_WORK, **common),
            "compound ce": dict(target=MODEL, loss="ce", work=FLOAT_WORK, **common),
            f"compound kl, {args.peer_steps} steps": dict(target=MODEL, loss="kl", work=budget_work(args),
                                                          steps=args.peer_steps, warmup=args.peer_warmup, evals=1),
            "compound kl, W4-trained": dict(target=str(W4_CHECKPOINT), loss="kl", work=CACHE / "heads-vs-peers-w4.work",
                                            **common)}


def budget_work(args) -> Path:
    """A work directory with the float runs' conversations and hidden states (hard links) and no training state,
    so that a shorter run trains on the same data from scratch instead of resuming the longer one."""
    work = CACHE / f"heads-vs-peers-{args.peer_steps}.work"
    if FLOAT_WORK.is_dir() and not work.exists():
        staging = work.with_name(work.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for item in FLOAT_WORK.iterdir():
            if not item.name.startswith("train-"):
                (shutil.copytree(item, staging / item.name, copy_function=os.link) if item.is_dir()
                 else os.link(item, staging / item.name))
        staging.rename(work)
    return work


def output_dir(name: str) -> Path:
    return CACHE / ("heads-vs-peers-" + name.replace("compound ", "").replace(", ", "-").replace(" ", "-"))


def heads_job(args, name: str, variant: dict):
    """The ``train-heads`` job of one variant: ``evals`` checkpoint evaluations, the last at the last step (the peers'
    budget run evaluates once, at the end, as the peers keep their last)."""
    from toolkit.heads.options import DataOptions, EagleOptions, SelectOptions
    from toolkit.heads.train import TrainConfig
    from toolkit.train_heads import HeadsJob

    every = max(1, variant["steps"] // variant["evals"])
    return HeadsJob(model=variant["target"], output=output_dir(name), head="eagle3", work_dir=variant["work"],
                    overwrite=True,
                    eagle=EagleOptions(aux_layers=tuple(map(int, args.aux_layers.split(","))),
                                       draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, loss=variant["loss"],
                                       depth=5, top_k=4, draft_tokens=8),
                    data=DataOptions(samples=args.samples, max_len=args.max_len, distill_tokens=128),
                    train=TrainConfig(lr=args.lr, warmup_steps=variant["warmup"], steps=variant["steps"], batch_size=8,
                                      micro_batch_size=4, eval_every=every, save_every=every),
                    select=SelectOptions(eval_prompts=3, eval_tokens=48))


def peer_command(args, peer: str) -> list[str]:
    """The peer's runner on the float runs' cache, with compound's draft shape and the peers' step budget."""
    return [str(ROOT / ".venvs" / peer / "bin" / "python"), "-P", str(ROOT / "benchmarks" / "peers" / f"heads_{peer}.py"),
            "--cache", str(FLOAT_WORK), "--model", str(FLOAT_DIR), "--draft-vocab", str(args.draft_vocab),
            "--aux-layers", args.aux_layers, "--ttt-steps", str(args.ttt_steps), "--steps", str(args.peer_steps),
            "--batch-size", "8", "--lr", str(args.lr), "--warmup-steps", str(args.peer_warmup), "--threads",
            str(args.threads), "--out", str(PEER_RUNS / peer)] + (["--max-length", str(args.max_len)]
                                                                 if peer == "specforge" else [])


def run_measured(command: list[str], threads: int, check: bool = True) -> float:
    """Run ``command``; its peak RSS in GiB (``wait4``'s rusage of that process: Linux carries the parent's peak
    into a child across fork + exec, and this parent holds no model while it trains, so the peak is the child's).
    ``check``: a failure stops the benchmark (a peer's failure is instead its ``result.json``)."""
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    if check and os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command)} failed with exit status {os.waitstatus_to_exitcode(status)}")
    return usage.ru_maxrss / 2**20


def vllm_acceptance(target_dir: Path, heads: dict[str, Path], prompts: list[list[int]], new_tokens: int, k: int,
                    dtype: str) -> dict[str, dict]:
    """name → {"tau", "identical"} (or {"error"}) of vLLM CPU serving each head as a chain of ``k``."""
    prompts_file = CACHE / "heads-vs-peers-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    names = list(heads)
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "integration" / "vllm_spec.py"), "--model",
                          str(target_dir), "--heads", *map(str, heads.values()), "--method", "eagle3",
                          "--num-speculative-tokens", str(k), "--prompts", str(prompts_file), "--max-tokens",
                          str(new_tokens), "--dtype", dtype], capture_output=True, text=True, cwd=ROOT)
    if run.returncode:
        return {name: {"error": run.stderr.strip().splitlines()[-1]} for name in names}
    result = json.loads(run.stdout.strip().splitlines()[-1])
    out = {}
    for name, draft in zip(names, result["drafts"]):
        out[name] = {"error": draft["error"]} if "error" in draft else \
            {"tau": draft["mean_accepted_length"], "identical": draft["tokens"] == result["plain"]}
    return out


def head_to_target_bytes(head_dir: Path, target) -> float:
    """Bytes a draft step reads over bytes a target step reads (both at the same width per weight): the head's
    layer, fc and draft lm_head against every target weight (the embedding's one row per token left out of both)."""
    from toolkit.heads.load import load_head

    head = load_head(head_dir).module
    head_params = sum(p.numel() for p in head.parameters())
    embed = target.get_input_embeddings().weight.numel()
    tied = target.get_output_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    target_params = sum(p.numel() for p in target.parameters()) - (0 if tied else embed)
    return head_params / target_params


def predicted_speedup(tau: float, k: int, ratio: float) -> float:
    """Weight-bound accelerator (batch 1): one verify step ≈ one target step; k draft steps cost k × ratio of one."""
    return tau / (1 + k * ratio)


def peer_rows() -> dict[str, dict]:
    """The peers' results as written by ``benchmarks/peers/heads_<peer>.py`` (``result.json``)."""
    return {peer: json.loads((PEER_RUNS / peer / "result.json").read_text()) for peer in PEERS
            if (PEER_RUNS / peer / "result.json").is_file()}


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def vllm_cell(result: dict | None) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return f"refused: {result['error'][:80]}"
    return f"{result['tau']:.2f}" + ("" if result["identical"] else " (output differs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--peer-steps", type=int, default=30, help="steps of the peers and of compound beside them")
    parser.add_argument("--peer-warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--aux-layers", default="2,15,27")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for training and evaluation")
    parser.add_argument("--only", default=None, help="';'-separated compound variants and peers to train (default: "
                        "all)")
    parser.add_argument("--reuse", action="store_true", help="score existing heads without training")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out (no .venvs/vllm)")
    parser.add_argument("--beside", default="nothing else", help="what ran beside the measurement, for the text")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()

    from toolkit.decode import greedy_outputs
    from toolkit.evaluate.acceptance import heldout_prompts, measure_eagle, validate_heads
    from toolkit.heads.eagle_draft import TreeShape
    from toolkit.heads.kinds.eagle import trained_shape
    from toolkit.heads.load import load_head
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    torch.set_num_threads(args.threads)
    make_checkpoint(W4_CHECKPOINT)
    if not (FLOAT_DIR / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "export_float.py")], check=True, cwd=ROOT)
    runs = variants(args)
    chosen = args.only.split(";") if args.only else [*runs, *PEERS]
    rss = json.loads(RSS_FILE.read_text()) if RSS_FILE.is_file() else {}
    for name, variant in runs.items():
        if not args.reuse and name in chosen:
            started = time.perf_counter()
            rss[name] = run_measured(train_heads_argv(heads_job(args, name, variant)), args.threads)
            RSS_FILE.write_text(json.dumps(rss, indent=1))
            print(f"{name}: trained in {time.perf_counter() - started:.0f} s, peak RSS {rss[name]:.2f} GiB", flush=True)
    for peer in PEERS:
        if not args.reuse and peer in chosen and (ROOT / ".venvs" / peer).is_dir():
            rss[peer] = run_measured(peer_command(args, peer), args.threads, check=False)  # largest process of its tree
            RSS_FILE.write_text(json.dumps(rss, indent=1))
    heads = {name: output_dir(name) for name in runs if (output_dir(name) / "config.json").is_file()}
    peers = peer_rows()
    heads |= {peer: Path(row["head"]) for peer, row in peers.items() if row.get("status") == "trained"}

    tokenizer = load_tokenizer(MODEL)
    prompts = heldout_prompts(tokenizer, args.prompts, skip=4)
    prompt_ids = [p.tolist() for p in prompts]
    float_heads = {name: path for name, path in heads.items() if "W4" not in name}
    vllm = {k: ({} if args.no_vllm else vllm_acceptance(FLOAT_DIR, float_heads, prompt_ids, args.new_tokens, k,
                                                          "float32")) for k in CHAINS}
    target = load_model(MODEL, torch.float32)
    rows = []
    for name, head_dir in float_heads.items():
        reports = {r.mode: r for r in validate_heads(MODEL, head_dir, args.prompts, args.new_tokens, explore=False)}
        tree, chain = reports["tree"], reports["chain"]
        ratio = head_to_target_bytes(head_dir, target)
        row = peers.get(name, {})
        timings = _timings(args, name, runs[name]) if name in runs else {"training": row.get("train_seconds")}
        steps = runs[name]["steps"] if name in runs else row["settings"]["steps"]
        rows.append([name, str(steps), fmt(timings.get("data_and_hidden_states"), ".0f"),
                     fmt(timings.get("training"), ".0f"), fmt(rss.get(name)), vllm_cell(vllm[3].get(name)),
                     vllm_cell(vllm[5].get(name)), f"{tree.mean_accepted_length:.2f}",
                     f"{chain.mean_accepted_length:.2f}", "yes" if tree.lossless and chain.lossless else "NO",
                     f"{chain.break_even_accepted_length:.2f}",
                     fmt(predicted_speedup(vllm[3][name]["tau"], 3, ratio) if "tau" in vllm[3].get(name, {})
                         else None) + "×"])
        print(rows[-1], flush=True)
    del target
    failures = [[peer, row["error"], "; ".join(a["what"] for a in row.get("attempts", []))]
                for peer, row in peers.items() if row.get("status") != "trained"]

    w4_rows = []
    w4_heads = {"trained on the float target (compound kl)": heads.get("compound kl"),
                "trained on the W4 target (compound kl, W4-trained)": heads.get("compound kl, W4-trained")}
    w4_heads = {k: v for k, v in w4_heads.items() if v is not None}
    w4_vllm = {k: ({} if args.no_vllm else vllm_acceptance(W4_CHECKPOINT, w4_heads, prompt_ids, args.new_tokens, k,
                                                             "bfloat16")) for k in CHAINS}
    w4, _ = load_quantized(W4_CHECKPOINT, torch.float32, backend="cpu-int4")
    greedy, greedy_s = greedy_outputs(w4, prompts, args.new_tokens, tokenizer.eos_token_id)
    for label, head_dir in w4_heads.items():
        tree, chain = trained_shape(head_dir)
        head = load_head(head_dir).module.float().attach(w4)
        measured = [measure_eagle(w4, head, prompts, args.new_tokens, shape, mode, tokenizer.eos_token_id, greedy,
                                  greedy_s) for mode, shape in (("tree", tree), ("chain", TreeShape(chain)))]
        w4_rows.append([label, vllm_cell(w4_vllm[3].get(label)), vllm_cell(w4_vllm[5].get(label)),
                        f"{measured[0].mean_accepted_length:.2f}", f"{measured[1].mean_accepted_length:.2f}"])
        print(w4_rows[-1], flush=True)

    table = markdown_table(["head", "steps", "data + hidden states, s", "training, s", "peak RSS, GiB", "vLLM τ, chain of 3",
                            "vLLM τ, chain of 5", "compound τ, tree", "compound τ, chain of 5", "lossless (compound)",
                            "break-even τ here (chain of 5)", "predicted speedup, chain of 3 (accelerator)"], rows)
    w4_table = markdown_table(["head on the W4 target", "vLLM τ, chain of 3", "vLLM τ, chain of 5",
                               "compound τ, tree", "compound τ, chain of 5"], w4_rows)
    failure_table = markdown_table(["peer", "what it gave", "what was tried"], failures) if failures else ""
    body = (
        f"EAGLE-3 heads (one layer, draft vocabulary {args.draft_vocab}, aux layers {args.aux_layers}, training-time "
        f"test of {args.ttt_steps} steps) for SmolLM2-135M-Instruct, each trained on the same {args.samples} "
        f"self-distilled ShareGPT train-split conversations (at most {args.max_len} tokens), AdamW steps of 8 "
        f"conversations (the steps column; speculators packs tokens instead: 8 × the mean length per step), peak lr {args.lr} after {args.warmup} warmup steps ({args.peer_warmup} for the {args.peer_steps}-step runs), cosine to 0. {cpu_name()}, torch "
        f"{torch.__version__}, {args.threads} torch thread(s); beside the measurement: {args.beside}. Held-out: "
        f"{args.prompts} ShareGPT eval-split prompts, {args.new_tokens} new tokens each, greedy. vLLM 0.32 CPU runs "
        f"the float target in float32 and the W4 target in bfloat16; τ is vLLM's own mean accepted length "
        f"(1 + accepted / drafts). The kl and ce heads share one work directory: the ce run reused the conversations "
        f"and hidden states (its data time is the cache check). Break-even τ: the accepted length at which a "
        f"chain-of-5 step pays for itself in compound's loop on this CPU; the predicted speedup assumes a "
        f"weight-bound accelerator at batch 1 (one verify ≈ one target step, a draft step reads the head's weights): "
        f"a prediction, not a measurement.\n\n{table}\n\n"
        + (f"Peers that did not train here:\n\n{failure_table}\n\n" if failures else "")
        + f"Both levers: the W4 target (RTN W4 g64) drafted by the head trained on the float target and by the one "
        f"trained on the W4 target's own answers and hidden states:\n\n{w4_table}\n\n"
        + f"Command: `{command_line()}`"
    )
    print(table, failure_table, w4_table, sep="\n\n")
    if not args.no_write:
        update_section(SECTION, body)


def _timings(args, name: str, variant: dict) -> dict:
    """``timings.json`` of a variant's training run (data + hidden states, training, total seconds), found where
    ``train-heads`` keeps it (``HeadsJob.train_dir``)."""
    path = heads_job(args, name, variant).train_dir / "timings.json"
    return json.loads(path.read_text()) if path.is_file() else {}


if __name__ == "__main__":
    main()
