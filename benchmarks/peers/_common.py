"""Shared helpers for the peer runners (imported by run_gptqmodel.py / run_llmcompressor.py).

Only torch, transformers and safetensors are used here, so it works in every peer venv.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Iterable

LINEAR_SUFFIXES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "w1", "w2", "w3",  # Mixtral experts (benchmarks/moe.py)
)
# Mixture-of-Experts names in memory -> on disk: transformers 5 and the peers name a Mixtral block `mlp` and its
# expert projections gate/up/down_proj, the Hub checkpoint `block_sparse_moe` and w1/w3/w2.
_BLOCK_NAMES = (("mlp.", "block_sparse_moe."),)
_EXPERT_PROJECTIONS = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def parse_args(tool: str, methods: tuple[str, ...] = ("gptq", "awq"), rotations: tuple[str, ...] = ("none",),
               iters: int | None = None) -> argparse.Namespace:
    """The runners' shared options; ``methods`` / ``rotations``: the tool's choices of --method / --rotate, ``iters``:
    the default of its --iters (None: it has none)."""
    ap = argparse.ArgumentParser(description=f"Quantize a HF model with {tool}, save a dequantized copy.")
    ap.add_argument("--model", required=True, help="float HF model dir")
    ap.add_argument("--calib", required=True, help="torch.save'd LongTensor [samples, seq_len]")
    ap.add_argument("--method", required=True, choices=list(methods))
    ap.add_argument("--rotate", default="none", choices=list(rotations),
                    help="a rotation folded into the weights before quantizing (default none)")
    if iters is not None:
        ap.add_argument("--iters", type=int, default=iters, help=f"optimization steps per block (default {iters})")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--asym", action="store_true",
                    help="GPTQ: asymmetric grid with zero points (default symmetric; AWQ is always asymmetric)")
    ap.add_argument("--act-order", action="store_true",
                    help="GPTQ: activation order with static groups (GPTQModel desc_act + static_groups, "
                         "llm-compressor actorder='static'); default off")
    ap.add_argument("--damp", type=float, default=None,
                    help="GPTQ dampening fraction; default: the tool's own default")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="dtype the model is loaded/quantized in (default float32, except GPTQModel "
                         "AWQ: bfloat16); the dequantized copy is always saved in float32")
    ap.add_argument("--drop-quantized", action="store_true",
                    help="delete the tool's own packed checkpoint (--out/quantized, GPTQModel only) "
                         "after dequantizing (default: kept)")
    return ap.parse_args()


def setup_threads(n: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(n)


def load_calib(path: str):
    import torch

    t = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise SystemExit(f"{path}: expected a 2-D LongTensor [samples, seq_len], got {type(t)} {getattr(t, 'shape', '')}")
    return t.long()


def maxrss_mib() -> float:
    # ru_maxrss is KiB on Linux; children included separately
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return self_kib / 1024.0


def write_result(out: Path, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    payload["ru_maxrss_mib"] = round(maxrss_mib(), 1)
    payload["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (out / "result.json").write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    print(json.dumps(payload, indent=2, sort_keys=True, default=str))


def clean_config_dir(d: Path, dtype: str) -> None:
    """Strip any quantization_config / compression_config from config.json in d."""
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("quantization_config", "compression_config"):
        cfg.pop(k, None)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dtype
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def save_dense(float_model_dir: Path, state: dict, out_dir: Path, dtype: str, untied: bool = False) -> None:
    """Write a plain HF checkpoint: the float model's config + tokenizer, with `state` replacing
    the float tensors of the same names: the dequantized linears AND every other tensor the tool
    changed (AWQ folds its scales into the preceding norms / v_proj, so those must come from the
    tool, not from the float model). `untied`: the tool untied a tied LM head (a rotation of the
    residual stream), so `state` adds lm_head.weight and the config says the head is untied."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    base = {}
    for f in sorted(float_model_dir.glob("*.safetensors")):
        base.update(load_file(str(f)))
    tdtype = getattr(torch, dtype)
    state = checkpoint_names(state, base)
    if untied and "lm_head.weight" not in base:
        base["lm_head.weight"] = state["lm_head.weight"]
    missing = [k for k in state if k not in base]
    if missing:
        raise SystemExit(f"dequantized tensors not in the float checkpoint: {missing[:5]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(base[k].shape):
            raise SystemExit(f"{k}: shape {tuple(v.shape)} != float {tuple(base[k].shape)}")
        base[k] = v
    base = {k: v.detach().to("cpu", tdtype).contiguous() for k, v in base.items()}
    save_file(base, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(float_model_dir / "config.json", out_dir / "config.json")
    clean_config_dir(out_dir, dtype)
    if untied:
        config = json.loads((out_dir / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(float_model_dir, out_dir)


def checkpoint_names(state: dict, base: dict) -> dict:
    """``state`` under the float checkpoint's tensor names: a MoE tool's in-memory names (``mlp.experts.3.gate_proj``,
    ``mlp.gate``) mapped to the Hub's (``block_sparse_moe.experts.3.w1``, ``block_sparse_moe.gate``), and transformers
    5's fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) split per expert. A name
    already in ``base``, or with no match, is kept as it is (save_dense then reports it)."""
    import re

    def candidates(k: str):
        for old, new in _BLOCK_NAMES:
            yield k.replace(f".{old}", f".{new}", 1)
        for old, new in _EXPERT_PROJECTIONS:
            for name in (k, *(k.replace(f".{a}", f".{b}", 1) for a, b in _BLOCK_NAMES)):
                yield re.sub(rf"(\.experts\.\d+\.){old}\.", rf"\g<1>{new}.", name)

    out = {}
    for k, v in state.items():
        fused = re.fullmatch(r"(.*)\.experts\.(gate_up_proj|down_proj)", k)
        if k not in base and fused is not None and v.dim() == 3:
            prefix, which = fused.groups()
            for e in range(v.shape[0]):
                if which == "gate_up_proj":  # [E, 2I, H]: gate rows then up rows
                    gate, up = v[e].chunk(2, dim=0)
                    parts = {"gate_proj": gate, "up_proj": up}
                else:
                    parts = {"down_proj": v[e]}
                for proj, t in parts.items():
                    out.update(checkpoint_names({f"{prefix}.experts.{e}.{proj}.weight": t}, base))
            continue
        out[k if k in base else next((c for c in candidates(k) if c in base), k)] = v
    return out


def grid_check(dense_dir: Path, float_dir: Path, bits: int, group_size: int,
               names: Iterable[str] | None = None) -> dict:
    """For every quantized linear in dense_dir: each group of `group_size` input columns per
    output row must hold at most 2**bits distinct values. Also reports how many weights
    changed vs the float model (0 would mean nothing was quantized)."""
    from safetensors.torch import load_file

    dq = load_file(str(dense_dir / "model.safetensors"))
    fl = {}
    for f in sorted(float_dir.glob("*.safetensors")):
        fl.update(load_file(str(f)))
    keys = [k for k in dq if k.endswith(".weight") and k.split(".")[-2] in LINEAR_SUFFIXES]
    if names is not None:
        keys = [k for k in keys if k in set(names)]
    worst = 0
    n_bad = 0
    changed = []
    for k in sorted(keys):
        w = dq[k].float()
        out_f, in_f = w.shape
        if in_f % group_size:
            raise SystemExit(f"{k}: in_features {in_f} not divisible by {group_size}")
        g = w.reshape(out_f, in_f // group_size, group_size)
        s, _ = g.sort(dim=-1)
        distinct = 1 + (s[..., 1:] != s[..., :-1]).sum(-1)
        mx = int(distinct.max())
        worst = max(worst, mx)
        if mx > 2 ** bits:
            n_bad += 1
        if k in fl:
            changed.append(float((w != fl[k].float()).float().mean()))
    res = {
        "linears_checked": len(keys),
        "max_distinct_per_group": worst,
        "linears_off_grid": n_bad,
        "grid_ok": n_bad == 0 and len(keys) > 0,
        "mean_fraction_changed_vs_float": round(sum(changed) / max(len(changed), 1), 4),
    }
    print(f"[grid-check] {res}")
    return res


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 3)


def perplexity(model, tokens) -> float:
    """Perplexity of ``model`` over the rows of ``tokens`` [rows, T], each row scored from its second token."""
    import math

    from torch import inference_mode

    nll, n = 0.0, 0
    with inference_mode():
        for row in tokens:
            out = model(row[None], labels=row[None])
            nll += out.loss.item() * (row.numel() - 1)
            n += row.numel() - 1
    return math.exp(nll / n)
