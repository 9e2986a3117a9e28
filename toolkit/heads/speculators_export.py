"""EAGLE-3 heads in the speculators layout (``vllm-project/speculators``): a directory that ``vllm serve DIR`` runs
with speculative decoding and no other flag, loading the target its config names. ``toolkit.heads.eagle_export``
writes the EAGLE/SpecForge layout (served with ``--speculative-config``); the tensors are the same, renamed, and
checked the same way.

``config.json`` (V target vocabulary, V_d draft vocabulary, H hidden size, k draft tokens per step):

* ``architectures: ["Eagle3DraftModel"]``, ``speculators_model_type: "eagle3"``, no top-level ``model_type``;
* ``speculators_config``: ``algorithm: "eagle3"``, ``proposal_methods: [{"proposal_type": "greedy",
  "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}]``, ``default_proposal_method:
  "greedy"``, ``verifier: {"name_or_path", "architectures"}`` (the target as vLLM loads it, its architectures);
* ``transformer_layer_config``: the EAGLE layout's one-layer LlamaConfig (``model_type: "llama"``) plus
  ``attention_bias``/``mlp_bias`` false and ``num_aux_hidden_states``;
* ``draft_vocab_size`` V_d, ``target_hidden_size`` H, ``eagle_aux_hidden_state_layer_ids`` (vLLM's numbering:
  ``EagleConfig.aux_layers``), and ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output`` all
  false (the graph compound trains).

Tensors (``model.safetensors``): the EAGLE layout's with ``midlayer.`` named ``layers.0.``: ``fc.weight``,
``layers.0.*``, ``norm.weight``, ``lm_head.weight``, and ``d2t``/``t2d`` only when V_d < V; no ``embed_tokens``.

What vLLM reads (vLLM 0.32.0 as installed by scripts/setup_vllm.sh):

* ``transformers_utils/config.py``: a ``config.json`` without ``model_type`` but with ``speculators_config`` is a
  speculators config. ``maybe_override_with_speculators`` (called by ``EngineArgs.create_engine_config``, so by
  ``vllm serve`` and ``LLM`` alike) then serves ``speculators_config.verifier.name_or_path`` as model and tokenizer,
  with ``{"method": speculators_model_type, "num_speculative_tokens": proposal_methods[0].speculative_tokens,
  "model": DIR}``; a ``--speculative-config`` given too overrides all but ``method`` and ``model``. So
  ``name_or_path`` is what vLLM loads the target from: a local directory's absolute path or a Hub id. vLLM 0.32 has
  no GGUF loader, so a GGUF target (the ``smollm2-135m`` alias's embedded file) cannot be named.
* ``transformers_utils/configs/speculators/base.py``: ``validate_speculators_config`` requires
  ``speculators_config.proposal_methods[0].speculative_tokens``, ``speculators_config.verifier.name_or_path``,
  ``speculators_model_type`` and a dict ``transformer_layer_config``, which becomes the draft's config.
* ``transformers_utils/configs/speculators/algos.py``, ``update_eagle3``: copies ``draft_vocab_size``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``, ``norm_before_fc``/``fc_norm``/``norm_output``
  (default false) and ``norm_before_residual`` **defaulting to true**, so false is written explicitly; the
  architecture comes from ``transformer_layer_config.model_type`` (``llama`` -> ``Eagle3LlamaForCausalLM``).
* ``model_executor/models/llama_eagle3.py``: ``fc`` reads ``num_aux_hidden_states`` x H, that count taken from the
  draft config's ``num_aux_hidden_states``, else its ``eagle_config``, else 3; the speculators path brings no
  ``eagle_config``, so ``num_aux_hidden_states`` is written into ``transformer_layer_config``. ``load_weights`` skips
  ``t2d``, loads ``d2t`` as ``draft_id_to_target_id`` (a parameter only when V_d differs from the target's vocabulary:
  a full-vocabulary ``d2t`` is refused, a missing reduced one stays zeros silently), prefixes all but ``lm_head``
  with ``model.``, and maps ``midlayer.`` to ``layers.0.`` (``LlamaModel.hf_to_vllm_mapper``), so both names load.
  ``attention_bias``, else ``bias``, gives the layer q/k/v biases (``models/llama.py``): written false.
* ``v1/spec_decode/llm_base_proposer.py``: a draft without ``embed_tokens`` shares the target's embedding.
* ``v1/worker/gpu_model_runner.py``, ``_get_eagle3_aux_layers_from_config``: the top-level
  ``eagle_aux_hidden_state_layer_ids`` (copied by ``update_eagle3``) are the layers captured.

What speculators reads and writes (``src/speculators`` at vllm-project/speculators c05b95b, 2026-08-20):

* ``config.py``: ``SpeculatorsConfig`` (``algorithm``, ``proposal_methods``, ``default_proposal_method``, which must
  be one of the methods' ``proposal_type``, ``verifier``), ``VerifierConfig`` (``name_or_path``, ``architectures``
  of the verifier's own ``config.json``); ``SpeculatorModelConfig.to_dict`` drops ``model_type``.
* ``proposals/greedy.py``: ``GreedyTokenProposalConfig`` (``proposal_type: "greedy"``, ``speculative_tokens``,
  ``verifier_accept_k`` 1 and ``accept_tolerance`` 0.0: exact top-1 match).
* ``models/eagle3/config.py``: ``Eagle3SpeculatorConfig`` (``speculators_model_type: "eagle3"``;
  ``transformer_layer_config`` built by its ``model_type``, a Qwen3Config when absent, so ``llama`` is written;
  ``draft_vocab_size`` defaults to 32000, so it is always written); ``architectures`` is overwritten on save by
  transformers' ``save_pretrained`` with the class name, ``Eagle3DraftModel`` (``models/eagle3/core.py``).
* ``models/eagle3/core.py`` and ``model.py`` (``DraftVocabMixin``): modules ``fc``, ``layers.0`` (with
  ``hidden_norm``), ``norm``, ``lm_head``, unprefixed; ``d2t``/``t2d`` buffers only when ``draft_vocab_size`` differs
  from ``transformer_layer_config.vocab_size``; ``embed_tokens``, ``d2t`` and ``t2d`` may be missing on load (the
  embedding is then the verifier's). ``convert/eagle/eagle3_converter.py`` renames ``midlayer.`` to ``layers.0.``.
  Unset ``eagle_aux_hidden_state_layer_ids`` mean [2, N // 2, N - 3] (``models/utils.py``), vLLM's numbering.
* Checked once outside the test suite with speculators 0.9.0 (PyPI): ``SpeculatorModelConfig.from_pretrained``
  reads an exported directory as an ``Eagle3SpeculatorConfig`` with a ``LlamaConfig`` layer, and
  ``Eagle3DraftModel.from_pretrained`` loads every tensor bit-exact (reduced and full vocabulary), lacking only
  ``embed_tokens`` (it loads the verifier's) and its training-only ``verifier_lm_head``/``verifier_norm``.

``compound.json`` is ``eagle_export``'s manifest (``format: "eagle"``) with ``layout: "speculators"`` and the
``verifier``; ``load_speculators`` rebuilds the exact ``EagleConfig`` from it, or from ``config.json`` alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.formats.checkpoint import MANIFEST
from toolkit.heads.eagle import EagleHead
from toolkit.heads.eagle_config import EAGLE3, EagleConfig
from toolkit.heads.eagle_export import (
    CONFIG,
    FORMAT,
    check_eagle_tensors,
    config_from_json,
    disk_tensors,
    expected_eagle_tensors,
    head_from_tensors,
    head_manifest,
    llama_layer_config,
    read_weights,
    write_head,
)
from toolkit.models import EMBEDDED

LAYOUT = "speculators"
SUBDIR = "speculators"  # train-heads writes this layout to OUTPUT/speculators, beside the EAGLE layout in OUTPUT
MODEL_TYPE = "eagle3"  # speculators_model_type, and vLLM's speculative method
SPECULATORS_ARCHITECTURES = ["Eagle3DraftModel"]
PROPOSAL = "greedy"
EAGLE_LAYER, LAYER = "midlayer.", "layers.0."  # the decoder layer's prefix in the EAGLE layout, in this one
GRAPH_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # all false in compound's graph


def _speculators_name(name: str) -> str:
    return LAYER + name.removeprefix(EAGLE_LAYER) if name.startswith(EAGLE_LAYER) else name


def _eagle_name(name: str) -> str:
    return EAGLE_LAYER + name.removeprefix(LAYER) if name.startswith(LAYER) else name


def expected_speculators_tensors(config: EagleConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor name of the speculators layout for an eagle3 head of ``config``: (shape, kind)."""
    return {_speculators_name(name): spec for name, spec in expected_eagle_tensors(config).items()}


def check_speculators_tensors(tensors: dict[str, torch.Tensor], config: EagleConfig) -> None:
    """Raise ValueError listing what in ``tensors`` differs from ``expected_speculators_tensors(config)``."""
    check_eagle_tensors(tensors, config, expected_speculators_tensors(config), LAYOUT)


def vllm_verifier(spec: str) -> str:
    """The ``verifier.name_or_path`` vLLM loads the target of a compound model spec from: a local directory's
    absolute path, a Hub id as given. Raises ValueError for a GGUF target, which vLLM 0.32 cannot load."""
    path = Path(spec).expanduser()
    if spec in EMBEDDED or path.suffix == ".gguf":
        raise ValueError(f"the target {spec} is a GGUF file, which vLLM 0.32 cannot load (it has no GGUF loader); "
                         "train on a Hugging Face directory or Hub id of the target to get a speculators layout")
    return str(path.resolve()) if path.exists() else spec


def _config_json(config: EagleConfig, dtype: torch.dtype, verifier: str, verifier_architectures: list[str],
                 speculative_tokens: int) -> dict:
    """The speculators ``config.json`` of a head (module docstring)."""
    c = config
    layer = llama_layer_config(c, dtype) | {"attention_bias": False, "mlp_bias": False,
                                            "num_aux_hidden_states": len(c.aux_layers)}
    proposal = {"proposal_type": PROPOSAL, "speculative_tokens": speculative_tokens, "verifier_accept_k": 1,
                "accept_tolerance": 0.0}
    verifier_config = {"name_or_path": verifier, "architectures": list(verifier_architectures)}
    return {"architectures": SPECULATORS_ARCHITECTURES, "speculators_model_type": MODEL_TYPE,
            "speculators_config": {"algorithm": MODEL_TYPE, "proposal_methods": [proposal],
                                   "default_proposal_method": PROPOSAL, "verifier": verifier_config},
            "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.hidden_size, **dict.fromkeys(GRAPH_FLAGS, False),
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers), "torch_dtype": layer["torch_dtype"],
            "dtype": layer["dtype"]}


def export_speculators(head: EagleHead, out_dir: Path, *, verifier: str, verifier_architectures: list[str],
                       speculative_tokens: int, target: str, target_sha256: str | None,
                       dtype: torch.dtype = torch.bfloat16, overwrite: bool = False,
                       extra_manifest: dict | None = None) -> Path:
    """Write the eagle3 ``head`` to ``out_dir`` in the speculators layout, atomically: ``verifier`` is the target's
    path or Hub id as vLLM loads it (``vllm_verifier``), ``verifier_architectures`` its config's, and
    ``speculative_tokens`` the chain vLLM drafts by default. Refuses EAGLE-1 heads (vLLM serves no speculators
    ``eagle``) and tensors that do not match ``expected_speculators_tensors``."""
    config = head.config
    if config.variant is not EAGLE3:
        raise ValueError(f"the speculators layout holds EAGLE-3 heads (vLLM 0.32 serves speculators_model_type "
                         f"{MODEL_TYPE!r} but no 'eagle'); this head is {config.kind!r}")
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be at least 1, got {speculative_tokens}")
    tensors = {_speculators_name(name): t for name, t in disk_tensors(head).items()}
    check_speculators_tensors(tensors, config)
    manifest = head_manifest(config, target, target_sha256, dtype) | {"layout": LAYOUT, "verifier": verifier} \
        | (extra_manifest or {})
    return write_head(out_dir, tensors, _config_json(config, dtype, verifier, verifier_architectures,
                                                     speculative_tokens), manifest, dtype, overwrite)


def is_speculators_config(raw: dict) -> bool:
    """Whether a parsed ``config.json`` is a speculators config (as vLLM tells: ``speculators_config``)."""
    return "speculators_config" in raw


def is_speculators(directory: Path) -> bool:
    """Whether ``directory``'s ``config.json`` is a speculators config."""
    path = Path(directory) / CONFIG
    return path.is_file() and is_speculators_config(json.loads(path.read_text()))


def load_speculators(directory: Path) -> EagleHead:
    """The head (float32, not attached) of a speculators directory: its config from ``compound.json`` when present
    (file hashes checked), else from ``config.json``; every tensor checked."""
    directory = Path(directory)
    config = _read_config(directory)
    tensors = read_weights(directory)
    check_speculators_tensors(tensors, config)
    return head_from_tensors(config, {_eagle_name(name): t for name, t in tensors.items()}, directory)


def _read_config(directory: Path) -> EagleConfig:
    """The head config of a speculators directory: ``compound.json``'s when present, else from ``config.json``."""
    if not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: not a speculators directory")
    if (directory / MANIFEST).is_file():
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("format") != FORMAT or manifest.get("layout") != LAYOUT:
            raise ValueError(f"{directory / MANIFEST} records a {manifest.get('format')!r} export in the "
                             f"{manifest.get('layout') or 'default'} layout, not an EAGLE head in the speculators "
                             "layout")
        return EagleConfig.from_dict(manifest["eagle"])
    return _config_from_speculators(json.loads((directory / CONFIG).read_text()), directory)


def _config_from_speculators(raw: dict, directory: Path) -> EagleConfig:
    """An ``EagleConfig`` from a speculators ``config.json`` alone, refusing what compound's head does not compute."""
    layer = raw.get("transformer_layer_config") or {}
    if raw.get("speculators_model_type") != MODEL_TYPE or layer.get("model_type") != "llama":
        raise ValueError(f"{directory / CONFIG}: speculators_model_type {raw.get('speculators_model_type')!r} with a "
                         f"{layer.get('model_type')!r} layer; compound reads eagle3 heads with a llama layer")
    unsupported = [key for key in GRAPH_FLAGS[1:] if raw.get(key)] + \
        [key for key in ("attention_bias", "mlp_bias") if layer.get(key)]
    if unsupported:
        raise ValueError(f"{directory / CONFIG}: {', '.join(unsupported)} true; compound's EAGLE-3 head computes "
                         "none of these")
    return config_from_json({**layer, "architectures": list(EAGLE3.architectures),
                             "draft_vocab_size": raw.get("draft_vocab_size"),
                             "eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids"),
                             "norm_before_residual": raw.get("norm_before_residual", True)},  # vLLM's default
                            directory)
