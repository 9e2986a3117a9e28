"""GGUF files for llama.cpp: tensor names, the rotary row order, model and tokenizer metadata, and the atomic writer.

The container (header, key-value metadata, tensor infos, 32-byte aligned data) is written by gguf-py's
``GGUFWriter``, the library llama.cpp's own converter writes with; the bytes of every quantized block come from
``toolkit.formats.gguf_blocks`` (compound's own codes and scales). Only the ``llama`` GGUF architecture is written:
the families whose ``Family.gguf`` names it (``toolkit.architectures``).

| Hugging Face tensor (decoder layer i)        | GGUF tensor              | type                                   |
|----------------------------------------------|--------------------------|----------------------------------------|
| model.embed_tokens.weight                    | token_embd.weight        | ``EMBEDDING_TYPE`` (also the output when tied) |
| lm_head.weight (untied only)                 | output.weight            | ``EMBEDDING_TYPE``                     |
| model.norm.weight                            | output_norm.weight       | F32                                    |
| model.layers.i.input_layernorm.weight        | blk.i.attn_norm.weight   | F32                                    |
| model.layers.i.post_attention_layernorm.weight | blk.i.ffn_norm.weight  | F32                                    |
| model.layers.i.self_attn.{q,k,v,o}_proj      | blk.i.attn_{q,k,v,output}.weight | Q4_0 / Q4_1 / Q8_0 (the codes), F16/F32 (float) |
| model.layers.i.mlp.{gate,up,down}_proj       | blk.i.ffn_{gate,up,down}.weight  | as above                      |

Rotary row order: Hugging Face Llama checkpoints rotate halves (dimension j pairs with j + head_dim/2); llama.cpp's
``llama`` architecture rotates adjacent pairs (2j with 2j + 1). So the output rows of q_proj and k_proj are
reordered per head, row ``p·head_dim/2 + j`` of a head becoming row ``2j + p`` (what llama.cpp's
``convert_hf_to_gguf.py`` does to the weights, and transformers' GGUF loader undoes). Whole rows move, so a
quantized row's blocks move with it unchanged.

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
ARCH = "llama"  # the one GGUF architecture written
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


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def tensor_name(module: str) -> str:
    """The GGUF name of the weight of Hugging Face module ``module`` (``model.layers.3.mlp.up_proj`` →
    ``blk.3.ffn_up.weight``); FormatError for a module the ``llama`` architecture has no tensor for."""
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.weight"
    prefix, _, rest = module.partition("model.layers.")
    index, _, inner = rest.partition(".")
    if prefix == "" and index.isdigit() and inner in _LAYER_NAMES:
        return f"blk.{index}.{_LAYER_NAMES[inner]}.weight"
    raise FormatError(f"{module} has no tensor in GGUF's {ARCH} architecture")


def rope_rows(module: str, config) -> int | None:
    """The head count whose rows ``to_rope_order`` reorders for ``module`` (q_proj: attention heads, k_proj: KV
    heads), None for any other module."""
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
    """The ``llama.*`` keys llama.cpp reads for ``config`` (a transformers ``LlamaConfig``), as {key: (gguf value
    type, value)}; FormatError for what the architecture cannot carry (RoPE scaling, biases, a head_dim other
    than hidden/heads)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise FormatError(f"GGUF export writes default RoPE only, not {rope.get('rope_type')!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise FormatError("GGUF's llama architecture has no linear biases; this model has some")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return {
        f"{ARCH}.context_length": ("u32", config.max_position_embeddings),
        f"{ARCH}.embedding_length": ("u32", config.hidden_size),
        f"{ARCH}.block_count": ("u32", config.num_hidden_layers),
        f"{ARCH}.feed_forward_length": ("u32", config.intermediate_size),
        f"{ARCH}.attention.head_count": ("u32", config.num_attention_heads),
        f"{ARCH}.attention.head_count_kv": ("u32", config.num_key_value_heads),
        f"{ARCH}.attention.key_length": ("u32", head_dim),
        f"{ARCH}.attention.value_length": ("u32", head_dim),
        f"{ARCH}.rope.dimension_count": ("u32", head_dim),
        f"{ARCH}.rope.freq_base": ("f32", float(theta)),
        f"{ARCH}.attention.layer_norm_rms_epsilon": ("f32", float(config.rms_norm_eps)),
        f"{ARCH}.vocab_size": ("u32", config.vocab_size),
    }


_CONTROL, _USER_DEFINED, _NORMAL = 3, 4, 1  # llama.cpp token types


def tokenizer_metadata(directory: Path, source_gguf: Path | None = None) -> dict[str, tuple[str, object]]:
    """The ``tokenizer.*`` keys of the byte-level BPE tokenizer in ``directory`` (its ``tokenizer.json``,
    ``tokenizer_config.json``, ``chat_template.jinja``): tokens by id with their types, merges, special token ids and
    the chat template. ``source_gguf``: the GGUF file the model came from, whose ``tokenizer.ggml.pre`` (the
    pre-tokenizer llama.cpp applies) is kept; else ``default``."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FormatError(f"{directory} has no tokenizer.json; GGUF export needs the model's tokenizer")
    spec = json.loads(tokenizer_file.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise FormatError("GGUF export writes byte-level BPE tokenizers (tokenizer.ggml.model gpt2); this one is "
                          f"{model.get('type')!r}")
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
    settings_file = directory / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    meta = {
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.pre": ("str", _pre_tokenizer(source_gguf)),
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
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else settings.get("chat_template")
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = ("str", template)
    return meta


def _pre_tokenizer(source_gguf: Path | None) -> str:
    if source_gguf is None:
        return "default"
    from gguf import GGUFReader

    field = GGUFReader(str(source_gguf)).fields.get("tokenizer.ggml.pre")
    return field.contents() if field is not None else "default"


_VALUE_WRITERS = {"u32": "add_uint32", "f32": "add_float32", "str": "add_string", "bool": "add_bool"}


def write_gguf(path: Path, metadata: dict[str, tuple[str, object]],
               tensors: list[tuple[str, str, torch.Tensor]], overwrite: bool = False) -> Path:
    """Write a GGUF file of architecture ``ARCH`` with ``metadata`` ({key: (type, value)}) and ``tensors`` ([(GGUF
    name, type name, data)]: F32/F16 data is the float weight itself, block types uint8 [N, K/32·block bytes]),
    atomically: a temporary file beside ``path`` that replaces it only once complete (removed on any error)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    staging = sibling(path, "tmp")
    writer = GGUFWriter(str(staging), ARCH)
    try:
        for key, (kind, value) in metadata.items():
            if kind.endswith("[]"):
                writer.add_array(key, value) if kind == "str[]" else writer.add_key_value(
                    key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
            else:
                getattr(writer, _VALUE_WRITERS[kind])(key, value)
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
        self.linears: dict[str, tuple[str, str, torch.Tensor]] = {}  # module → (GGUF name, type, data)
        self.floats: dict[str, tuple[str, str, torch.Tensor]] = {}  # tensor name → (GGUF name, type, data)

    def add_linear(self, module: str, qweight: QuantizedWeight) -> None:
        """``module``'s codes as GGUF blocks, unchanged; FormatError for a weight they cannot hold exactly."""
        if qweight.bias is not None:
            raise FormatError(f"{module} has a bias, which GGUF's {ARCH} architecture does not hold")
        try:
            type_name, blocks = gguf_blocks.pack(qweight)
        except FormatError as err:
            raise FormatError(f"{module} cannot be written as GGUF blocks exactly: {err}") from None
        self.linears[module] = (tensor_name(module), type_name, self._rope_order(module, blocks.cpu()))

    def add_floats(self, state: dict[str, torch.Tensor], outtype: str | None = None) -> None:
        """The float weights in ``state``: norms F32; 2-D weights in ``outtype``, or (None) embeddings and an untied
        output as ``EMBEDDING_TYPE``. A tied ``lm_head`` is not written (llama.cpp reads token_embd), nor are
        KV-cache scales."""
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        for name, tensor in state.items():
            module, _, kind = name.rpartition(".")
            if kind in KV_SCALE_NAMES:  # llama.cpp scales its quantized KV cache per block itself
                continue
            if kind != "weight" or (tied and module == "lm_head"):
                if kind == "weight":
                    continue
                raise FormatError(f"{name} has no place in GGUF's {ARCH} architecture")
            if tensor.dim() == 1:
                type_name, data = "F32", tensor
            elif outtype is not None:
                type_name, data = outtype, tensor
            else:
                type_name, data = gguf_blocks.pack(_q8_0(tensor))
            self.floats[name] = (tensor_name(module), type_name, self._rope_order(module, data.cpu()))

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
