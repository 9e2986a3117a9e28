"""GGUF files for llama.cpp: tensor names, the rotary row order, model and tokenizer metadata, and the atomic writer.

The container (header, key-value metadata, tensor infos, 32-byte aligned data) is written by gguf-py's
``GGUFWriter``, the library llama.cpp's own converter writes with; the bytes of every quantized block come from
``toolkit.formats.gguf_blocks`` (compound's own codes and scales). A family is written as the llama.cpp architecture
its ``Family.gguf`` names (``toolkit.architectures``): ``llama``, or ``gemma3`` for Gemma 3 (``gemma3_text``).

| Hugging Face tensor (decoder layer i)        | GGUF tensor              | type                                   |
|----------------------------------------------|--------------------------|----------------------------------------|
| model.embed_tokens.weight                    | token_embd.weight        | ``EMBEDDING_TYPE`` (also the output when tied) |
| lm_head.weight (untied only)                 | output.weight            | ``EMBEDDING_TYPE``                     |
| model.norm.weight                            | output_norm.weight       | F32                                    |
| model.layers.i.input_layernorm.weight        | blk.i.attn_norm.weight   | F32                                    |
| model.layers.i.post_attention_layernorm.weight | blk.i.ffn_norm.weight  | F32 (Gemma 3: blk.i.post_attention_norm) |
| model.layers.i.pre_feedforward_layernorm.weight | blk.i.ffn_norm.weight | F32 (Gemma 3)                          |
| model.layers.i.post_feedforward_layernorm.weight | blk.i.post_ffw_norm.weight | F32 (Gemma 3)                    |
| model.layers.i.self_attn.{q,k}_norm.weight   | blk.i.attn_{q,k}_norm.weight | F32 (Gemma 3)                      |
| model.layers.i.self_attn.{q,k,v,o}_proj      | blk.i.attn_{q,k,v,output}.weight | Q4_0 / Q4_1 / Q8_0 (the codes), F16/F32 (float) |
| model.layers.i.mlp.{gate,up,down}_proj       | blk.i.ffn_{gate,up,down}.weight  | as above                      |

The per-layer names follow from the family's entry (``post_norms``, ``qk_norm``: ``layer_names``), so the table above
is derived, not declared per architecture.

Rotary row order: Hugging Face checkpoints rotate halves (dimension j pairs with j + head_dim/2); llama.cpp's
``llama`` architecture rotates adjacent pairs (2j with 2j + 1), its ``gemma3`` halves, as Hugging Face
(``ADJACENT_ROPE_PAIRS``). So for ``llama`` the output rows of q_proj and k_proj are reordered per head, row
``p·head_dim/2 + j`` of a head becoming row ``2j + p`` (what llama.cpp's ``convert_hf_to_gguf.py`` does to the
weights, and transformers' GGUF loader undoes). Whole rows move, so a quantized row's blocks move with it unchanged.

Gemma 3 (what llama.cpp's ``gemma3`` computes itself, and what the file must say): Hugging Face's RMSNorm weights
w act as (1 + w), llama.cpp's as stored, so every norm weight is written as 1 + w (``Family.norm_offset``, in
float32); llama.cpp scales the embeddings by sqrt(hidden) itself, so token_embd holds the raw table. llama.cpp
fixes the sliding layers (every layer but each sixth), their RoPE base (10000, unscaled) and the score scale
(head_dim^-0.5, hidden/heads for its 62-layer 27B); a model whose config differs is refused
(``gemma3_metadata``). The window, the global RoPE (with linear scaling) and the final logit cap are keys.
The tokenizer: Gemma's SentencePiece vocabulary (262k pieces with scores and token types) is carried over from the
GGUF file the model came from (``tokenizer_metadata``).

GGUF shapes list the fastest dimension first: a [N, K] weight is ``[K, N]`` in the file (gguf-py reverses them).
Byte layouts and sources: docs/formats.md §5.

As a member of ``toolkit.formats.FORMATS`` this format is one file (``CHECKPOINT`` False), written from a
checkpoint's codes: by ``quantize --gguf`` from the weights in hand, by ``convert --format gguf`` from a checkpoint
on disk; ``FileTensors`` gathers its tensors either way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from toolkit.architectures import Family, family
from toolkit.formats import gguf_blocks
from toolkit.formats.checkpoint import OutputError, remove_leftovers, sibling
from toolkit.formats.gguf_blocks import BLOCK_SIZE
from toolkit.formats.scheme import FormatError, Scheme
from toolkit.quant.configs import WeightQuantConfig
from toolkit.quant.kv_cache import SCALE_NAMES as KV_SCALE_NAMES
from toolkit.quant.primitives import QuantizedWeight, default_g_idx

NAME = "gguf"
CHECKPOINT = False  # one file written from a checkpoint's codes, not a checkpoint directory
TRITON_KERNEL = None  # compound runs the checkpoint the file was written from; llama.cpp runs the blocks
# llama.cpp architecture → whether its RoPE rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM) rather than halves (NEOX)
ADJACENT_ROPE_PAIRS = {"llama": True, "gemma3": False}
EMBEDDING_TYPE = "Q8_0"  # token embeddings (and an untied output), whatever the linears' type
FLOAT_TYPES = ("F16", "F32")  # float exports: every 2-D weight in this type, norms always F32


def block_type(config: WeightQuantConfig) -> str:
    """The GGUF block type of ``config``'s grid (``gguf_blocks.block_type``); FormatError naming the reason and the
    flag to change when GGUF blocks cannot hold it exactly."""
    dynamic = config.act_order and not config.static_groups and config.group_size != -1
    return gguf_blocks.block_type(config.bits, config.sym, config.group_size, dynamic)


def vllm_kernel(scheme: Scheme | None, quant: dict) -> tuple[str, str]:
    """(vLLM method → kernel, why): vLLM 0.32 has no GGUF loader (no ``quantization/gguf.py``)."""
    return "refused", "vLLM 0.32 has no GGUF loader; llama.cpp serves this file (llama-server -m FILE)"


_LINEAR_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def config_family(config) -> Family:
    """The architecture-table entry of ``config``'s family, refused unless GGUF export writes it."""
    return family(config.model_type, "gguf")


def layer_names(entry: Family) -> dict[str, str]:
    """Hugging Face module (relative to a decoder layer) → GGUF tensor stem, for a family: the norm the MLP reads is
    llama.cpp's ``ffn_norm``; norms on the branch outputs (``post_norms``) and per-head q/k norms (``qk_norm``) have
    names of their own."""
    names = {**_LINEAR_NAMES, "input_layernorm": "attn_norm", entry.mlp_norm: "ffn_norm"}
    if entry.post_norms:
        names |= {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    if entry.qk_norm:
        names |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    return names


def tensor_name(module: str, entry: Family) -> str:
    """The GGUF name of the weight of Hugging Face module ``module`` of a model of family ``entry``
    (``model.layers.3.mlp.up_proj`` → ``blk.3.ffn_up.weight``); FormatError for a module its llama.cpp architecture
    has no tensor for."""
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.weight"
    prefix, _, rest = module.partition("model.layers.")
    index, _, inner = rest.partition(".")
    names = layer_names(entry)
    if prefix == "" and index.isdigit() and inner in names:
        return f"blk.{index}.{names[inner]}.weight"
    raise FormatError(f"{module} has no tensor in GGUF's {entry.gguf} architecture")


def rope_rows(module: str, config) -> int | None:
    """The head count whose rows ``to_rope_order`` reorders for ``module`` (q_proj: attention heads, k_proj: KV
    heads) where the llama.cpp architecture rotates adjacent pairs; None for any other module."""
    if not ADJACENT_ROPE_PAIRS[config_family(config).gguf]:
        return None
    if module.endswith("self_attn.q_proj"):
        return config.num_attention_heads
    if module.endswith("self_attn.k_proj"):
        return config.num_key_value_heads
    return None


def to_rope_order(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """``rows`` [heads·head_dim, ...] from the rotate-half order to llama.cpp's adjacent-pair order (per head, row
    ``p·head_dim/2 + j`` → row ``2j + p``)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def model_metadata(config) -> dict[str, tuple[str, object]]:
    """The ``{arch}.*`` keys llama.cpp reads for ``config`` (a transformers config of a family GGUF export writes), as
    {key: (gguf value type, value)}; FormatError for what the architecture cannot carry (RoPE scaling other than
    linear, biases, what llama.cpp's ``gemma3`` fixes and the config sets otherwise)."""
    arch = config_family(config).gguf
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise FormatError(f"GGUF's {arch} architecture has no linear biases; this model has some")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    if config_family(config).rope_by_layer_type:  # the global scheme; the local one is checked by gemma3_metadata
        rope = rope.get("full_attention", {})
    keys = {
        "context_length": ("u32", config.max_position_embeddings),
        "embedding_length": ("u32", config.hidden_size),
        "block_count": ("u32", config.num_hidden_layers),
        "feed_forward_length": ("u32", config.intermediate_size),
        "attention.head_count": ("u32", config.num_attention_heads),
        "attention.head_count_kv": ("u32", config.num_key_value_heads),
        "attention.key_length": ("u32", head_dim),
        "attention.value_length": ("u32", head_dim),
        "rope.freq_base": ("f32", float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))),
        "attention.layer_norm_rms_epsilon": ("f32", float(config.rms_norm_eps)),
        "rope.dimension_count": ("u32", head_dim),
        "vocab_size": ("u32", config.vocab_size),
    }
    keys |= _rope_scaling(rope)
    if arch == "gemma3":
        keys |= gemma3_metadata(config, head_dim)
    return {f"{arch}.{key}": value for key, value in keys.items()}


def _rope_scaling(rope: dict) -> dict[str, tuple[str, object]]:
    """The ``rope.scaling.*`` keys of a RoPE scheme: none for default RoPE, the factor of linear scaling; FormatError
    for any other scaling."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope.scaling.type": ("str", "linear"), "rope.scaling.factor": ("f32", float(rope["factor"]))}
    raise FormatError(f"GGUF export writes default or linear RoPE only, not {kind!r}")


GEMMA3_SWA_PERIOD = 6  # llama.cpp's gemma3: every layer slides its window but each sixth (set_swa_pattern(6))
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # and the sliding layers' RoPE base (rope_freq_base_train_swa), unscaled


def gemma3_metadata(config, head_dim: int) -> dict[str, tuple[str, object]]:
    """The keys of llama.cpp's ``gemma3`` beyond the common ones (the window; the final logit cap where set), after
    refusing a config whose layer pattern, local RoPE, score scale, attention cap or activation differ from what
    llama.cpp fixes for the architecture."""
    layer_types = list(config.layer_types)
    expected = ["full_attention" if (i + 1) % GEMMA3_SWA_PERIOD == 0 else "sliding_attention"
                for i in range(config.num_hidden_layers)]
    if layer_types != expected:
        raise FormatError(f"llama.cpp's gemma3 slides the window on every layer but each {GEMMA3_SWA_PERIOD}th; "
                          f"this model's layer_types are {layer_types}")
    local = config.rope_parameters.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default" or float(local.get("rope_theta", 0)) != GEMMA3_LOCAL_ROPE_THETA:
        raise FormatError(f"llama.cpp's gemma3 gives sliding layers default RoPE of base {GEMMA3_LOCAL_ROPE_THETA:g}; "
                          f"this model's are {local}")
    scalar = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else head_dim
    if config.query_pre_attn_scalar != scalar:
        raise FormatError(f"llama.cpp's gemma3 scales attention scores by {scalar}^-0.5; this model's "
                          f"query_pre_attn_scalar is {config.query_pre_attn_scalar}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise FormatError("llama.cpp's gemma3 does not soft-cap attention scores; this model's "
                          f"attn_logit_softcapping is {config.attn_logit_softcapping}")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise FormatError(f"llama.cpp's gemma3 MLP is gelu-tanh; this model's is {config.hidden_activation!r}")
    keys = {"attention.sliding_window": ("u32", config.sliding_window)}
    if getattr(config, "final_logit_softcapping", None) is not None:
        keys["final_logit_softcapping"] = ("f32", float(config.final_logit_softcapping))
    return keys


_CONTROL, _USER_DEFINED, _NORMAL = 3, 4, 1  # llama.cpp token types


def tokenizer_metadata(directory: Path, source_gguf: Path | None = None) -> dict[str, tuple[str, object]]:
    """The ``tokenizer.*`` keys of the tokenizer in ``directory`` (its ``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``). ``source_gguf``: the GGUF file the model came from. A SentencePiece vocabulary (Gemma's:
    pieces with scores, ``tokenizer.ggml.model`` llama) is carried over from it unchanged, once its size is checked
    against ``directory``'s; a byte-level BPE tokenizer is written from ``directory`` (tokens by id with their types,
    merges, special token ids, the chat template), keeping the source's ``tokenizer.ggml.pre`` (the pre-tokenizer
    llama.cpp applies; else ``default``)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FormatError(f"{directory} has no tokenizer.json; GGUF export needs the model's tokenizer")
    spec = json.loads(tokenizer_file.read_text())
    model = spec.get("model", {})
    source = _source_tokenizer(source_gguf)
    if source.get("tokenizer.ggml.model", ("str", "gpt2"))[1] != "gpt2":
        return _carried_tokenizer(source, spec, directory)
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict) or model.get("byte_fallback"):
        kind = "SentencePiece (BPE with byte fallback)" if model.get("byte_fallback") else repr(model.get("type"))
        raise FormatError(f"GGUF export writes byte-level BPE tokenizers (tokenizer.ggml.model gpt2), or carries a "
                          f"SentencePiece vocabulary over from the GGUF file the model came from; this one is {kind} "
                          "and has no source GGUF: quantize or export the model from its .gguf file")
    vocab = dict(model["vocab"])
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    vocab.update({token["content"]: i for i, token in added.items()})
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, i in vocab.items():
        tokens[i] = text
    types = [(_CONTROL if added[i].get("special") else _USER_DEFINED) if i in added else _NORMAL
             for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    settings = _settings(directory)
    meta = {
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.pre": source.get("tokenizer.ggml.pre", ("str", "default")),
        "tokenizer.ggml.tokens": ("str[]", tokens),
        "tokenizer.ggml.token_type": ("i32[]", types),
        "tokenizer.ggml.merges": ("str[]", merges),
        "tokenizer.ggml.add_bos_token": ("bool", bool(settings.get("add_bos_token", False))),
    }
    for key, field in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        token = settings.get(field)
        token = token.get("content") if isinstance(token, dict) else token
        if token in vocab:
            meta[f"tokenizer.ggml.{key}_token_id"] = ("u32", vocab[token])
    return meta | _chat_template(directory, settings)


def _settings(directory: Path) -> dict:
    settings_file = directory / "tokenizer_config.json"
    return json.loads(settings_file.read_text()) if settings_file.is_file() else {}


def _chat_template(directory: Path, settings: dict) -> dict[str, tuple[str, object]]:
    """``tokenizer.chat_template``: the checkpoint's template, when it has one."""
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else settings.get("chat_template")
    return {"tokenizer.chat_template": ("str", template)} if isinstance(template, str) else {}


def _carried_tokenizer(source: dict, spec: dict, directory: Path) -> dict[str, tuple[str, object]]:
    """The source GGUF's ``tokenizer.*`` keys, refused unless its vocabulary has as many tokens as the checkpoint's
    ``tokenizer.json`` (the checkpoint's tokenizer was read from that file; another model's would differ)."""
    vocab = dict(spec.get("model", {}).get("vocab") or {})
    vocab.update({token["content"]: token["id"] for token in spec.get("added_tokens", [])})
    pieces = source["tokenizer.ggml.tokens"][1]
    if len(pieces) != len(vocab):
        raise FormatError(f"the source GGUF's vocabulary has {len(pieces)} tokens, {directory}'s tokenizer "
                          f"{len(vocab)}: the checkpoint was not made from that file")
    return source | _chat_template(directory, _settings(directory))


_KINDS = {"UINT32": "u32", "INT32": "i32", "FLOAT32": "f32", "BOOL": "bool", "STRING": "str"}


def _source_tokenizer(source_gguf: Path | None) -> dict[str, tuple[str, object]]:
    """The ``tokenizer.*`` keys of ``source_gguf`` (none without it) as {key: (type, value)}, chat template aside."""
    if source_gguf is None:
        return {}
    from gguf import GGUFReader

    keys = {}
    for key, field in GGUFReader(str(source_gguf)).fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        kinds = [kind.name for kind in field.types]
        kind = _KINDS[kinds[1]] + "[]" if kinds[0] == "ARRAY" else _KINDS[kinds[0]]
        keys[key] = (kind, field.contents())
    return keys


_VALUE_TYPES = {"u32": "UINT32", "i32": "INT32", "f32": "FLOAT32", "str": "STRING", "bool": "BOOL"}


def write_gguf(path: Path, arch: str, metadata: dict[str, tuple[str, object]],
               tensors: list[tuple[str, str, torch.Tensor]], overwrite: bool = False) -> Path:
    """Write a GGUF file of llama.cpp architecture ``arch`` with ``metadata`` ({key: (type, value)}, a type of
    ``_VALUE_TYPES`` or an array of one: ``"i32[]"``) and ``tensors`` ([(GGUF name, type name, data)]: F32/F16 data is
    the float weight itself, block types uint8 [N, K/32·block bytes]), atomically: a temporary file beside ``path``
    that replaces it only once complete (removed on any error)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    staging = sibling(path, "tmp")
    writer = GGUFWriter(str(staging), arch)
    try:
        for key, (kind, value) in metadata.items():
            if kind.endswith("[]") and not len(value):  # GGUF has no empty arrays: a key with none is left out
                continue
            if kind.endswith("[]"):
                writer.add_key_value(key, value, GGUFValueType.ARRAY,
                                     sub_type=GGUFValueType[_VALUE_TYPES[kind.removesuffix("[]")]])
            else:
                writer.add_key_value(key, value, GGUFValueType[_VALUE_TYPES[kind]])
        for name, type_name, data in tensors:
            if type_name == "F32":
                writer.add_tensor(name, data.float().contiguous().numpy())
            elif type_name == "F16":
                writer.add_tensor(name, data.to(torch.float16).contiguous().numpy())
            else:
                writer.add_tensor(name, np.ascontiguousarray(data.numpy()), raw_shape=data.shape,
                                  raw_dtype=GGMLQuantizationType[type_name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staging, path)
    except OSError as err:
        writer.close()
        staging.unlink(missing_ok=True)
        raise OutputError(f"could not write {path}: {err.strerror or err}") from None
    except BaseException:
        writer.close()
        staging.unlink(missing_ok=True)
        raise
    return path


def file_type(types: set[str]) -> int:
    """``general.file_type`` (llama.cpp's ``LLAMA_FTYPE``) for a file whose linears are of ``types``."""
    from gguf import LlamaFileType

    by_type = {"Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
               "Q8_0": LlamaFileType.MOSTLY_Q8_0, "F16": LlamaFileType.MOSTLY_F16, "F32": LlamaFileType.ALL_F32}
    if len(types) != 1 or next(iter(types)) not in by_type:
        raise FormatError(f"one GGUF file holds one linear type; this model's linears are {sorted(types)}")
    return int(by_type[next(iter(types))])


def blocks_fit(K: int) -> bool:
    """Whether rows of ``K`` columns are whole GGUF blocks."""
    return K % BLOCK_SIZE == 0


class FileTensors:
    """The tensors of one GGUF file of a ``config`` model, added in any order (a quantized linear's codes as soon
    as they exist, float tensors as the checkpoint holds them) and listed in the file's order: quantized linears by
    module name, then float tensors by Hugging Face name. Rows are put in llama.cpp's rotary order as they come."""

    def __init__(self, config):
        self.config = config
        self.family = config_family(config)
        self.linears: dict[str, tuple[str, str, torch.Tensor]] = {}  # module → (GGUF name, type, data)
        self.floats: dict[str, tuple[str, str, torch.Tensor]] = {}  # tensor name → (GGUF name, type, data)

    def add_linear(self, module: str, qweight: QuantizedWeight) -> None:
        """``module``'s codes as GGUF blocks, unchanged; FormatError for a weight they cannot hold exactly."""
        if qweight.bias is not None:
            raise FormatError(f"{module} has a bias, which GGUF's {self.family.gguf} architecture does not hold")
        try:
            type_name, blocks = gguf_blocks.pack(qweight)
        except FormatError as err:
            raise FormatError(f"{module} cannot be written as GGUF blocks exactly: {err}") from None
        self.linears[module] = (tensor_name(module, self.family), type_name, self._rope_order(module, blocks.cpu()))

    def add_floats(self, state: dict[str, torch.Tensor], outtype: str | None = None) -> None:
        """The float weights in ``state``: norms F32, as llama.cpp multiplies by them (the family's ``norm_offset``
        added: Gemma's 1 + w); 2-D weights in ``outtype``, or (None) embeddings and an untied output as
        ``EMBEDDING_TYPE``. A tied ``lm_head`` is not written (llama.cpp reads token_embd), nor are KV-cache
        scales."""
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        for name, tensor in state.items():
            module, _, kind = name.rpartition(".")
            if kind in KV_SCALE_NAMES:  # llama.cpp scales its quantized KV cache per block itself
                continue
            if kind != "weight" or (tied and module == "lm_head"):
                if kind == "weight":
                    continue
                raise FormatError(f"{name} has no place in GGUF's {self.family.gguf} architecture")
            if tensor.dim() == 1:
                type_name, data = "F32", tensor.float() + self.family.norm_offset
            elif outtype is not None:
                type_name, data = outtype, tensor
            else:
                type_name, data = gguf_blocks.pack(_q8_0(tensor))
            self.floats[name] = (tensor_name(module, self.family), type_name, self._rope_order(module, data.cpu()))

    def types(self) -> set[str]:
        """The block types of the quantized linears."""
        return {type_name for _, type_name, _ in self.linears.values()}

    def listed(self) -> list[tuple[str, str, torch.Tensor]]:
        """(GGUF name, type, data) of every tensor, in the file's order."""
        return [self.linears[m] for m in sorted(self.linears)] + [self.floats[n] for n in sorted(self.floats)]

    def _rope_order(self, module: str, rows: torch.Tensor) -> torch.Tensor:
        heads = rope_rows(module, self.config)
        return rows if heads is None else to_rope_order(rows, heads)


def _q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """Round-to-nearest symmetric 8-bit codes over blocks of 32 with fp16 scales (Q8_0's grid: d = amax/127)."""
    N, K = weight.shape
    if not blocks_fit(K):
        raise FormatError(f"a width of {K} is not whole GGUF blocks of {BLOCK_SIZE}")
    blocks = weight.float().reshape(N, K // BLOCK_SIZE, BLOCK_SIZE)
    scale = (blocks.abs().amax(dim=-1) / 127).to(torch.float16).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (torch.round(blocks / scale[..., None]).clamp(-128, 127) + 128).to(torch.uint8).reshape(N, K)
    return QuantizedWeight(codes, scale, torch.full_like(scale, 128, dtype=torch.int32), default_g_idx(K, BLOCK_SIZE),
                           8, BLOCK_SIZE, True)
