"""The decoder families compound knows, by data: one entry per ``model_type``, read by every layer that walks a model.

Linears inside a decoder layer are found by module type and how they share inputs is traced at run time
(``toolkit.engine.loop``); an entry holds only what tracing cannot reveal. How each family differs from Llama:

| model_type  | differs from Llama                                                                             |
|-------------|------------------------------------------------------------------------------------------------|
| llama       | (the reference) RMSNorm ``w · x̂``, SiLU-gated MLP, RoPE over the whole head                   |
| mistral     | a sliding attention window when ``config.sliding_window`` is set                               |
| qwen2       | q/k/v biases (inside the linears); a window only on ``sliding_attention`` layers               |
| qwen3       | per-head RMSNorm of q and k before RoPE                                                        |
| phi3        | q/k/v fused in ``self_attn.qkv_proj`` (rows q, k, v) and gate/up in ``mlp.gate_up_proj`` (rows |
|             | gate, up), kept fused on disk as vLLM's Phi-3 loader reads them                                |
| gemma       | RMSNorm ``(1 + w) · x̂``, embeddings × sqrt(hidden_size), gelu-tanh MLP, explicit head_dim    |
| gemma2      | Gemma's, plus norms after attention and after the MLP (gate/up read                            |
|             | ``pre_feedforward_layernorm``), scores scaled by ``query_pre_attn_scalar``^-0.5, soft-capped   |
|             | attention and final logits, a window on the ``sliding_attention`` layers                       |
| gemma3_text | Gemma 2's layer with per-head q/k norms, and RoPE frequencies per layer type (a local base on  |
|             | sliding layers, the global one with its scaling on full ones); soft-capping only where set     |
| mixtral     | Mistral's attention; the MLP is a sparse block: a router picks the top-k of E experts per token |
|             | (softmax over the top-k), each a SiLU-gated MLP named w1 (gate), w3 (up), w2 (down); on the Hub |
|             | the block is ``block_sparse_moe``                                                              |
| qwen3_moe   | Qwen3's attention; a sparse block of E experts (gate_proj, up_proj, down_proj), top-k routing  |
|             | (renormalised when ``norm_topk_prob``); layers in ``mlp_only_layers`` keep a dense MLP        |
| qwen2_moe   | Qwen2's attention; Qwen3-MoE's sparse block plus a shared expert (a dense MLP on every token) |
|             | weighted by sigmoid(``shared_expert_gate``)                                                    |

What compound does with each: every family quantizes to every format; ``decode`` marks those ``toolkit.decode`` runs
(and so Medusa heads, selected in that loop), ``eagle`` the EAGLE head kinds (``toolkit.heads.eagle``) that can draft
for it, and ``gguf`` names the llama.cpp architecture of those written as GGUF files (``toolkit.formats.gguf``).
``--rotate hadamard`` (``toolkit.rotate``) rotates the residual stream of every family whose entry ``rotates_residual``
(all but Gemma 2/3, whose norms on the branch outputs do not commute with a rotation) and the values of every attention
head of every family.
A Mixture-of-Experts layout is one more field of an entry (``Experts``: how its experts are named, which modules
route, where the Hub stores the block); ``toolkit.experts`` turns transformers' fused expert tensors into one linear
per expert projection, so every method and format treats an expert's projection as any other linear.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
# the linears that write a dense layer's branches into the residual stream (every family names them so)
O_PROJ, DOWN_PROJ = "self_attn.o_proj", "mlp.down_proj"


@dataclass(frozen=True)
class Experts:
    """The Mixture-of-Experts block of a family (transformers 5 layout: ``mlp.gate`` routes, ``mlp.experts`` holds
    fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]).

    projections: each expert's gate, up and down linears as the Hub names them (``mlp.experts.{e}.<name>``).
    routers: modules of the block that route (relative to the layer); they stay in float and every format lists
    them as not quantized. shared: a dense expert every token goes through (Qwen2-MoE ``mlp.shared_expert``), or
    None. hub_block: the block's name in Hub checkpoints where it differs from transformers' ``mlp`` (Mixtral's
    ``block_sparse_moe``); what compound writes and reads on disk.
    """

    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    routers: tuple[str, ...] = ("mlp.gate",)
    shared: str | None = None
    hub_block: str = "mlp"

    def awq_groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """AWQ's scaling groups of the block, ``*`` standing for every expert index: the gate/up of every expert
        (and of the shared expert) read the post-attention norm, so one scale over all their outputs folds into it;
        each expert's down_proj reads its own up_proj's rows."""
        gate, up, down = (f"mlp.experts.*.{name}" for name in self.projections)
        shared = () if self.shared is None else (f"{self.shared}.gate_proj", f"{self.shared}.up_proj")
        groups = (("post_attention_layernorm", (gate, up, *shared)), (up, (down,)))
        if self.shared is not None:
            groups += ((f"{self.shared}.up_proj", (f"{self.shared}.down_proj",)),)
        return groups


@dataclass(frozen=True)
class Family:
    """What compound must know about one decoder family beyond what tracing reveals.

    layers: dotted path of the decoder-layer ModuleList. qkv / gate_up: the linears, relative to the layer, whose
    outputs are q, k, v and gate, up: three and two modules, or one fused module whose output rows are those parts in
    that order. norm_offset: RMSNorm computes x·(offset + weight) (Gemma: 1), in float32 when nonzero; it matters
    when AWQ folds scales into a norm. embed_scale: embeddings × sqrt(hidden_size) (Gemma). qk_norm: per-head RMSNorm
    of q and k before RoPE (Qwen3, Gemma 3). post_norms: RMSNorm of the attention output (``post_attention_layernorm``)
    and of the MLP output (``post_feedforward_layernorm``) before each residual add, the MLP reading
    ``pre_feedforward_layernorm`` (Gemma 2/3). query_pre_attn_scalar: attention scores scaled by
    ``config.query_pre_attn_scalar``^-0.5 instead of head_dim^-0.5. softcap: ``config.attn_logit_softcapping`` and
    ``config.final_logit_softcapping`` (each where not None) cap scores and logits as ``c · tanh(x / c)``.
    rope_by_layer_type: ``config.rope_parameters`` holds one scheme per layer type, the rotary module one
    ``{layer_type}_inv_freq`` each (Gemma 3). awq_groups: (preceding module, linears sharing its output) per decoder
    layer, the scaling groups of AWQ (arXiv 2306.00978 §3.2), paths relative to the layer. decode: ``toolkit.decode``
    runs it. eagle: the EAGLE head kinds (``toolkit.heads.eagle_config.VARIANTS``) that can draft for it. gguf: the
    llama.cpp architecture (``general.architecture``) that ``compound convert --format gguf`` and ``quantize --gguf``
    write it as (``toolkit.formats.gguf``), None when GGUF export does not write it.
    """

    layers: str = "model.layers"
    qkv: tuple[str, ...] = _QKV
    gate_up: tuple[str, ...] = _GATE_UP
    norm_offset: float = 0.0
    embed_scale: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: bool = False
    softcap: bool = False
    rope_by_layer_type: bool = False
    awq_groups: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", _QKV),
        ("self_attn.v_proj", (O_PROJ,)),
        ("post_attention_layernorm", _GATE_UP),
        ("mlp.up_proj", (DOWN_PROJ,)),
    )
    decode: bool = True
    eagle: tuple[str, ...] = ("eagle", "eagle3")
    gguf: str | None = None
    experts: Experts | None = None

    @property
    def mlp_norm(self) -> str:
        """The norm whose output the MLP reads."""
        return "pre_feedforward_layernorm" if self.post_norms else "post_attention_layernorm"

    @property
    def rotates_residual(self) -> bool:
        """Whether an orthogonal rotation of the residual stream folds into the weights (``toolkit.rotate``): the
        pre-norms' weights fold into the linears reading them, but a norm on a branch's output (``post_norms``)
        scales the stream elementwise after the rotation, which only an online transform could undo."""
        return not self.post_norms


_LLAMA = Family()
# The EAGLE head is a Llama layer over the target's embedding: no embedding scale, RoPE over the whole head. EAGLE-3
# normalizes the embedding it reads (input_layernorm), so Gemma's scale does not reach it: Gemma 3 takes eagle3 heads
# (with the RoPE of its global layers, toolkit.heads.eagle), EAGLE-1's fc would read the unscaled table.
_GEMMA = dataclasses.replace(_LLAMA, norm_offset=1.0, embed_scale=True, eagle=())
_GEMMA2 = dataclasses.replace(
    _GEMMA, post_norms=True, query_pre_attn_scalar=True, softcap=True,
    awq_groups=tuple(("pre_feedforward_layernorm", names) if prev == "post_attention_layernorm" else (prev, names)
                     for prev, names in _GEMMA.awq_groups),
)

FAMILIES: dict[str, Family] = {
    "llama": dataclasses.replace(_LLAMA, gguf="llama"),
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": dataclasses.replace(_LLAMA, qk_norm=True),
    # A fused linear → linear group (v rows of qkv_proj → o_proj, up rows of gate_up_proj → down_proj) would fold
    # into part of the fused rows; those two groups are left out, so o_proj and down_proj are only clipped.
    "phi3": dataclasses.replace(
        _LLAMA, qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",), eagle=(),
        awq_groups=(("input_layernorm", ("self_attn.qkv_proj",)), ("post_attention_layernorm", ("mlp.gate_up_proj",))),
    ),
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": dataclasses.replace(_GEMMA2, qk_norm=True, rope_by_layer_type=True, gguf="gemma3",
                                       eagle=("eagle3",)),
}


def _moe(dense: Family, experts: Experts, dense_layers: bool = False) -> Family:
    """A MoE family: ``dense``'s attention, ``experts`` in place of the MLP; with ``dense_layers`` (Qwen's
    ``mlp_only_layers``) some layers keep ``dense``'s MLP and its scaling groups."""
    attention = tuple(g for g in dense.awq_groups if not (g[0].startswith("mlp.") or g[0] == dense.mlp_norm))
    mlp = tuple(g for g in dense.awq_groups if g not in attention) if dense_layers else ()
    return dataclasses.replace(dense, experts=experts, awq_groups=attention + mlp + experts.awq_groups())


FAMILIES |= {
    "mixtral": _moe(_LLAMA, Experts(projections=("w1", "w3", "w2"), hub_block="block_sparse_moe")),
    "qwen3_moe": _moe(FAMILIES["qwen3"], Experts(), dense_layers=True),
    "qwen2_moe": _moe(_LLAMA, Experts(routers=("mlp.gate", "mlp.shared_expert_gate"), shared="mlp.shared_expert"),
                      dense_layers=True),
}
CAPABILITIES = ("decode", "eagle", "gguf")


class UnsupportedFamily(ValueError):
    """A ``model_type`` missing from ``FAMILIES``, or whose entry lacks the capability asked for."""

    def __init__(self, model_type: str | None, needs: str | None):
        self.supported = supporting(needs)  # what the callers' own messages list
        purpose = f" for {needs}" if needs else ""
        super().__init__(f"model_type {model_type!r} is not supported{purpose}; supported: {', '.join(self.supported)}")


def supporting(needs: str | None = None) -> tuple[str, ...]:
    """The model types, sorted, whose entry has the capability ``needs`` (one of ``CAPABILITIES``); all for None."""
    if needs is not None and needs not in CAPABILITIES:
        raise ValueError(f"unknown capability {needs!r}; one of {', '.join(CAPABILITIES)}")
    return tuple(sorted(name for name, entry in FAMILIES.items() if needs is None or getattr(entry, needs)))


def family(model_type: str | None, needs: str | None = None) -> Family:
    """The entry of ``model_type``; raises ``UnsupportedFamily`` (naming the supported families) when it is missing
    or, with ``needs`` (one of ``CAPABILITIES``), when the family lacks that capability."""
    if model_type not in supporting(needs):
        raise UnsupportedFamily(model_type, needs)
    return FAMILIES[model_type]
