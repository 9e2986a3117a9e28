"""``--rotate hadamard``: an orthogonal rotation folded into a model's weights before it is quantized.

The model that comes out computes the same function (its float logits equal the original's to float rounding) and is
a standard model of its family, so every engine loads it unchanged: nothing is rotated at run time. Its weights are
what gets quantized, and the rotation spreads each outlier channel over all of them (QuaRot, arXiv 2404.00456). The
math is ``toolkit.quant.rotation``; this module walks a model by its ``toolkit.architectures`` entry.

- **Residual stream** (QuaRot's R1), where the entry ``rotates_residual``: every pre-norm's weight (``offset + w``)
  folds into the linears that read it and the norm becomes the identity scale; then the embedding, every linear
  reading the stream (q/k/v, gate/up, a Mixture-of-Experts block's experts, shared expert and routers) and the LM
  head read ``h Q``, and every linear writing it (o_proj, down_proj, each expert's down projection) writes ``y Q``.
  The final norm folds into the LM head. A tied LM head stays tied when the final norm's scale is one number (a
  scalar commutes with ``Q``); otherwise it is untied, since the embedding must be ``E Q`` and the head
  ``E diag(w) Q``: one more vocab × hidden matrix in the checkpoint.
- **Attention values** (QuaRot's R2), in every family: each head's value rows of v_proj become ``Rᵀ W_v`` and its
  columns of o_proj ``W_o R``; softmax weights mix values linearly, so each head's output is rotated by ``R`` and
  o_proj undoes it. This is the whole rotation for Gemma 2 and 3, whose ``post_attention_layernorm`` and
  ``post_feedforward_layernorm`` scale each branch's output elementwise before it joins the stream: a rotated
  stream would need that scale applied in the rotated basis, an online transform no engine runs.

Weights are folded in float64 and cast back to their dtype once, in place (the experts of a Mixture-of-Experts block
are views of one fused tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.architectures import DOWN_PROJ, O_PROJ, Family
from toolkit.models import arch_spec, decoder_layers
from toolkit.quant import rotation

ROTATED_ROWS = 8192  # embedding rows rotated at a time (a 262k vocabulary in float64 whole would take GBs)


@dataclass(frozen=True)
class RotationReport:
    """What ``rotate_model`` folded: how the residual rotation was built (None: the family keeps its stream as it
    is), the per-head value rotation, and the number of weights the untied LM head added (0: none untied)."""

    residual: str | None
    heads: str
    untied_weights: int

    def summary(self, itemsize: int) -> str:
        """One line for the run's output; ``itemsize``: bytes per saved float weight, for the untying's cost."""
        residual = f"residual {self.residual}" if self.residual else \
            "residual stream not rotated (norms on the branch outputs)"
        untied = (f"; LM head untied (+{self.untied_weights * itemsize / 2**20:.1f} MiB)"
                  if self.untied_weights else "")
        return f"hadamard: {residual}, attention values {self.heads} per head{untied}"


def rotate_model(model: nn.Module, seed: int) -> RotationReport:
    """Fold the rotations the family allows (module docstring) into ``model``'s weights, in place; ``seed`` draws
    the Hadamard matrices' signs. The model must be loaded whole (every layer's weights present)."""
    entry = arch_spec(model)
    layers = decoder_layers(model)
    with torch.no_grad():
        residual, untied = None, 0
        if entry.rotates_residual:
            width = model.config.hidden_size
            q = rotation.hadamard(width, seed)
            untied = _rotate_ends(model, entry, q)
            for index, layer in enumerate(layers):
                _rotate_layer(index, layer, entry, q)
            residual = rotation.describe(width)
        head_dim = layers[0].self_attn.head_dim
        r = rotation.hadamard(head_dim, seed + 1)
        for layer in layers:
            _rotate_values(layer, entry, model.config.num_attention_heads, r)
    return RotationReport(residual, rotation.describe(head_dim), untied)


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


def _norm_scale(norm: nn.Module, entry: Family) -> torch.Tensor:
    """The elementwise scale an RMSNorm applies (``offset + w``), float64."""
    return entry.norm_offset + norm.weight.to(rotation.DTYPE)


def _make_identity(norm: nn.Module, entry: Family) -> None:
    norm.weight.data.fill_(1.0 - entry.norm_offset)


def _rotate_ends(model: nn.Module, entry: Family, q: torch.Tensor) -> int:
    """The final norm folded into the LM head, the head and the embedding rotated; the head untied where it must
    be. Returns the weights the untying added."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = model.get_decoder().norm
    scale = _norm_scale(norm, entry)
    untied = 0
    if head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr():
        if torch.all(scale == scale[0]):  # a scalar commutes with q: the norm stays, the head stays the embedding
            _rotate_rows(embed.weight, q)
            return 0
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
        untied = head.weight.numel()
    _rotate_rows(head.weight, q, scale)
    _make_identity(norm, entry)
    _rotate_rows(embed.weight, q)
    return untied


def _rotate_rows(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Each row of a vocabulary-sized ``weight`` (embedding or LM head) becomes ``row · diag(scale) · q``, a slice
    of rows at a time."""
    for start in range(0, weight.shape[0], ROTATED_ROWS):
        rows = weight.data[start:start + ROTATED_ROWS]
        _set(rows, rotation.fold_reader(rows, scale, q))


def _matching(layer: nn.Module, patterns) -> list[str]:
    """The modules of ``layer`` named by ``patterns`` (``*`` standing for an expert index), in layer order."""
    regex = re.compile("|".join(re.escape(p).replace(r"\*", r"\d+") for p in patterns))
    return [name for name, _ in layer.named_modules() if name and regex.fullmatch(name)]


def _branches(layer: nn.Module, entry: Family) -> list[tuple[str, list[str], list[str]]]:
    """(pre-norm, modules reading it, modules writing the branch into the stream) of ``layer``'s attention and MLP:
    the readers from the entry's AWQ groups (the linears sharing each norm's output), a sparse block's routers with
    them; the writers o_proj and down_proj, or each expert's (and the shared expert's) down projection."""
    experts = entry.experts if hasattr(layer.mlp, "experts") else None
    routers = list(experts.routers) if experts else []
    mlp_writers = [DOWN_PROJ]
    if experts:
        mlp_writers = [f"mlp.experts.*.{experts.projections[2]}"]
        mlp_writers += [f"{experts.shared}.down_proj"] if experts.shared else []
    branches = []
    for norm, writers, extra in (("input_layernorm", [O_PROJ], []), (entry.mlp_norm, mlp_writers, routers)):
        readers = [name for prev, names in entry.awq_groups if prev == norm for name in names]
        branches.append((norm, _matching(layer, readers + extra), _matching(layer, writers)))
    return branches


def _rotate_layer(index: int, layer: nn.Module, entry: Family, q: torch.Tensor) -> None:
    """Fold both pre-norms of ``layer`` into their readers and rotate its readers and writers by ``q``; refuse a
    layer with a linear that is neither (it would silently compute something else)."""
    done = set()
    for norm_name, readers, writers in _branches(layer, entry):
        norm = layer.get_submodule(norm_name)
        scale = _norm_scale(norm, entry)
        for name in readers:
            module = layer.get_submodule(name)
            _set(module.weight, rotation.fold_reader(module.weight, scale, q))
        _make_identity(norm, entry)
        for name in writers:
            module = layer.get_submodule(name)
            _set(module.weight, rotation.fold_writer(module.weight, q))
            if getattr(module, "bias", None) is not None:
                _set(module.bias, rotation.fold_writer(module.bias, q))
        done.update(readers + writers)
    missed = [name for name, m in layer.named_modules() if isinstance(m, nn.Linear) and name not in done]
    if missed:
        raise RuntimeError(f"decoder layer {index}: {', '.join(missed)} neither read(s) a pre-norm nor write(s) "
                           "the residual stream as the architecture table declares; the rotation would change "
                           "the model's output")


def _rotate_values(layer: nn.Module, entry: Family, heads: int, r: torch.Tensor) -> None:
    """Each KV head's value rows (v_proj, or the last rows of a fused q/k/v) become ``Rᵀ W_v`` and each query
    head's columns of o_proj ``W_o R``."""
    d = r.shape[0]
    qkv = layer.get_submodule(entry.qkv[-1])
    first = 0 if len(entry.qkv) == 3 else heads * d + (qkv.out_features - heads * d) // 2
    _set(qkv.weight[first:], rotation.fold_heads_out(qkv.weight[first:], r))
    if qkv.bias is not None:
        _set(qkv.bias[first:], rotation.fold_heads_out(qkv.bias[first:], r))
    o_proj = layer.get_submodule(O_PROJ)
    _set(o_proj.weight, rotation.fold_heads_in(o_proj.weight, r))
