"""Plain decoding, one token per target forward, as in gpt-fast's ``generate.py``: ``prefill`` then
``decode_one_token`` in a loop. Also the statistics every decode run returns (``DecodeStats``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from toolkit.decode.model import DecodeError, Decoder
from toolkit.decode.sampling import SamplingConfig, sample
from toolkit.models import context_length


@dataclass
class DecodeStats:
    """What one run did.

    new_tokens: tokens generated. target_forwards / draft_forwards: forward passes of each model (prefill included).
    accepted: draft tokens accepted at each verify step (empty for plain decoding). reached[d - 1]: verify steps
    that offered a depth-d draft with depth d - 1 accepted; accepted_at_depth[d - 1]: of those, the steps that
    accepted depth d. draft_s / verify_s: seconds proposing / running the target and verifying; total_s: wall time.
    """

    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens produced per verify forward (accepted drafts + the target's own token); 1.0 without drafts."""
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    @property
    def acceptance_rate(self) -> list[float]:
        """Per draft depth d (index d - 1): P(depth d accepted | depth d - 1 accepted and depth d offered)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at_depth, self.reached)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def record_step(self, offered_depth: int, accepted: int) -> None:
        """Count one verify step that offered drafts down to ``offered_depth`` and accepted ``accepted`` of them."""
        self.accepted.append(accepted)
        for d in range(1, offered_depth + 1):
            if d > len(self.reached):
                self.reached.append(0)
                self.accepted_at_depth.append(0)
            if accepted >= d - 1:
                self.reached[d - 1] += 1
                self.accepted_at_depth[d - 1] += int(accepted >= d)

    def summary(self) -> dict:
        """Plain numbers for a report (the per-step list left out)."""
        out = {k: v for k, v in asdict(self).items() if k != "accepted"}
        out.update(verify_steps=len(self.accepted), mean_accepted_length=self.mean_accepted_length,
                   acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
        return out


def prefill(decoder: Decoder, prompt: torch.Tensor, sampling: SamplingConfig | None,
            generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """Run the prompt [P] from slot 0; return (the first new token, hidden states [P, D])."""
    logits, hidden = decoder(prompt, 0)
    return sample(logits[-1], sampling, generator), hidden


def decode_one_token(decoder: Decoder, token: int, pos: int, sampling: SamplingConfig | None,
                     generator: torch.Generator | None) -> int:
    """Run ``token`` at position ``pos``; return the next token."""
    logits, _ = decoder(torch.tensor([token]), pos)
    return sample(logits[-1], sampling, generator)


@torch.inference_mode()
def generate(decoder: Decoder, prompt_ids, max_new_tokens: int, sampling: SamplingConfig | None = None,
             eos_token_id: int | None = None) -> tuple[torch.Tensor, DecodeStats]:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` ([P] or [1, P]); greedy when ``sampling`` is None.

    Returns (prompt and new tokens [P + N], stats); stops after ``eos_token_id`` when given.
    """
    prompt = as_prompt(prompt_ids, max_new_tokens)
    check_capacity(decoder, prompt.shape[0] + max_new_tokens - 1)
    generator = sampling.generator() if sampling is not None else None
    stats = DecodeStats()
    start = time.perf_counter()
    token, _ = prefill(decoder, prompt, sampling, generator)
    out = [token]
    while len(out) < max_new_tokens and token != eos_token_id:
        token = decode_one_token(decoder, token, prompt.shape[0] + len(out) - 1, sampling, generator)
        out.append(token)
    stats.total_s = stats.verify_s = time.perf_counter() - start
    stats.new_tokens, stats.target_forwards = len(out), len(out)
    return torch.cat([prompt, torch.tensor(out, dtype=torch.long)]), stats


def as_prompt(prompt_ids, max_new_tokens: int) -> torch.Tensor:
    """The prompt as a CPU int64 [P] tensor, with the run's arguments checked."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).cpu()
    if prompt.ndim == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.ndim != 1 or prompt.shape[0] == 0:
        raise DecodeError(f"prompt_ids must be a non-empty [P] or [1, P] sequence (batch 1), got {list(prompt.shape)}")
    if max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return prompt


def check_context(config, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a run whose prompt and new tokens together exceed the model's context length: past
    ``max_position_embeddings`` its positions are untrained and the output is garbage (checked before any forward)."""
    limit = context_length(config)
    if limit is None or prompt_tokens + max_new_tokens <= limit:
        return
    remedy = f"lower --max-new-tokens to {limit - prompt_tokens}" if prompt_tokens < limit else "shorten the prompt"
    raise DecodeError(f"the prompt's {prompt_tokens} tokens + --max-new-tokens {max_new_tokens} exceed the model's "
                      f"context length (max_position_embeddings = {limit}); {remedy}")


def check_capacity(decoder: Decoder, needed: int) -> None:
    """Refuse a run that needs more KV-cache slots than ``decoder`` was built with."""
    if needed > decoder.max_len:
        raise DecodeError(f"the run needs {needed} cache slots but the decoder has max_len={decoder.max_len}; "
                          f"rebuild with Decoder.from_model(model, max_len={needed}) or more")


@torch.inference_mode()
def greedy_outputs(target: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                   eos_token_id: int | None = None) -> tuple[list[torch.Tensor], float]:
    """Plain greedy decoding of each prompt with compound's loop: (outputs, total seconds)."""
    decoder = Decoder.from_model(target, max(len(p) for p in prompts) + max_new_tokens)
    outputs, seconds = [], 0.0
    for prompt in prompts:
        out, stats = generate(decoder, prompt, max_new_tokens, eos_token_id=eos_token_id)
        outputs.append(out)
        seconds += stats.total_s
    return outputs, seconds
