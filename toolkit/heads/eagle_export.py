"""EAGLE heads on disk, in the layouts vLLM and SGLang both read (reference: docs/formats.md §8.2), every tensor
checked.

Hidden size H (draft = target), intermediate size I, heads n_h / n_kv of width hd, target vocabulary V, draft
vocabulary V_d, aux layers n; one file, ``model.safetensors``; float tensors in the export dtype:

| kind | tensor | shape |
|---|---|---|
| ``eagle`` (EAGLE-1/2) | ``fc.weight`` / ``fc.bias`` (zeros) | [H, 2H] / [H] |
| | ``layers.0.self_attn.{q,k,v}_proj.weight``, ``o_proj.weight`` | [n·hd, H], [H, n_h·hd] |
| | ``layers.0.post_attention_layernorm.weight`` | [H] |
| | ``layers.0.mlp.{gate,up}_proj.weight`` / ``down_proj.weight`` | [I, H] / [H, I] |
| ``eagle3`` | ``fc.weight`` | [H, n·H] |
| | ``midlayer.self_attn.{q,k,v}_proj.weight``, ``o_proj.weight`` | [n·hd, 2H], [H, n_h·hd] |
| | ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``, ``norm.weight`` | [H] |
| | ``midlayer.mlp.{gate,up}_proj.weight`` / ``down_proj.weight`` | [I, H] / [H, I] |
| | ``lm_head.weight`` | [V_d, H] |
| | ``d2t`` int64 / ``t2d`` bool (only when V_d < V) | [V_d] / [V] |

What each engine reads (vLLM 0.32 source; SGLang per ``sgl-project/sglang``
``python/sglang/srt/models/llama_eagle{,3}.py``):

* EAGLE-1 ``architectures: ["LlamaForCausalLMEagle", "LlamaForCausalLM"]``. SGLang requires
  ``LlamaForCausalLMEagle`` and takes the first listed architecture it knows. vLLM (``transformers_utils/configs/
  eagle.py``, ``EAGLEConfig``) prefixes each with ``Eagle``; ``EagleLlamaForCausalLMEagle`` is not registered and
  ``ModelRegistry.resolve_model_cls`` moves on to ``EagleLlamaForCausalLM`` (``models/llama_eagle.py``). vLLM's ``fc``
  has no bias and its loader drops unexpected ``.bias`` tensors (``AutoWeightsLoader.load_weights``); SGLang's ``fc``
  always has one and does not report a missing key, so ``fc.bias`` is written as explicit zeros and a loaded non-zero
  bias is refused. Neither applies a final norm; logits are the target's ``lm_head`` of the layer output.
* ``bias: false`` for both kinds, whatever a config's bias key meant for ``fc`` elsewhere: vLLM's
  ``LlamaDecoderLayer`` (``models/llama.py``) reads ``config.bias`` as the *attention* bias, so ``bias: true`` gives
  the draft q/k/v/o biases that no checkpoint tensor fills (measured: EAGLE-1 accepted 0 of 756 draft tokens).
* EAGLE-3 ``architectures: ["LlamaForCausalLMEagle3"]`` (registered as such in vLLM; required by SGLang).
  ``eagle_aux_hidden_state_layer_ids`` top-level in vLLM's numbering (id k = residual stream entering decoder layer k
  = transformers' ``hidden_states[k]`` = ``EagleConfig.aux_layers``); ``eagle_config.eagle_aux_hidden_state_layer_ids``
  in SGLang's (k - 1). Both can share one config: vLLM reads the top-level ids first and the nested ones only when
  they are absent (``GPUModelRunner._get_eagle3_aux_layers_from_config``, ``v1/worker/gpu_model_runner.py``); it
  reads only their count and ``use_aux_hidden_state`` from ``eagle_config`` (``models/llama_eagle3.py``,
  ``LlamaModel``). ``norm_before_residual: false`` explicit (the graph compound trains). When V_d = V, ``d2t``/``t2d``
  are left out: vLLM 0.32 then builds no ``draft_id_to_target_id`` parameter and refuses a ``d2t`` tensor ("There is
  no module or parameter named 'draft_id_to_target_id'"), and SGLang's ``hot_token_id`` stays unset (no remap).
  SGLang's EAGLE-3 ``fc`` is ``Linear(3·H, H)`` whatever the config says, so heads with other than 3 aux layers are
  vLLM-only (``serving_flags`` then gives no SGLang line).

Engines skip missing or unexpected weights silently in several of these cases (docs/formats.md §8.3), so the exporter
and the loader compare every name, shape and dtype with ``expected_eagle_tensors`` and check that ``d2t``/``t2d``
describe one vocabulary. ``compound.json`` records the full ``EagleConfig`` (``load_eagle`` rebuilds it exactly), the
aux layers in all three numberings, the target and the file hashes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from toolkit.formats.checkpoint import MANIFEST, WEIGHTS, atomic_directory, sha256_file, verify_manifest
from toolkit.heads.eagle import EagleHead
from toolkit.heads.eagle_config import VARIANTS, EagleConfig
from toolkit.heads.eagle_draft import TreeShape
from toolkit.version import __version__

CONFIG = "config.json"
FORMAT = "eagle"  # compound.json's "format" of an EAGLE head, in either layout
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def _disk_name(config: EagleConfig, name: str) -> str:
    """On-disk name of a head state-dict name (the layer under the variant's ``disk_layer``)."""
    return config.variant.disk_layer + name.removeprefix("midlayer") if name.startswith("midlayer.") else name


def _full_vocab(config: EagleConfig) -> bool:
    return config.draft_vocab_size == config.vocab_size


def expected_eagle_tensors(config: EagleConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor name of the on-disk layout for a head of ``config``: (shape, "float" | "int64" | "bool")."""
    c = config
    H, I = c.hidden_size, c.intermediate_size
    layer = c.variant.disk_layer
    attn_in = 2 * H if c.variant.reads_aux_layers else H  # the embedding and the hidden state side by side, or fc's
    shapes = {
        "fc.weight": (H, c.fc_inputs),
        f"{layer}.self_attn.q_proj.weight": (c.num_attention_heads * c.head_dim, attn_in),
        f"{layer}.self_attn.k_proj.weight": (c.num_key_value_heads * c.head_dim, attn_in),
        f"{layer}.self_attn.v_proj.weight": (c.num_key_value_heads * c.head_dim, attn_in),
        f"{layer}.self_attn.o_proj.weight": (H, c.num_attention_heads * c.head_dim),
        f"{layer}.post_attention_layernorm.weight": (H,),
        f"{layer}.mlp.gate_proj.weight": (I, H),
        f"{layer}.mlp.up_proj.weight": (I, H),
        f"{layer}.mlp.down_proj.weight": (H, I),
    }
    if c.variant.fc_bias_on_disk:
        shapes["fc.bias"] = (H,)
    if c.variant.reads_aux_layers:
        shapes |= {f"{layer}.input_layernorm.weight": (H,), f"{layer}.hidden_norm.weight": (H,)}
    if c.variant.own_lm_head:
        shapes |= {"norm.weight": (H,), "lm_head.weight": (c.draft_vocab_size, H)}
    expected = {name: (shape, "float") for name, shape in shapes.items()}
    if c.variant.own_lm_head and not _full_vocab(c):
        expected |= {"d2t": ((c.draft_vocab_size,), "int64"), "t2d": ((c.vocab_size,), "bool")}
    return expected


def _kind(tensor: torch.Tensor) -> str:
    return "float" if tensor.is_floating_point() else str(tensor.dtype).removeprefix("torch.")


def check_eagle_tensors(tensors: dict[str, torch.Tensor], config: EagleConfig, expected: dict | None = None,
                        layout: str | None = None) -> None:
    """Raise ValueError listing the missing, unexpected, mis-shaped and mis-typed tensors of ``tensors``, or a
    ``d2t``/``t2d`` pair that does not describe one draft vocabulary. ``expected``: another layout's table (default
    ``expected_eagle_tensors(config)``), named ``layout`` in the error."""
    expected = expected_eagle_tensors(config) if expected is None else expected
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshaped = [f"{name} {list(tensors[name].shape)} (expected {list(shape)})"
                 for name, (shape, _) in expected.items() if name in tensors and tuple(tensors[name].shape) != shape]
    mistyped = [f"{name} {tensors[name].dtype} (expected {kind})" for name, (shape, kind) in expected.items()
                if name in tensors and _kind(tensors[name]) != kind]
    problems = [f"{what}: {', '.join(items)}" for what, items in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped),
                 ("mis-typed", mistyped)) if items]
    if problems:
        raise ValueError(f"EAGLE tensors do not match the {layout or repr(config.kind)} layout for {config} (an "
                         "engine would skip them silently and accept ~1 token per step): " + "; ".join(problems))
    if "d2t" in tensors:
        _check_vocab_maps(tensors["d2t"], tensors["t2d"], config)


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, config: EagleConfig) -> None:
    """``d2t + arange`` must be strictly increasing target ids in [0, V), exactly the ids ``t2d`` marks."""
    ids = d2t + torch.arange(d2t.shape[0])
    if not (ids.min() >= 0 and ids.max() < config.vocab_size and bool((ids[1:] > ids[:-1]).all())
            and bool(t2d[ids].all()) and int(t2d.sum()) == config.draft_vocab_size):
        raise ValueError("d2t/t2d do not describe one draft vocabulary (d2t + arange must be increasing target ids, "
                         "exactly those t2d marks): the engines would map draft tokens to the wrong target ids")


def sglang_layer_ids(config: EagleConfig) -> list[int]:
    """The aux layers in SGLang's numbering (id i = output of decoder layer i = vLLM's id i + 1)."""
    return [i - 1 for i in config.aux_layers]


def _rope_fields(rope: dict) -> dict:
    """``rope_theta``/``rope_scaling`` (what transformers 4 and SGLang read; scaling None for plain RoPE),
    ``rope_parameters`` when the target had them (transformers 5), and ``max_position_embeddings``."""
    params = dict(rope.get("rope_parameters") or rope.get("rope_scaling") or {})
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    plain = scaling.get("rope_type", scaling.get("type", "default")) == "default"
    fields = {"rope_theta": rope.get("rope_theta", params.get("rope_theta")),
              "rope_scaling": None if plain else scaling}
    if rope.get("rope_parameters") is not None:
        fields["rope_parameters"] = rope["rope_parameters"]
    if rope.get("max_position_embeddings") is not None:
        fields["max_position_embeddings"] = rope["max_position_embeddings"]
    return fields


def llama_layer_config(config: EagleConfig, dtype: torch.dtype) -> dict:
    """The one-layer ``LlamaConfig`` a head's ``config.json`` describes (sizes, norm, activation, RoPE, dtype)."""
    c = config
    dtype_name = str(dtype).removeprefix("torch.")
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": c.hidden_act, **_rope_fields(c.rope), "tie_word_embeddings": False,
            "torch_dtype": dtype_name, "dtype": dtype_name}


def _config_json(config: EagleConfig, dtype: torch.dtype) -> dict:
    """The draft's ``config.json``: a one-layer LlamaConfig plus the keys of its kind (module docstring)."""
    c = config
    raw = {"architectures": list(c.variant.architectures), **llama_layer_config(c, dtype), "bias": False}
    if not c.variant.reads_aux_layers:
        return raw
    return raw | {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
                  "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(c),
                                   "use_aux_hidden_state": True}}


def disk_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's persistent tensors under their on-disk names, with EAGLE-1's zero ``fc.bias`` added and an
    identity ``d2t``/``t2d`` (full vocabulary) dropped."""
    config = head.config
    tensors = {_disk_name(config, name): t.detach() for name, t in head.state_dict().items()}
    if config.variant.fc_bias_on_disk:
        tensors.setdefault("fc.bias", torch.zeros(config.hidden_size, dtype=head.fc.weight.dtype))
    if _full_vocab(config) and "d2t" in tensors and "t2d" in tensors:
        if tensors["d2t"].any() or not tensors["t2d"].all():
            raise ValueError("the head's draft vocabulary is the full vocabulary but d2t/t2d are not the identity")
        del tensors["d2t"], tensors["t2d"]
    return tensors


def export_eagle(head: EagleHead, out_dir: Path, *, target: str, target_sha256: str | None,
                 dtype: torch.dtype = torch.bfloat16, overwrite: bool = False,
                 extra_manifest: dict | None = None) -> Path:
    """Write ``head`` to ``out_dir`` (``model.safetensors``, ``config.json``, ``compound.json``) atomically, float
    tensors in ``dtype``; refuses a head whose tensors do not match ``expected_eagle_tensors``."""
    config = head.config
    tensors = disk_tensors(head)
    check_eagle_tensors(tensors, config)
    manifest = head_manifest(config, target, target_sha256, dtype) | (extra_manifest or {})
    return write_head(out_dir, tensors, _config_json(config, dtype), manifest, dtype, overwrite)


def head_manifest(config: EagleConfig, target: str, target_sha256: str | None, dtype: torch.dtype) -> dict:
    """What ``compound.json`` records of a head in either layout: its config, target, dtype and aux layers."""
    return {"compound_version": __version__, "format": FORMAT, "kind": config.kind, "target": target,
            "target_sha256": target_sha256, "eagle": config.to_dict(), "dtype": str(dtype).removeprefix("torch."),
            "aux_layers": {"hf_hidden_states": list(config.aux_layers), "vllm": list(config.aux_layers),
                           "sglang": sglang_layer_ids(config)}}


def write_head(out_dir: Path, tensors: dict[str, torch.Tensor], config_json: dict, manifest: dict,
               dtype: torch.dtype, overwrite: bool) -> Path:
    """Write checked ``tensors`` (floats in ``dtype``), ``config.json`` and ``compound.json`` (``manifest`` plus the
    file hashes) to ``out_dir`` atomically."""
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous() for name, t in tensors.items()}
    with atomic_directory(Path(out_dir), overwrite) as staging:
        save_file(tensors, staging / WEIGHTS, metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config_json, indent=2) + "\n")
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2) + "\n")
    return Path(out_dir)


def load_eagle(directory: Path) -> EagleHead:
    """The head (float32, not attached: call ``.attach(target)``) of an EAGLE directory. Its config comes from
    ``compound.json`` when present (file hashes checked), else from ``config.json``; every tensor is checked. The
    speculators layout is ``toolkit.heads.speculators_export.load_speculators``'s; ``toolkit.heads.load.load_head``
    reads either."""
    directory = Path(directory)
    config = _read_config(directory)
    tensors = read_weights(directory)
    check_eagle_tensors(tensors, config)
    return head_from_tensors(config, tensors, directory)


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of a head directory's ``model.safetensors``, once the file hashes ``compound.json`` records (when
    present) match."""
    if (directory / MANIFEST).is_file():
        changed = verify_manifest(directory)
        if changed:
            raise ValueError(f"{directory}: {', '.join(changed)} no longer match the SHA-256 in {MANIFEST} "
                             "(changed or missing since export); re-export the head")
    if not (directory / WEIGHTS).is_file():
        raise FileNotFoundError(f"{directory / WEIGHTS} is missing")
    return load_file(directory / WEIGHTS)


def head_from_tensors(config: EagleConfig, tensors: dict[str, torch.Tensor], directory: Path) -> EagleHead:
    """The float32 head of checked ``tensors`` under the EAGLE layout's names (identity maps for a full vocabulary);
    refuses EAGLE-1's non-zero ``fc.bias``."""
    head = EagleHead(config)
    state = {}
    for name in head.state_dict():
        disk = _disk_name(config, name)
        if disk in tensors:
            state[name] = tensors[disk].float() if tensors[disk].is_floating_point() else tensors[disk]
    if config.variant.fc_bias_on_disk and tensors["fc.bias"].any():
        raise ValueError(f"{directory}: fc.bias is not zero; vLLM would drop it silently and compound's heads "
                         "have no fc bias")
    if config.variant.own_lm_head and _full_vocab(config):
        state |= {"d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
                  "t2d": torch.ones(config.vocab_size, dtype=torch.bool)}
    head.load_state_dict(state)
    return head


def _read_config(directory: Path) -> EagleConfig:
    """The head config of a directory: ``compound.json``'s when present, else rebuilt from ``config.json``."""
    if not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: not an EAGLE head directory")
    if (directory / MANIFEST).is_file():
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{directory / MANIFEST} describes a {manifest.get('format')!r} export, not an EAGLE head")
        return EagleConfig.from_dict(manifest["eagle"])
    return config_from_json(json.loads((directory / CONFIG).read_text()), directory)


def config_from_json(raw: dict, directory: Path) -> EagleConfig:
    """An ``EagleConfig`` from a draft ``config.json`` alone (the target's layer count unknown: 0)."""
    archs = raw.get("architectures") or []
    variant = next((v for v in VARIANTS.values() if v.architectures[0] in archs), None)
    if variant is None:
        names = " nor ".join(v.architectures[0] for v in VARIANTS.values())
        raise ValueError(f"{directory / CONFIG}: architectures {archs} name neither {names}")
    if raw.get("num_hidden_layers", 1) != 1 or raw.get("norm_before_residual", False):
        raise ValueError(f"{directory / CONFIG}: only one-layer heads with norm_before_residual false are supported")
    aux: list[int] = []
    if variant.reads_aux_layers:
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or \
            [i + 1 for i in (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", [])]
        if not aux:
            raise ValueError(f"{directory / CONFIG}: no eagle_aux_hidden_state_layer_ids (top-level or in "
                             "eagle_config)")
    heads, vocab = raw["num_attention_heads"], raw["vocab_size"]
    return EagleConfig(
        kind=variant.name, hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=vocab,
        draft_vocab_size=(raw.get("draft_vocab_size") or vocab) if variant.own_lm_head else vocab,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5), hidden_act=raw.get("hidden_act", "silu"), aux_layers=tuple(aux),
        rope={key: raw[key] for key in ROPE_KEYS if raw.get(key) is not None})


def serving_flags(directory_or_config: Path | str | EagleConfig, draft_path: str, k: int,
                  tree: TreeShape | None = None) -> dict[str, str]:
    """How to serve the head as a chain of ``k`` draft tokens (docs/formats.md §6): ``vllm_speculative_config`` (the
    JSON), ``vllm`` (the ``--speculative-config`` flag) and, when SGLang can load the head, ``sglang`` (its flags;
    ``--speculative-num-draft-tokens`` counts the root, so k + 1); given a ``tree``, also ``sglang_tree``, SGLang's
    flags for that EAGLE-2 tree."""
    config = directory_or_config if isinstance(directory_or_config, EagleConfig) \
        else _read_config(Path(directory_or_config))
    variant = config.variant
    spec = {"method": variant.name, "model": draft_path, "num_speculative_tokens": k, **dict(variant.vllm_config)}
    spec_json = json.dumps(spec)
    flags = {"vllm_speculative_config": spec_json, "vllm": f"--speculative-config '{spec_json}'"}
    if variant.sglang_aux_layers in (None, len(config.aux_layers)):
        flags["sglang"] = _sglang_flags(config, draft_path, TreeShape(k))
        if tree is not None:
            flags["sglang_tree"] = _sglang_flags(config, draft_path, tree)
    return flags


def _sglang_flags(config: EagleConfig, draft_path: str, shape: TreeShape) -> str:
    """SGLang's flags for drafting ``shape`` (see ``TreeShape``: the draft-token count includes the root)."""
    return (f"--speculative-algorithm {config.variant.sglang_algorithm} --speculative-draft-model-path {draft_path} "
            f"--speculative-num-steps {shape.depth} --speculative-eagle-topk {shape.top_k} "
            f"--speculative-num-draft-tokens {(shape.total_tokens or shape.depth) + 1}")
