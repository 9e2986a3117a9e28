"""The decoder families compound knows, by data: one entry per ``model_type``, read by every layer that walks a model.

Linears inside a decoder layer are found by module type and how they share inputs is traced at run time
(``toolkit.engine.loop``); an entry holds only what tracing cannot reveal. How each family differs from Llama:

| model_type | differs from Llama                                                                          |
|------------|---------------------------------------------------------------------------------------------|
| llama      | (the reference) RMSNorm ``w · x̂``, SiLU-gated MLP, RoPE over the whole head                |
| mistral    | a sliding attention window when ``config.sliding_window`` is set                            |
| qwen2      | q/k/v biases (inside the linears); a window only on ``sliding_attention`` layers            |
| qwen3      | per-head RMSNorm of q and k before RoPE                                                     |
| gemma      | RMSNorm ``(1 + w) · x̂``, embeddings × sqrt(hidden_size), gelu-tanh MLP, explicit head_dim |
| gemma2     | Gemma's, plus norms after attention and after the MLP, gate/up read ``pre_feedforward_layernorm``, |
|            | soft-capped attention and final logits                                                      |

What compound does with each: every family quantizes; ``decode`` marks those ``toolkit.decode`` runs and ``eagle``
those EAGLE heads (``toolkit.heads.eagle``) can draft for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What compound must know about one decoder family beyond what tracing reveals.

    layers: dotted path of the decoder-layer ModuleList. norm_offset: RMSNorm computes x·(offset + weight) (Gemma: 1),
    in float32 when nonzero; it matters when AWQ folds scales into a norm. embed_scale: embeddings × sqrt(hidden_size)
    (Gemma). qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3). awq_groups: (preceding module, linears sharing
    its output) per decoder layer, the scaling groups of AWQ (arXiv 2306.00978 §3.2), paths relative to the layer.
    decode: ``toolkit.decode`` runs it. eagle: EAGLE heads can draft for it.
    """

    layers: str = "model.layers"
    norm_offset: float = 0.0
    embed_scale: bool = False
    qk_norm: bool = False
    awq_groups: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    )
    decode: bool = True
    eagle: bool = True


_LLAMA = Family()
# The EAGLE head is a Llama layer over the target's embedding: no embedding scale, RoPE over the whole head.
_GEMMA = dataclasses.replace(_LLAMA, norm_offset=1.0, embed_scale=True, eagle=False)

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": dataclasses.replace(_LLAMA, qk_norm=True),
    "gemma": _GEMMA,
    # gate/up read pre_feedforward_layernorm; toolkit.decode has neither the extra norms nor the soft-capping
    "gemma2": dataclasses.replace(
        _GEMMA,
        awq_groups=tuple(("pre_feedforward_layernorm", names) if prev == "post_attention_layernorm" else (prev, names)
                         for prev, names in _GEMMA.awq_groups),
        decode=False,
    ),
}
CAPABILITIES = ("decode", "eagle")


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
