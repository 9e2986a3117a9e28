"""Medusa heads (Cai et al., arXiv 2401.10774): K heads over the frozen target's last hidden state.

Head k (0-based) is ``num_layers`` residual blocks ``x ← x + SiLU(W x + b)`` (W zero-initialised, so a new head starts
as the identity) followed by its own output layer ``[vocab, hidden]`` initialised from the target's ``lm_head``. From
the hidden state of position t (the final-norm output, what ``lm_head`` reads; the target itself predicts t + 1) head
k predicts the token at t + 2 + k. Training (``medusa_loss``) is per-head cross-entropy against that token, weighted
``decay ** k`` (Medusa-1's 0.8), on label positions the loss mask marks trainable.

With ``shared_lm_head`` (Medusa-2's layout, vLLM's ``original_lm_head: true``) the heads keep only their blocks and
all read through one frozen copy of the target's ``lm_head``: the K heads' logits are then one [K, H] x [H, V]
product that reads the output matrix once, instead of K matrices of V x H each. For a small target with a large
vocabulary (SmolLM2: V x H is a fifth of the model) that is the difference between drafting for free and drafting at
the cost of the target itself.

Each block is its own module (the original code's ``[ResBlock(H)] * L`` shares one module between layers).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


def check_medusa_shape(num_heads: int, num_layers: int) -> None:
    """Refuse fewer than one head or one residual block per head."""
    if num_heads < 1 or num_layers < 1:
        raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {num_heads}, {num_layers} (flags "
                         f"--num-heads and --num-layers)")


@dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads; ``hidden_size`` and ``vocab_size`` are the target's."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = False

    def __post_init__(self):
        check_medusa_shape(self.num_heads, self.num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), the linear zero-initialised (the block starts as the identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``blocks[k][l]``: head k's residual blocks; ``lm_heads[k]``: its output layer (no bias), or ``lm_heads[0]``
    alone, frozen, for every head when ``shared_lm_head``."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.ModuleList(ResBlock(H) for _ in range(config.num_layers)) for _ in range(config.num_heads))
        outputs = 1 if config.shared_lm_head else config.num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(outputs))
        if config.shared_lm_head:
            self.lm_heads.requires_grad_(False)

    @classmethod
    def from_target(cls, target: nn.Module, num_heads: int = 4, num_layers: int = 1,
                    shared_lm_head: bool = False) -> MedusaHeads:
        """New heads for ``target`` (a causal LM): its sizes, each output layer a copy of its ``lm_head``."""
        lm_head = target.get_output_embeddings().weight
        config = MedusaConfig(lm_head.shape[1], lm_head.shape[0], num_heads, num_layers, shared_lm_head)
        heads = cls(config)
        with torch.no_grad():
            for out in heads.lm_heads:
                out.weight.copy_(lm_head.float())
        return heads

    def head_hidden(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's blocks applied to ``hidden`` [..., H]."""
        for block in self.blocks[k]:
            hidden = block(hidden)
        return hidden

    def output_layer(self, k: int) -> nn.Linear:
        """The layer that turns head k's hidden state into logits."""
        return self.lm_heads[0 if self.config.shared_lm_head else k]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., K, V] of every head for ``hidden`` [..., H]."""
        hidden = hidden.to(self.lm_heads[0].weight.dtype)
        states = [self.head_hidden(hidden, k) for k in range(self.config.num_heads)]
        if self.config.shared_lm_head:  # one product over the stacked heads: the matrix is read once
            return self.lm_heads[0](torch.stack(states, dim=-2))
        return torch.stack([self.lm_heads[k](state) for k, state in enumerate(states)], dim=-2)


def medusa_loss(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                decay: float = 0.8) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Weighted cross-entropy of every head on one padded batch.

    hidden: [B, T, H] target hidden states; input_ids: [B, T]; loss_mask: [B, T] bool, True where the token is a
    trainable label (assistant tokens; False on padding). Returns (sum over heads of ``decay ** k`` × summed token
    loss, the number of label tokens of head 0, metrics): divide by a (global) count for the mean. Metrics per head k:
    ``loss_k`` (summed CE) , ``correct_k`` (top-1 hits) and ``count_k`` (labels). Logits are computed one head at a
    time, so peak memory is one [B, T, V] tensor.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    count0 = 0
    hidden = hidden.to(heads.lm_heads[0].weight.dtype)
    for k in range(heads.config.num_heads):
        shift = k + 2  # position t predicts t + 2 + k
        if input_ids.shape[1] <= shift:
            break
        labels = input_ids[:, shift:]
        mask = loss_mask[:, shift:]
        rows = hidden[:, :-shift][mask]  # (N, H): only positions with a trainable label
        count = int(rows.shape[0])
        if k == 0:
            count0 = count
        if count == 0:
            continue
        logits = heads.output_layer(k)(heads.head_hidden(rows, k)).float()
        target = labels[mask]
        loss = F.cross_entropy(logits, target, reduction="sum")
        total = total + decay**k * loss
        metrics[f"loss_{k}"] = float(loss.detach())
        metrics[f"correct_{k}"] = float((logits.detach().argmax(-1) == target).sum())
        metrics[f"count_{k}"] = float(count)
    return total, count0, metrics
