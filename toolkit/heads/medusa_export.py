"""Medusa heads on disk, in the two layouts engines read (reference: docs/formats.md §8.1), with every tensor checked.

Head k (0-based) of K, residual block l of L, hidden size H, vocabulary V; every tensor in the export dtype:

| layout | file | tensor | shape |
|---|---|---|---|
| ``vllm`` | ``model.safetensors`` | ``blocks.{k}.layers.{l}.weight`` / ``.bias`` | [H, H] / [H] |
| | | ``lm_heads.{k}.weight`` | [V, H] |
| ``medusa`` (FasterDecoding) | ``medusa_lm_head.safetensors`` | ``{k}.{l}.linear.weight`` / ``.bias`` | [H, H] / [H] |
| | | ``{k}.{L}.weight`` | [V, H] |

vLLM's ``config.json`` (``vllm/transformers_utils/configs/medusa.py``, vLLM 0.32): ``model_type: "medusa"``,
``architectures: ["MedusaModel"]``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers``,
``truncated_vocab_size`` (= vocab_size: no token map), ``medusa_fc_bias: true`` (else vLLM builds bias-free blocks
and drops the biases without a word) and ``original_lm_head`` (false: one output layer per head; true: heads with a
shared ``lm_head``, stored once as ``lm_heads.0.weight``, which vLLM loads as its one ``lm_head``). vLLM runs the heads
in the target's dtype whatever ``torch_dtype`` says. FasterDecoding's ``config.json``: ``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path``.

Engines skip missing or unexpected weights silently (vLLM 0.32: names it does not know, a bias without
``medusa_fc_bias``, an absent ``lm_heads.{k}.weight``, which its missing-weight check exempts; it does remap the
FasterDecoding names ``{k}.{l}.linear.*`` itself), and acceptance then collapses to about 1 token per step, so both the
exporter and the loader compare every name and shape with the layout's table (``expected_medusa_tensors``) and refuse
a mismatch.
Converting between layouts is ``export_medusa(load_medusa(src), dst, layout=...)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from toolkit.formats.checkpoint import MANIFEST, WEIGHTS, atomic_directory, sha256_file, verify_manifest
from toolkit.heads.medusa import MedusaConfig, MedusaHeads
from toolkit.version import __version__

CONFIG = "config.json"
VLLM_MODEL_TYPE = "medusa"  # config.json's model_type in vLLM's layout
WEIGHT_FILES = {"vllm": WEIGHTS, "medusa": "medusa_lm_head.safetensors"}
LAYOUTS = tuple(WEIGHT_FILES)


def check_layout(layout: str) -> None:
    """Refuse a layout that is not one of ``LAYOUTS``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown Medusa layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def _name_map(config: MedusaConfig, layout: str) -> dict[str, str]:
    """Layout tensor name -> ``MedusaHeads`` state-dict name, for every tensor the layout holds."""
    check_layout(layout)
    K, L = config.num_heads, config.num_layers
    names = {}
    for k in range(K):
        for l in range(L):
            prefix = f"blocks.{k}.layers.{l}" if layout == "vllm" else f"{k}.{l}.linear"
            names[f"{prefix}.weight"] = f"blocks.{k}.{l}.linear.weight"
            names[f"{prefix}.bias"] = f"blocks.{k}.{l}.linear.bias"
        if not config.shared_lm_head:
            names[f"lm_heads.{k}.weight" if layout == "vllm" else f"{k}.{L}.weight"] = f"lm_heads.{k}.weight"
    if config.shared_lm_head:
        if layout != "vllm":
            raise ValueError("FasterDecoding's layout has one output layer per head; export heads with a shared "
                             "lm_head in the vllm layout (original_lm_head: true)")
        names["lm_heads.0.weight"] = "lm_heads.0.weight"  # vLLM reads it as its one lm_head
    return names


def expected_medusa_tensors(config: MedusaConfig, layout: str) -> dict[str, tuple[int, ...]]:
    """Every tensor name of ``layout`` for heads of ``config``, with its shape."""
    H, V = config.hidden_size, config.vocab_size
    return {name: ((V, H) if module.startswith("lm_heads.") else (H, H) if module.endswith("weight") else (H,))
            for name, module in _name_map(config, layout).items()}


def check_medusa_tensors(tensors: dict[str, torch.Tensor], config: MedusaConfig, layout: str) -> None:
    """Raise ValueError listing the missing, unexpected and mis-shaped tensors of ``tensors`` for ``layout``."""
    expected = expected_medusa_tensors(config, layout)
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshaped = [f"{name} {list(tensors[name].shape)} (expected {list(shape)})"
                 for name, shape in expected.items() if name in tensors and tuple(tensors[name].shape) != shape]
    problems = [f"{what}: {', '.join(items)}" for what, items in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if items]
    if problems:
        raise ValueError(f"Medusa tensors do not match the {layout!r} layout for {config} "
                         f"(an engine would skip them silently and accept ~1 token per step): " + "; ".join(problems))


def _config_json(config: MedusaConfig, layout: str, target: str, dtype: torch.dtype) -> dict:
    if layout != "vllm":  # FasterDecoding's
        return {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
                "base_model_name_or_path": target}
    dtype_name = str(dtype).removeprefix("torch.")
    return {"model_type": VLLM_MODEL_TYPE, "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "truncated_vocab_size": config.vocab_size,
            "num_heads": config.num_heads, "num_hidden_layers": config.num_layers,
            "medusa_fc_bias": True, "original_lm_head": config.shared_lm_head, "torch_dtype": dtype_name,
            "dtype": dtype_name}


def export_medusa(heads: MedusaHeads, out_dir: Path, *, layout: str = "vllm", target: str,
                  target_sha256: str | None, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False,
                  extra_manifest: dict | None = None) -> Path:
    """Write ``heads`` to ``out_dir`` in ``layout`` ("vllm" or "medusa") with ``config.json`` and a ``compound.json``
    manifest (target, its hash, head config, layout, file hashes), atomically; refuses incomplete heads."""
    config = heads.config
    state = heads.state_dict()
    tensors = {name: state.pop(module) for name, module in _name_map(config, layout).items() if module in state}
    tensors.update(state)  # whatever the layout has no name for: reported as unexpected
    check_medusa_tensors(tensors, config, layout)
    tensors = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    manifest = {"compound_version": __version__, "format": "medusa", "layout": layout, "target": target,
                "target_sha256": target_sha256, "medusa": config.to_dict(), "dtype": str(dtype).removeprefix("torch."),
                **(extra_manifest or {})}
    with atomic_directory(Path(out_dir), overwrite) as staging:
        save_file(tensors, staging / WEIGHT_FILES[layout], metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(_config_json(config, layout, target, dtype), indent=2) + "\n")
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2) + "\n")
    return Path(out_dir)


def load_medusa(directory: Path) -> MedusaHeads:
    """Heads (float32) from a directory in either layout, found from its ``config.json``; every tensor name and
    shape is checked, and every file hash when a ``compound.json`` manifest is present."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: not a Medusa head directory")
    if (directory / MANIFEST).is_file():
        changed = verify_manifest(directory)
        if changed:
            raise ValueError(f"{directory}: {', '.join(changed)} no longer match the SHA-256 in {MANIFEST} "
                             "(changed or missing since export); re-export the heads")
    raw = json.loads((directory / CONFIG).read_text())
    layout = _detect_layout(raw, directory)
    weights = directory / WEIGHT_FILES[layout]
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: the {layout!r} layout keeps its heads there")
    tensors = load_file(weights)
    config = _config_from(raw, layout, tensors, weights)
    check_medusa_tensors(tensors, config, layout)
    heads = MedusaHeads(config)
    heads.load_state_dict({module: tensors[name].float() for name, module in _name_map(config, layout).items()})
    return heads


def layout_of(raw: dict) -> str | None:
    """The layout a parsed ``config.json`` is of: "vllm" (``model_type: "medusa"``), "medusa" (FasterDecoding's
    ``medusa_num_heads``), or None when it is no Medusa config."""
    if raw.get("model_type") == VLLM_MODEL_TYPE:
        return "vllm"
    return "medusa" if "medusa_num_heads" in raw else None


def _detect_layout(raw: dict, directory: Path) -> str:
    layout = layout_of(raw)
    if layout is None:
        raise ValueError(f"{directory / CONFIG} is neither vLLM's Medusa config (model_type 'medusa') nor "
                         "FasterDecoding's (medusa_num_heads)")
    if layout == "vllm" and not raw.get("medusa_fc_bias", False):
        raise ValueError(f"{directory}: compound's heads have biased blocks; this config has medusa_fc_bias "
                         "false, which they cannot load")
    return layout


def _config_from(raw: dict, layout: str, tensors: dict[str, torch.Tensor], weights: Path) -> MedusaConfig:
    if layout == "vllm":
        if raw.get("truncated_vocab_size", raw["vocab_size"]) != raw["vocab_size"]:
            raise ValueError(f"{weights.parent}: truncated_vocab_size (a token map) is not supported")
        return MedusaConfig(raw["hidden_size"], raw["vocab_size"], raw["num_heads"], raw["num_hidden_layers"],
                            bool(raw.get("original_lm_head", False)))
    # FasterDecoding's config has no sizes: head 0's output layer [V, H] gives them
    K, L = raw["medusa_num_heads"], raw["medusa_num_layers"]
    out = f"0.{L}.weight"
    if out not in tensors or tensors[out].dim() != 2:
        raise ValueError(f"{weights} has no 2-D {out} (head 0's output layer) to read the sizes from")
    V, H = tensors[out].shape
    return MedusaConfig(H, V, K, L)
