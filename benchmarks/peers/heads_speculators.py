"""Train a one-layer EAGLE-3 head with speculators 0.9.0 on compound's cached data, for
``benchmarks/heads_vs_peers.py``; runs in the speculators venv (``scripts/setup_speculators.sh``) and writes
``--out/result.json`` (also printed): the head's directory and what was trained, or the failure with the exact error
and what was tried.

    .venvs/speculators/bin/python -P benchmarks/peers/heads_speculators.py --cache OUT.work --model benchmarks/.cache/smollm2-135m-hf \\
        --vocab-from OUT --steps 10 --batch-size 8 --lr 1e-3 --warmup-steps 2 --ttt-steps 5 --out benchmarks/.cache/heads-peers-runs/speculators

Steps: (1) ``heads_data.to_speculators`` writes speculators' offline data directory (``--out/data``) from compound's
hidden-state cache; (2) ``speculators train`` with the flags below (``--out/train.log``); (3) when it cannot train, a
``--dry-run`` with the same flags saves the initialised draft, so the output layout is still on record.

How compound's ``train-heads`` options map (speculators' own defaults in brackets; ``result.json["settings"]``):

* ``--draft-vocab V``  -> ``--draft-vocab-size V`` + ``data/d2t-V.npy``/``t2d-V.npy`` (compound's exact vocabulary)
* ``--aux-layers``     -> ``--target-layer-ids`` (same numbering: transformers hidden_states index = vLLM id)
                          [2, N/2, N-3]
* ``--ttt-steps``      -> ``--ttt-steps`` [3]; ``--ttt-step-loss-decay 0.8`` [1.0]: step k weighs 0.8^k, compound's
                          (and SpecForge's) fixed decay
* ``--lr``             -> ``--lr`` with ``--optimizer adamw`` [muon] and ``--weight-decay 0`` [0.01] (compound: AdamW,
                          weight decay 0)
* ``--warmup-steps``   -> ``--scheduler-warmup-steps``, ``--scheduler-type cosine`` [linear]: linear warmup then cosine
                          to 0 at ``--max-steps`` (transformers' get_cosine_schedule_with_warmup), compound's schedule
* ``--steps``          -> ``--max-steps`` (and ``--epochs`` large enough that the epochs do not end first)
* ``--batch-size B``   -> no example count: speculators packs whole conversations into one row of ``--total-seq-len``
                          tokens per step; the runner sets it to B x the mean conversation length (``--tokens-per-step``
                          overrides), so a step sees about as many tokens as compound's
* grad clip            -> fixed at 1.0 in speculators (compound's default 1.0)
* loss                 -> ``--loss-fn kl_div`` [kl_div] (forward KL against the target's distribution over the draft
                          vocabulary, compound's ``--loss kl``)
* draft shape          -> ``--num-layers 1``; ``--no-norm-before-fc`` [on for eagle3], ``--no-norm-before-residual``
                          [on], ``--no-norm-output`` [on], ``--full-attention-indices 0`` [sliding window 2048]:
                          compound's EAGLE-3 layer (as SpecForge's and EAGLE's: no norm on the fused features,
                          residual = un-normed fc output, the next TTT step reads the pre-norm output, full attention)
* not matchable        -> speculators freezes the draft ``lm_head`` (the target's rows; compound trains it) and starts
                          ``norm`` at ones (compound: the target's final norm); it always holds out a validation split,
                          so the converter adds one copy of the last conversation and trains on exactly the N examples.

On a CPU it does not train: the Trainer moves the draft to device index 0 (``self.model.to(self.local_rank)``) and
fails with "RuntimeError: Cannot access accelerator device when none is available."; under ``torchrun`` speculators
first calls ``torch.accelerator.set_device_index`` and fails the same way. No documented option picks the CPU
(``CUDA_VISIBLE_DEVICES=''``, ``--num-workers 0``, ``--draft-attn-impl sdpa`` change nothing). ``result.json`` keeps
both attempts and the dry run.

Output layout (a training checkpoint ``--out/checkpoints/<epoch>/``, and the ``--dry-run`` directory alike):
``config.json`` (``Eagle3SpeculatorConfig``: ``speculators_model_type`` eagle3, ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids`` in vLLM/transformers numbering, ``norm_before_fc``, ``norm_before_residual``,
``norm_output``, ``fc_norm``, ``transformer_layer_config`` (a LlamaConfig, 1 layer, ``layer_types``), and
``speculators_config`` naming the verifier path); ``config.py`` (its ``auto_map`` code); ``model.safetensors``
(bfloat16: ``d2t``, ``t2d``, ``embed_tokens.weight`` (the target's, frozen), ``fc.weight``, ``layers.0.*``,
``lm_head.weight``, ``norm.weight``); ``run.yaml``, ``train_command.txt``, and ``speculators.patch`` (a ``git diff``
of the repository holding the venv: the uncommitted work of this checkout); a training checkpoint adds
``optimizer_state_dict.pt``, ``scheduler_state_dict.pt``, ``training_state.json`` and a link ``epoch<N>_end``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import heads_data  # noqa: E402
from heads_runner import BIN, check_aux_layers, error_tail, finish, parser, run, start  # noqa: E402

PEER = "speculators"


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--tokens-per-step", type=int, default=None, help="--total-seq-len (default: batch x mean length)")
    ap.add_argument("--hidden-states-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="speculators' autocast/loader dtype (its recommended bfloat16; compound trains in bf16)")
    ap.add_argument("--attn-impl", default="sdpa", choices=["sdpa", "eager", "simple_flex_attention"],
                    help="--draft-attn-impl (sdpa: speculators' documented choice without flex attention)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun attempt after a failure")
    return ap.parse_args()


def train_flags(args, info: dict, data_dir: Path, aux: list[int], vocab: int, total_seq_len: int) -> list[str]:
    epochs = max(math.ceil(args.steps * total_seq_len / max(info["tokens"], 1)) + 2, 2)
    return [
        "--verifier-name-or-path", str(args.model), "--speculator-type", "eagle3",
        "--data-path", str(data_dir), "--hidden-states-backend", "file", "--on-missing", "raise",
        "--train-data-ratio", repr(info["train_data_ratio"]), "--num-workers", "0",
        "--total-seq-len", str(total_seq_len), "--hidden-states-dtype", args.hidden_states_dtype,
        "--num-layers", "1", "--target-layer-ids", *map(str, aux), "--draft-vocab-size", str(vocab),
        "--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output", "--full-attention-indices", "0",
        "--draft-attn-impl", args.attn_impl,
        "--ttt-steps", str(args.ttt_steps), "--ttt-step-loss-decay", "0.8", "--loss-fn", "kl_div",
        "--optimizer", "adamw", "--lr", repr(args.lr), "--weight-decay", "0",
        "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(args.warmup_steps),
        "--scheduler-total-steps", str(args.steps), "--max-steps", str(args.steps), "--epochs", str(epochs),
        "--seed", str(args.seed), "--log-freq", "1", "--no-resume-from-checkpoint",
    ]


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    out, env, result = start(args, PEER)

    cache = heads_data.find_cache(args.cache)
    data_dir = out / "data"
    info = heads_data.to_speculators(cache, args.model, data_dir, draft_vocab=args.draft_vocab,
                                     vocab_from=args.vocab_from, max_examples=args.max_examples)
    aux = info["target_layer_ids"]
    check_aux_layers(args, aux)
    vocab = info["vocabulary"]["draft_vocab"]
    total_seq_len = args.tokens_per_step or heads_data.tokens_per_step(info, args.batch_size)
    flags = train_flags(args, info, data_dir, aux, vocab, total_seq_len)
    info.pop("example_ids")
    result["data"] = info
    result["settings"] = {"steps": args.steps, "batch_size": args.batch_size, "tokens_per_step": total_seq_len,
                          "lr": args.lr, "warmup_steps": args.warmup_steps, "schedule": "linear warmup, cosine to 0",
                          "optimizer": "adamw, weight_decay 0", "grad_clip": 1.0, "ttt_steps": args.ttt_steps,
                          "ttt_step_loss_decay": 0.8, "draft_vocab": vocab, "aux_layers": aux, "loss": "kl_div",
                          "hidden_states_dtype": args.hidden_states_dtype, "attn_impl": args.attn_impl,
                          "lm_head": "frozen (target rows; speculators has no option to train it)",
                          "norm_init": "ones"}

    save = out / "checkpoints"
    shutil.rmtree(save, ignore_errors=True)
    cmd = [str(BIN / "speculators"), "train", *flags, "--save-path", str(save), "--log-dir", str(out / "logs")]
    rc, seconds = run(cmd, out / "train.log", env, args.timeout)
    attempts = [{"what": "speculators train on CPU (CUDA_VISIBLE_DEVICES='', --num-workers 0, --draft-attn-impl "
                 f"{args.attn_impl})", "command": " ".join(cmd), "rc": rc, "seconds": round(seconds, 1),
                 "error": error_tail(out / "train.log") if rc else None}]
    if rc and not args.no_torchrun:  # the documented multi-process launcher: its own device setup
        tr_save = out / "checkpoints-torchrun"
        shutil.rmtree(tr_save, ignore_errors=True)
        tr_cmd = [str(BIN / "torchrun"), "--nproc_per_node=1", "-m", "speculators.train", *flags,
                  "--save-path", str(tr_save), "--log-dir", str(out / "logs")]
        tr_rc, tr_s = run(tr_cmd, out / "train-torchrun.log", env, args.timeout)
        attempts.append({"what": "torchrun --nproc_per_node=1 -m speculators.train (same flags)",
                         "command": " ".join(tr_cmd), "rc": tr_rc, "seconds": round(tr_s, 1),
                         "error": error_tail(out / "train-torchrun.log") if tr_rc else None})
        shutil.rmtree(tr_save, ignore_errors=True)
        if tr_rc == 0:
            rc, save = 0, tr_save
    result["attempts"] = attempts
    if rc == 0:
        result.update(status="trained", head=str(_final_checkpoint(save)), train_seconds=round(seconds, 1),
                      log=_train_log(out / "train.log"))
    else:
        result.update(status="failed", error=attempts[0]["error"],
                      reason="speculators' Trainer moves the draft to device index 0 (model.to(local_rank)), which a "
                      "CPU-only torch refuses; under torchrun it first calls torch.accelerator.set_device_index. No "
                      "documented option selects the CPU.")
        dry = out / "dry-run"
        shutil.rmtree(dry, ignore_errors=True)
        dry_cmd = [str(BIN / "speculators"), "train", *flags, "--dry-run", "--save-path", str(dry)]
        dry_rc, _ = run(dry_cmd, out / "dry-run.log", env, 900)
        result["dry_run"] = {"command": " ".join(dry_cmd), "rc": dry_rc, "dir": str(dry) if dry_rc == 0 else None,
                             "files": sorted(p.name for p in dry.iterdir()) if dry.exists() else [],
                             "error": error_tail(out / "dry-run.log") if dry_rc else None}
    finish(result, out, started)


def _final_checkpoint(save: Path) -> Path:
    """The newest saved epoch directory (speculators writes ``<save>/<epoch>/``: config.json, model.safetensors)."""
    epochs = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return epochs[-1] if epochs else save


def _train_log(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "loss" in line][-20:]


if __name__ == "__main__":
    main()
