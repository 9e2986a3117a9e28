"""Train a one-layer EAGLE-3 head with SpecForge 0.2.0 on compound's cached data, for ``benchmarks/heads_vs_peers.py``;
runs in the SpecForge venv (``scripts/setup_specforge.sh``) and writes ``--out/result.json`` (also printed): the
exported head's directory and what was trained, or the failure with the exact error and what was tried.

    .venvs/specforge/bin/python -P benchmarks/peers/heads_specforge.py --cache OUT.work --model benchmarks/.cache/smollm2-135m-hf \\
        --vocab-from OUT --steps 10 --batch-size 8 --lr 1e-3 --warmup-steps 2 --ttt-steps 5 --out benchmarks/.cache/heads-peers-runs/specforge

Steps: (1) ``heads_data.to_specforge`` writes SpecForge's offline feature files (``--out/data``) from compound's
hidden-state cache; (2) ``--out/run.yaml`` and ``--out/draft_config.json`` for ``specforge train`` (offline mode:
``data.hidden_states_path``), log in ``--out/train.log``; (3) ``specforge export --to sglang`` writes the head in
the EAGLE/SGLang layout (``--out/head``: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``: the layout
compound exports and ``toolkit.heads.eagle_export.load_eagle`` reads); (4) with ``--compound-python`` (default: the
base interpreter of this venv, which has compound installed) ``load_eagle`` reads it back.

What SpecForge needs on a CPU, all documented options or plain data (no change to SpecForge):

* ``TRITON_INTERPRET=1``: SpecForge's KL loss is a Triton kernel (``specforge/core/loss.py``), launched on every step
  with no torch fallback; Triton has no CPU driver ("RuntimeError: 0 active drivers ([]). There should only be one."),
  its interpreter runs the kernel on CPU tensors (slowly: most of a step's time);
* ``training.fsdp_sharding=NO_SHARD``: the default SHARD_GRAD_OP wraps the draft in FSDP, which refuses a CPU
  ("FSDP needs a non-CPU accelerator device"); NO_SHARD wraps it in DDP (gloo on CPU);
* ``model.torch_dtype=bfloat16`` (SpecForge's default; its optimizer keeps fp32 masters): the target head is always
  bf16, and float32 with bf16 features fails ("expected m1 and m2 to have the same dtype");
* ``training.attention_backend=sdpa`` (flash-attn is CUDA only; flex_attention is the default);
* a target directory with a ``*.index.json``: SpecForge's ``TargetHead`` reads ``lm_head`` only through one
  ("FileNotFoundError: No index.json file found in ..."); the runner makes ``--out/target`` (links to the target's
  files plus ``model.safetensors.index.json``) and, for a tied-embedding target (no ``lm_head.weight``, SmolLM2),
  ``model.lm_head_key=model.embed_tokens.weight``.

How compound's ``train-heads`` options map (SpecForge's own defaults in brackets; ``result.json["settings"]``):

* ``--draft-vocab V`` -> ``draft_vocab_size`` in ``draft_config.json`` [32000] + ``model.vocab_mapping_path``
                         (compound's exact vocabulary)
* ``--aux-layers``    -> fixed by the feature files; ``eagle_config.eagle_aux_hidden_state_layer_ids`` and
                         ``model.aux_hidden_state_layer_ids`` record them in SGLang's numbering (compound's - 1).
                         SpecForge's EAGLE-3 takes exactly 3 aux layers
* ``--ttt-steps``     -> ``training.ttt_length`` [7]; step k's loss weighs 0.8^k (SpecForge's fixed ``ploss_decay``,
                         compound's fixed decay)
* ``--lr``            -> ``training.learning_rate`` [1e-4] (AdamW, weight decay 0 as compound's)
* ``--warmup-steps``  -> ``training.warmup_ratio`` = warmup / steps [0.015] (SpecForge warms up int(ratio x total)
                         steps), ``training.lr_scheduler=cosine`` [cosine]: linear warmup, cosine to 0. Its cosine is
                         torch's chained CosineAnnealingLR: at 600 steps / 20 warmup it follows compound's schedule
                         (peak 1.0000073 x lr), at a handful of steps it overshoots (5 / 2: 1.33 x lr at step 2)
* ``--steps``         -> ``training.max_steps`` = ``training.total_steps``; ``training.num_epochs`` large enough
* ``--batch-size``    -> ``training.batch_size`` [1] (conversations per step, padded), ``accumulation_steps`` 1
* grad clip           -> ``training.max_grad_norm=1.0`` [0.5] (compound's 1.0)
* loss                -> forward KL against the target's distribution over the draft vocabulary (SpecForge's only
                         EAGLE-3 objective besides the LK variants), compound's ``--loss kl``
* draft shape         -> ``num_hidden_layers`` 1 (SpecForge fixes 1 for EAGLE-3); its layer is compound's (norms on the
                         embedding and the fused features inside the layer, residual = fc output, the next TTT step
                         reads the pre-norm output, logits = lm_head(norm(out)))
* not matchable       -> SpecForge's draft ``lm_head`` and ``norm`` start from random / ones (compound: the target's
                         rows and final norm); both train in both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import heads_data  # noqa: E402
from heads_runner import BIN, check_aux_layers, error_tail, finish, parser, run, start  # noqa: E402

PEER = "specforge"
ARCH_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
               "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "bos_token_id",
               "eos_token_id", "pad_token_id")


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--max-length", type=int, default=2048, help="data.max_length (conversations are cut to it)")
    ap.add_argument("--compound-python", default=None,
                    help="a Python with compound installed, to check the head with load_eagle (default: this venv's "
                         "base interpreter; 'none' skips the check)")
    return ap.parse_args()


def target_view(model: Path, view: Path) -> str:
    """``view``: links to ``model``'s files plus a ``model.safetensors.index.json`` when it has none (SpecForge's
    TargetHead reads lm_head only through an index); returns the lm_head key to give SpecForge."""
    from safetensors import safe_open

    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for f in model.iterdir():
        (view / f.name).symlink_to(f.resolve())
    weight_map = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            weight_map.update({k: f.name for k in h.keys()})
    if not list(model.glob("*.index.json")):
        (view / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for key in ("lm_head.weight", "model.embed_tokens.weight"):  # tied embeddings: the embedding is the lm_head
        if key in weight_map:
            return key
    raise SystemExit(f"{model}: neither lm_head.weight nor model.embed_tokens.weight in its safetensors files")


def draft_config(model: Path, vocab: int, aux_sglang: list[int]) -> dict:
    target = json.loads((model / "config.json").read_text())
    target = target.get("text_config", target)
    config = {k: target[k] for k in ARCH_FIELDS if target.get(k) is not None}
    if "rope_theta" not in config and isinstance(target.get("rope_parameters"), dict):
        config["rope_theta"] = target["rope_parameters"].get("rope_theta")
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, use_cache=True, draft_vocab_size=vocab,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux_sglang, "use_aux_hidden_state": True})
    config.setdefault("pad_token_id", 0)
    return config


def run_config(args, out: Path, target: Path, lm_head_key: str, data: Path, aux_sglang: list[int],
               examples: int) -> dict:
    steps_per_epoch = max(math.ceil(examples / args.batch_size), 1)
    return {
        "model": {"target_model_path": str(target), "lm_head_key": lm_head_key,
                  "draft_model_config": str(out / "draft_config.json"),
                  "vocab_mapping_path": str(data / "vocab_mapping.pt"), "torch_dtype": "bfloat16",
                  "aux_hidden_state_layer_ids": aux_sglang},
        "data": {"hidden_states_path": str(data / "features"), "max_length": args.max_length,
                 "dataloader_num_workers": 0, "cache_dir": str(out / "cache")},
        "training": {"strategy": "eagle3", "max_steps": args.steps, "total_steps": args.steps,
                     "num_epochs": math.ceil(args.steps / steps_per_epoch) + 1, "batch_size": args.batch_size,
                     "accumulation_steps": 1, "learning_rate": args.lr, "lr_scheduler": "cosine",
                     "warmup_ratio": min(args.warmup_steps / args.steps, 1.0), "max_grad_norm": args.grad_clip,
                     "ttt_length": args.ttt_steps, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": 1, "seed": args.seed},
        "output_dir": str(out / "checkpoints"),
        "run_id": "compound-peer",
    }


def step_metrics(log: Path) -> list[dict]:
    """SpecForge's per-step lines ``step N: {...}``: step, loss, lr, acc, grad_norm, step seconds."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"^step (\d+): (\{.*\})$", line)
        if not m:
            continue
        try:
            import ast

            d = ast.literal_eval(m.group(2))
        except (ValueError, SyntaxError):
            continue
        rows.append({"step": int(m.group(1)), "loss": d.get("loss"), "lr": d.get("lr"), "acc": d.get("acc"),
                     "grad_norm": d.get("grad_norm"), "seconds": d.get("perf/optimizer_step_time_s")})
    return rows


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    out, env, result = start(args, PEER, "triton", TRITON_INTERPRET="1")

    cache = heads_data.find_cache(args.cache)
    data = out / "data"
    info = heads_data.to_specforge(cache, args.model, data, draft_vocab=args.draft_vocab, vocab_from=args.vocab_from,
                                   max_examples=args.max_examples)
    aux, aux_sglang = info["aux_layers_hf"], info["aux_layers_sglang"]
    check_aux_layers(args, aux)
    vocab = info["vocabulary"]["draft_vocab"]
    info.pop("example_ids")
    result["data"] = info

    lm_head_key = target_view(args.model.resolve(), out / "target")
    (out / "draft_config.json").write_text(json.dumps(draft_config(args.model, vocab, aux_sglang), indent=1) + "\n")
    config = run_config(args, out, out / "target", lm_head_key, data, aux_sglang, info["examples"])
    import yaml

    (out / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result["settings"] = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                          "warmup_steps": int(config["training"]["warmup_ratio"] * args.steps),
                          "warmup_ratio": config["training"]["warmup_ratio"], "schedule": "warmup, cosine",
                          "optimizer": "AdamW over fp32 masters of a bf16 draft, weight_decay 0",
                          "grad_clip": args.grad_clip, "ttt_steps": args.ttt_steps, "ttt_step_loss_decay": 0.8,
                          "draft_vocab": vocab, "aux_layers": aux, "aux_layers_sglang": aux_sglang,
                          "loss": "forward KL (Triton kernel, interpreted)", "dtype": "bfloat16",
                          "attention_backend": "sdpa",
                          "lm_head": "trained, random init", "norm_init": "ones",
                          "env": {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}}

    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    cmd = [str(BIN / "specforge"), "train", "--config", str(out / "run.yaml")]
    rc, seconds = run(cmd, out / "train.log", env, args.timeout, cwd=out)
    result["train"] = {"command": " ".join(cmd), "rc": rc, "seconds": round(seconds, 1),
                       "steps": step_metrics(out / "train.log")}
    if rc:
        result.update(status="failed", error=error_tail(out / "train.log"), stage="train")
        return finish(result, out, started)

    head = out / "head"
    shutil.rmtree(head, ignore_errors=True)
    exp_cmd = [str(BIN / "specforge"), "export", "--to", "sglang",
               "--checkpoint", str(out / "checkpoints" / "compound-peer-latest"),
               "--draft-config", str(out / "draft_config.json"), "--output-dir", str(head),
               "--vocab-mapping", str(data / "vocab_mapping.pt")]
    exp_rc, _ = run(exp_cmd, out / "export.log", env, 1800, cwd=out)
    result["export"] = {"command": " ".join(exp_cmd), "rc": exp_rc,
                        "files": sorted(p.name for p in head.iterdir()) if head.exists() else []}
    if exp_rc:
        result.update(status="failed", error=error_tail(out / "export.log"), stage="export")
        return finish(result, out, started)
    result.update(status="trained", head=str(head), train_seconds=round(seconds, 1))
    result["compound_load"] = check_load(args.compound_python, head, out)
    finish(result, out, started)


def check_load(python: str | None, head: Path, cwd: Path) -> dict:
    """``toolkit.heads.eagle_export.load_eagle(head)`` in a Python that has compound (run outside the repo root, whose
    ``kernels/`` would shadow the PyPI package transformers imports)."""
    if python == "none":
        return {"checked": False}
    python = python or getattr(sys, "_base_executable", None) or "python3"
    code = ("import json, sys; from toolkit.heads.eagle_export import load_eagle; h = load_eagle(sys.argv[1]); "
            "c = h.config; print(json.dumps({'kind': c.kind, 'aux_layers': list(c.aux_layers), "
            "'draft_vocab_size': c.draft_vocab_size, 'vocab_size': c.vocab_size}))")
    proc = subprocess.run([python, "-c", code, str(head)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    if proc.returncode:
        return {"checked": True, "ok": False, "python": python,
                "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return {"checked": True, "ok": True, "python": python, "config": json.loads(proc.stdout.strip().splitlines()[-1])}


if __name__ == "__main__":
    main()
