"""Mixture-of-Experts blocks with one ``nn.Linear`` per expert projection.

transformers 5 holds a block's experts as two fused 3-D parameters (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) and converts from and to the Hub's per-expert tensors on load and save. compound quantizes each expert's
projection as a linear of its own, so ``unfuse_experts`` replaces the fused module by ``ExpertLinears``: a list of
``ExpertMLP`` (gate, up and down as ``nn.Linear``, named as the family's Hub checkpoints name them), over views of the
same storage (no copy). Module paths then equal the Hub's tensor names (``mlp.experts.3.gate_proj``), except where the
Hub names the block differently (Mixtral's ``block_sparse_moe``): ``hub_name`` and ``model_name`` map between the two.

Routing is the model's own (its router module picks each token's experts and weights); ``ExpertLinears`` runs each
expert on its routed tokens, in transformers' order of experts and slots, so outputs match the fused module's. For
calibration, ``every_token`` makes every expert also read every other token (its statistics then cover all tokens,
what llm-compressor calls calibrating all experts) while the block's output keeps the true routing.

A block's output is Σₑ wₑ(t)·expertₑ(x_t) over the experts routed token t, so an error in expert e's output on token
t weighs wₑ(t)² in the layer's output error. ``weighing_rows`` makes each expert record the routing weight of every
row it reads (``ExpertMLP.row_weights``), for statistics weighted the same way: a routed row gets the weight the block
gives it; under ``every_token`` a row not routed to e gets the weight it would have had, pₑ(t)·Σ w(t) / Σ_routed p(t)
with p the router's softmax (for a routed row this is its own weight).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from toolkit.architectures import Experts, family


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) · up(x))``, its linears registered under the family's projection names."""

    row_weights: torch.Tensor | None = None  # while weighing: the routing weight [rows] of each row it reads

    def __init__(self, projections: tuple[str, str, str], gate: nn.Linear, up: nn.Linear, down: nn.Linear, act):
        super().__init__()
        self.names = projections
        for name, linear in zip(projections, (gate, up, down)):
            self.add_module(name, linear)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(self.act(gate(x)) * up(x))


class ExpertLinears(nn.ModuleList):
    """A block's experts as ``ExpertMLP`` modules, called like transformers' fused experts module:
    ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) → [T, H]``.

    every_token: each expert runs on all T tokens (each through a view of its own, so that tracing sees one input per
    expert), and its output is kept only on the tokens routed to it. router_probs: while ``weighing_rows`` is active,
    the router's softmax [T, E] for the next call (set by a hook on the router, used up by that call), from which
    every expert's ``row_weights`` are set before it runs."""

    every_token: bool = False
    weighing: bool = False
    router_probs: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        probs, self.router_probs = self.router_probs, None  # the router's, for this call only
        for e, expert in enumerate(self):
            slot, token = torch.where((top_k_index == e).T)  # slot-major, as transformers orders them
            if self.every_token:
                if self.weighing:
                    expert.row_weights = self._weights_of_every_token(e, probs, top_k_index, top_k_weights)
                y = expert(hidden_states.view_as(hidden_states))[token]
            elif token.numel():
                if self.weighing:
                    expert.row_weights = top_k_weights[token, slot].float()
                y = expert(hidden_states[token])
            else:
                continue
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    @staticmethod
    def _weights_of_every_token(e: int, probs: torch.Tensor | None, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor | None:
        """The weight expert ``e``'s output would get on each token: pₑ(t) scaled as the routed weights are; None
        when no router ran before this call (a caller running the experts directly, as AWQ's scale search does)."""
        if probs is None:
            return None
        scale = top_k_weights.float().sum(-1) / probs.gather(1, top_k_index).sum(-1)
        return probs[:, e] * scale


def moe_layout(model: nn.Module) -> Experts | None:
    """The ``Experts`` entry of ``model``'s family, None for a dense family."""
    return family(model.config.model_type).experts


def unfuse_experts(model: nn.Module) -> nn.Module:
    """Replace every fused experts module of a MoE model by ``ExpertLinears`` over views of its parameters (meta
    parameters stay meta); a dense model, or one already unfused, is returned as it is."""
    layout = moe_layout(model)
    if layout is None:
        return model
    for block in model.modules():
        fused = getattr(block, "experts", None)
        if isinstance(fused, nn.Module) and hasattr(fused, "gate_up_proj"):
            block.experts = _unfused(fused, layout.projections)
    return model


def _unfused(fused: nn.Module, projections: tuple[str, str, str]) -> ExpertLinears:
    gate_up, down = fused.gate_up_proj, fused.down_proj  # [E, 2I, H], [E, H, I]
    inter = gate_up.shape[1] // 2
    experts = []
    for e in range(gate_up.shape[0]):
        gate, up = _linear(gate_up[e, :inter]), _linear(gate_up[e, inter:])
        experts.append(ExpertMLP(projections, gate, up, _linear(down[e]), fused.act_fn))
    return ExpertLinears(experts)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight is ``weight`` itself (a view: no copy)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


@contextlib.contextmanager
def every_token(module: nn.Module, on: bool = True) -> Iterator[None]:
    """While active, every ``ExpertLinears`` inside ``module`` runs each expert on every token (see the class)."""
    blocks = [m for m in module.modules() if isinstance(m, ExpertLinears)]
    before = [b.every_token for b in blocks]
    for b in blocks:
        b.every_token = on
    try:
        yield
    finally:
        for b, state in zip(blocks, before):
            b.every_token = state


@contextlib.contextmanager
def weighing_rows(layer: nn.Module, layout: Experts | None) -> Iterator[None]:
    """While active, every expert of decoder layer ``layer`` records the routing weight of each row it reads
    (``ExpertMLP.row_weights``; see the module's docstring); nothing for a dense layer."""
    blocks = [m for m in layer.modules() if isinstance(m, ExpertLinears)]
    if layout is None or not blocks:
        yield
        return
    (block,) = blocks  # one Mixture-of-Experts block per decoder layer

    def keep_probs(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        block.router_probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)

    hook = layer.get_submodule(layout.routers[0]).register_forward_hook(keep_probs)
    block.weighing = True
    try:
        yield
    finally:
        hook.remove()
        block.weighing, block.router_probs = False, None
        for expert in block:
            expert.row_weights = None


def expert_index(name: str) -> int | None:
    """The expert a linear belongs to (``mlp.experts.3.w1`` → 3), None for other linears."""
    match = re.search(r"(?:^|\.)experts\.(\d+)\.", name)
    return None if match is None else int(match.group(1))


def hub_name(layout: Experts | None, name: str) -> str:
    """A tensor's name on disk from its name in the model (``…layers.0.mlp.…`` → ``…layers.0.block_sparse_moe.…``
    for Mixtral); unchanged for dense families and blocks the Hub names ``mlp``."""
    if layout is None or layout.hub_block == "mlp":
        return name
    return re.sub(r"(^|\.)mlp\.", rf"\1{layout.hub_block}.", name, count=1)


def model_name(layout: Experts | None, name: str) -> str:
    """The inverse of ``hub_name``."""
    if layout is None or layout.hub_block == "mlp":
        return name
    return re.sub(rf"(^|\.){re.escape(layout.hub_block)}\.", r"\1mlp.", name, count=1)


def hub_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (full names in ``model``) under the names its family's Hub checkpoints use (``hub_name``)."""
    layout = moe_layout(model)
    return {hub_name(layout, name): t for name, t in tensors.items()}
