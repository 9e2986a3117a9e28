"""SignRound (arXiv 2309.05516, AutoRound): rounding offsets and clipping ranges learned by signed gradient descent.

Every group of a weight gets the grid of ``toolkit.quant.primitives`` computed from a clipped range, and every weight
an offset added before rounding:

  scale, zero = qparams_from_range(α·min(group), β·max(group))      α, β ∈ [0.5, 1] per group (the clipping)
  code = clamp(round(W / scale + V) + zero, 0, maxq)                 V ∈ [−0.5, 0.5] per weight (the rounding)

With V = 0 and α = β = 1 the codes are round-to-nearest's, bit for bit. The grid's rule (``ScaleRule``: GGUF's signed
maximum and fp16 scales, or the GPTQ reference grid) is the one every other method uses, so the codes go to every
format as they are. While learning, the rounding passes the gradient straight through (``_round_through``); the final
codes use the true rounding.

``optimize`` is the loop: each iteration takes the loss on one calibration batch, keeps the state if that loss is the
lowest seen so far, then moves V by −lr·sign(∂loss/∂V) and α, β by −minmax_lr times the sign of their gradients, both
rates decaying linearly to 0 over the iterations, and clamps them to their ranges (AutoRound's defaults: 200
iterations, lr = 1/iters, minmax_lr = lr, the best iterate kept). Weights are handled in buckets of equal group width
(every linear of a decoder layer shares one at a fixed group size), so an iteration costs a few tensor operations, not
one per linear.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from toolkit.quant.primitives import GPTQ_RULE, QuantizedWeight, ScaleRule, default_g_idx, max_code, qparams_from_range

OFFSET_BOUND = 0.5  # |V| ≤ ½: an offset can move a weight to the grid point next to its nearest, no further
CLIP_RANGE = (0.5, 1.0)  # α, β: a group's range may shrink to half, never grow


def _round_through(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` whose gradient is the identity (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


@dataclass
class _Bucket:
    """Weights of one group width, their groups stacked: ``groups`` [R, width]; ``rows`` name → (first, last + 1)
    group row, ``shapes`` name → [N, K]."""

    groups: torch.Tensor
    rows: dict[str, tuple[int, int]]
    shapes: dict[str, torch.Size]
    offset: torch.Tensor = field(init=False)
    low: torch.Tensor = field(init=False)
    high: torch.Tensor = field(init=False)

    def __post_init__(self):
        R = self.groups.shape[0]
        self.offset = torch.zeros_like(self.groups, requires_grad=True)
        self.low = torch.ones(R, 1, device=self.groups.device, requires_grad=True)
        self.high = torch.ones(R, 1, device=self.groups.device, requires_grad=True)

    @property
    def learned(self) -> list[torch.Tensor]:
        return [self.offset, self.low, self.high]


class Rounding:
    """The learnable rounding of a set of weights (name → [N, K]) on a ``bits``-wide grid: V per weight, α and β per
    group, bucketed by group width. ``weights()`` gives the fake-quantized weights (differentiable in V, α, β);
    ``quantized()`` the final codes."""

    def __init__(self, weights: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool,
                 rule: ScaleRule = GPTQ_RULE):
        self.bits, self.group_size, self.sym, self.rule = bits, group_size, sym, rule
        by_width: dict[int, dict[str, torch.Tensor]] = {}
        for name, W in weights.items():
            width = W.shape[1] if group_size == -1 else group_size
            by_width.setdefault(width, {})[name] = W
        self.buckets = []
        for width, members in by_width.items():
            rows, start = {}, 0
            for name, W in members.items():
                count = W.numel() // width
                rows[name], start = (start, start + count), start + count
            groups = torch.cat([W.detach().float().reshape(-1, width) for W in members.values()])
            self.buckets.append(_Bucket(groups, rows, {n: W.shape for n, W in members.items()}))

    @property
    def learned(self) -> list[torch.Tensor]:
        """The learnable tensors (V, α, β of every bucket), in a fixed order."""
        return [t for bucket in self.buckets for t in bucket.learned]

    def _grid(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero [R, 1] of the bucket's groups on their clipped ranges (differentiable in α, β)."""
        low, high = bucket.groups.amin(-1, keepdim=True), bucket.groups.amax(-1, keepdim=True)
        return qparams_from_range(low * bucket.low, high * bucket.high, self.bits, self.sym, self.rule)

    def weights(self) -> dict[str, torch.Tensor]:
        """Fake-quantized weights, name → [N, K] float32, differentiable in V, α, β through straight-through
        rounding."""
        out = {}
        for bucket in self.buckets:
            scale, zero = self._grid(bucket)
            codes = torch.clamp(_round_through(bucket.groups / scale + bucket.offset) + zero, 0, max_code(self.bits))
            dequantized = scale * (codes - zero)
            for name, (first, last) in bucket.rows.items():
                out[name] = dequantized[first:last].reshape(bucket.shapes[name])
        return out

    @torch.no_grad()
    def quantized(self, biases: dict[str, torch.Tensor | None] | None = None) -> dict[str, QuantizedWeight]:
        """The codes of the current V, α, β for every weight (``biases``: name → the linear's bias)."""
        biases = biases or {}
        out = {}
        for bucket in self.buckets:
            scale, zero = self._grid(bucket)
            codes = torch.round(bucket.groups / scale + bucket.offset) + zero
            codes = codes.clamp_(0, max_code(self.bits)).to(torch.uint8)
            for name, (first, last) in bucket.rows.items():
                N, K = bucket.shapes[name]
                out[name] = QuantizedWeight(
                    codes[first:last].reshape(N, K), scale[first:last].reshape(N, -1),
                    zero[first:last].reshape(N, -1).to(torch.int32), default_g_idx(K, self.group_size, codes.device),
                    self.bits, self.group_size, self.sym, biases.get(name),
                )
        return out

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float, minmax_lr: float) -> None:
        """One signed-gradient step of V (rate ``lr``) and α, β (rate ``minmax_lr``), clamped to their ranges;
        ``grads`` in the order of ``learned``."""
        for index, bucket in enumerate(self.buckets):
            offset_grad, low_grad, high_grad = grads[3 * index:3 * index + 3]
            bucket.offset.sub_(torch.sign(offset_grad), alpha=lr).clamp_(-OFFSET_BOUND, OFFSET_BOUND)
            bucket.low.sub_(torch.sign(low_grad), alpha=minmax_lr).clamp_(*CLIP_RANGE)
            bucket.high.sub_(torch.sign(high_grad), alpha=minmax_lr).clamp_(*CLIP_RANGE)

    def state(self) -> list[torch.Tensor]:
        """A copy of V, α, β (for ``load``)."""
        return [t.detach().clone() for t in self.learned]

    @torch.no_grad()
    def load(self, state: list[torch.Tensor]) -> None:
        """Set V, α, β to a ``state`` copy."""
        for tensor, saved in zip(self.learned, state):
            tensor.copy_(saved)


@dataclass
class History:
    """What ``optimize`` saw: the loss of every iteration's batch (before its step), and the iteration whose state was
    kept (-1: none ran, the initial state)."""

    losses: list[float] = field(default_factory=list)
    best: int = -1


def optimize(rounding: Rounding, loss: Callable[[int, dict[str, torch.Tensor]], torch.Tensor], batches: int,
             iters: int, lr: float, minmax_lr: float, generator: torch.Generator) -> History:
    """Run ``iters`` signed-gradient iterations of ``rounding`` on ``loss(batch, weights)`` (a scalar differentiable
    in the fake-quantized ``weights``), each on one of ``batches`` batches drawn without replacement until all were
    drawn (then reshuffled, with ``generator``), and leave ``rounding`` at the state of the lowest batch loss."""
    history, best_loss, best_state = History(), float("inf"), None
    order: list[int] = []
    for i in range(iters):
        if not order:
            order = torch.randperm(batches, generator=generator).tolist()
        with torch.enable_grad():
            value = loss(order.pop(), rounding.weights())
            grads = torch.autograd.grad(value, rounding.learned)
        history.losses.append(float(value))
        if history.losses[-1] < best_loss:
            best_loss, best_state, history.best = history.losses[-1], rounding.state(), i
        decay = 1 - i / iters
        rounding.step(grads, lr * decay, minmax_lr * decay)
    if best_state is not None:
        rounding.load(best_state)
    return history
