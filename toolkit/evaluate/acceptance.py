"""How well heads draft for their target, measured with compound's decode loop: accepted length, per-depth acceptance,
tokens/s against plain greedy, and losslessness (speculative greedy output identical to plain greedy).

Every head kind is measured the same way (``measure_head``), through what its registration declares
(``toolkit.heads.kinds``): the draft shapes (Medusa: a static tree or vLLM's chain, ``toolkit.heads.kinds.medusa``;
EAGLE: a chain of k tokens, vLLM's, or an EAGLE-2 dynamic tree, SGLang's, ``toolkit.heads.eagle_draft.TreeShape``)
and the decoder and drafter of compound's loop. Held-out prompts can be restricted to one slice
(``toolkit.evaluate.slices``: prose, code, non-English, structured): acceptance drops out of distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from toolkit.calibration import conversation_ids
from toolkit.calibration.sources import load_records
from toolkit.calibration.splits import iter_split
from toolkit.decode import Decoder, Drafter, greedy_outputs, speculative_generate
from toolkit.evaluate.slices import SLICES, slice_of
from toolkit.heads.eagle_draft import TreeShape
from toolkit.heads.kinds import KINDS, HeadKind
from toolkit.heads.kinds.medusa import MEDUSA
from toolkit.heads.load import load_head
from toolkit.models import ModelSource, resolve_model

CATEGORIES = ("all", *SLICES)


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int = 256, skip: int = 0,
                    source: str = "sharegpt", category: str = "all", partial: bool = False) -> list[torch.Tensor]:
    """Chat-templated first user turns of ``source``'s eval split (never trained or calibrated on) whose prompt fits
    ``max_prompt_tokens``: the first ``n`` after the first ``skip`` of them that are, unless ``category`` is "all", of
    that slice (``toolkit.evaluate.slices.slice_of`` of the turn; the skipped prompts are never returned, whatever
    the category). partial: return the ones there are when the split has fewer than ``n`` (maybe none), instead of
    raising (the eval split holds only a few non-English prompts)."""
    if category not in CATEGORIES:
        raise ValueError(f"prompt category must be one of {', '.join(CATEGORIES)}, got {category!r}")
    prompts: list[torch.Tensor] = []
    seen = 0
    for record in iter_split(load_records(source), "eval"):
        if not record.is_conversation:
            continue
        turns = [m for m in record.messages if m["role"] == "user"][:1]
        if not turns or not turns[0]["content"].strip():
            continue
        ids = conversation_ids(tokenizer, turns)
        if len(ids) > max_prompt_tokens:
            continue
        seen += 1
        if seen > skip and (category == "all" or slice_of(turns[0]["content"]) == category):
            prompts.append(torch.tensor(ids, dtype=torch.long))
        if len(prompts) == n:
            break
    if len(prompts) < n and not partial:
        raise ValueError(f"only {len(prompts)} held-out {category} prompts of at most {max_prompt_tokens} tokens in "
                         f"{source}; asked for {n}")
    return prompts


@dataclass
class AcceptanceReport:
    """Speculative decoding of held-out prompts against plain greedy, for one proposal shape (``nodes`` draft tokens
    verified per step)."""

    mode: str
    shape: str
    nodes: int
    mean_accepted_length: float
    acceptance_rate: list[float]  # per depth d (index d - 1): P(depth d accepted | depth d - 1 accepted)
    lossless: bool
    tokens: int
    speculative_tokens_per_s: float
    greedy_tokens_per_s: float
    per_prompt_accepted_length: list[float] = field(default_factory=list)
    draft_ms_per_step: float = 0.0  # proposing, per verify step
    verify_ms_per_step: float = 0.0  # the target's tree forward and the walk down it, per verify step

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.greedy_tokens_per_s if self.greedy_tokens_per_s else 0.0

    @property
    def break_even_accepted_length(self) -> float:
        """The accepted length at which this shape's step (draft + verify) pays for itself against plain greedy's
        one-token step: speedup ≈ accepted length / this."""
        step_ms = self.draft_ms_per_step + self.verify_ms_per_step
        return step_ms * self.greedy_tokens_per_s / 1000 if self.greedy_tokens_per_s else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"speedup": self.speedup, "break_even_accepted_length": self.break_even_accepted_length}


@torch.inference_mode()
def measure_drafter(decoder: Decoder, drafter: Drafter, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                    mode: str, shape: str, nodes: int, eos_token_id: int | None, greedy: list[torch.Tensor],
                    greedy_s: float) -> AcceptanceReport:
    """Decode each prompt with ``drafter`` and compare with plain greedy decoding (``greedy``, taking ``greedy_s``
    seconds). ``decoder`` must hold the longest prompt, the new tokens and one more proposal. Accepted length is
    pooled over all verify steps of all prompts."""
    accepted: list[int] = []
    reached: list[int] = []
    hits: list[int] = []
    per_prompt, lossless, tokens, spec_s, draft_s, verify_s = [], True, 0, 0.0, 0.0, 0.0
    for prompt, reference in zip(prompts, greedy):
        out, stats = speculative_generate(decoder, drafter, prompt, max_new_tokens, eos_token_id=eos_token_id)
        lossless &= torch.equal(out, reference)
        accepted += stats.accepted
        for d, (r, a) in enumerate(zip(stats.reached, stats.accepted_at_depth)):
            if d == len(reached):
                reached.append(0)
                hits.append(0)
            reached[d] += r
            hits[d] += a
        per_prompt.append(stats.mean_accepted_length)
        tokens += stats.new_tokens
        spec_s += stats.total_s
        draft_s += stats.draft_s
        verify_s += stats.verify_s
    greedy_tokens = sum(len(g) - len(p) for g, p in zip(greedy, prompts))
    return AcceptanceReport(
        mode=mode, shape=shape, nodes=nodes,
        mean_accepted_length=1.0 + sum(accepted) / len(accepted) if accepted else 1.0,
        acceptance_rate=[a / r if r else 0.0 for a, r in zip(hits, reached)],
        lossless=lossless, tokens=tokens,
        speculative_tokens_per_s=tokens / spec_s if spec_s else 0.0,
        greedy_tokens_per_s=greedy_tokens / greedy_s if greedy_s else 0.0,
        per_prompt_accepted_length=per_prompt,
        draft_ms_per_step=1000 * draft_s / len(accepted) if accepted else 0.0,
        verify_ms_per_step=1000 * verify_s / len(accepted) if accepted else 0.0,
    )


def _greedy(target, prompts, max_new_tokens, eos_token_id, greedy, greedy_s):
    if greedy is None:
        return greedy_outputs(target, prompts, max_new_tokens, eos_token_id)
    return greedy, greedy_s


def measure_head(kind: HeadKind, target: nn.Module, head: nn.Module, prompts: Sequence[torch.Tensor],
                 max_new_tokens: int, shape, mode: str, eos_token_id: int | None = None,
                 greedy: list[torch.Tensor] | None = None, greedy_s: float | None = None,
                 draft_dtype: torch.dtype = torch.bfloat16) -> AcceptanceReport:
    """A ``head`` of ``kind`` (attached, for EAGLE) drafting ``shape`` for ``target`` (see ``measure_drafter``), from
    a copy in ``draft_dtype``: bfloat16 by default, as engines draft in the serving dtype (verification keeps the
    output the target's whatever the draft computes).

    greedy / greedy_s: plain greedy outputs and their total seconds from an earlier call, to reuse (the target is the
    same); computed when None.
    """
    description, nodes = kind.shape_label(shape)
    max_len = max(len(p) for p in prompts) + max_new_tokens + nodes + 1
    decoder, drafter = kind.drafting(head, target, shape, max_len, draft_dtype)
    greedy, greedy_s = _greedy(target, prompts, max_new_tokens, eos_token_id, greedy, greedy_s)
    return measure_drafter(decoder, drafter, prompts, max_new_tokens, mode, description, nodes, eos_token_id, greedy,
                           greedy_s)


def measure_acceptance(target: nn.Module, heads: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                       paths: list[tuple[int, ...]], mode: str, eos_token_id: int | None = None,
                       greedy: list[torch.Tensor] | None = None, greedy_s: float | None = None,
                       draft_dtype: torch.dtype = torch.bfloat16) -> AcceptanceReport:
    """Medusa ``heads`` drafting ``paths`` for ``target`` (``measure_head``)."""
    return measure_head(MEDUSA, target, heads, prompts, max_new_tokens, paths, mode, eos_token_id, greedy, greedy_s,
                        draft_dtype)


def measure_eagle(target: nn.Module, head: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  shape: TreeShape, mode: str, eos_token_id: int | None = None,
                  greedy: list[torch.Tensor] | None = None, greedy_s: float | None = None,
                  draft_dtype: torch.dtype = torch.bfloat16) -> AcceptanceReport:
    """An attached EAGLE ``head`` drafting in ``shape`` for ``target`` (``measure_head``, its kind its config's)."""
    return measure_head(KINDS[head.config.kind], target, head, prompts, max_new_tokens, shape, mode, eos_token_id,
                        greedy, greedy_s, draft_dtype)


def recommended(reports: Sequence[AcceptanceReport]) -> AcceptanceReport:
    """The lossless report with the most tokens/s."""
    return max((r for r in reports if r.lossless), key=lambda r: r.speculative_tokens_per_s, default=reports[0])


def validate_heads(target_model: str | ModelSource, heads_dir, prompts: int = 8, max_new_tokens: int = 64,
                   skip: int = 4, dtype: torch.dtype = torch.float32, categories: Sequence[str] = ("all",),
                   tree: TreeShape | None = None, chain: int | None = None,
                   explore: bool = True) -> list[AcceptanceReport]:
    """Heads from ``heads_dir`` (of any kind: ``toolkit.heads.load.load_head``) drafting for ``target_model`` (a
    spec, resolved once here, or its ``ModelSource``; run in ``dtype``) on held-out prompts, in the shapes their kind
    validates (``HeadKind.validation_shapes``). Medusa: its static tree and the top-1 chain that vLLM serves. EAGLE:
    ``tree`` (an EAGLE-2 dynamic tree as SGLang drafts) and vLLM's chain of ``chain`` tokens (defaults:
    ``toolkit.heads.kinds.eagle.trained_shape``), and on the first category (with ``explore``) neighbouring shapes to
    recommend the fastest (``recommended``).
    categories: prompt subsets (``CATEGORIES``), each reported separately (mode suffixed with the category); a slice
    the held-out split has no prompt of is left out.

    Lossless means the speculative output equals plain greedy decoding in the same loop and dtype; in bfloat16 a
    near-tie can round differently in a tree forward than in a one-token forward, which float32 makes vanishingly
    rare. skip: held-out prompts left out at the start (``train-heads`` selects checkpoints on the first 4).
    """
    from toolkit.runtime.load import load_model_or_checkpoint

    source = resolve_model(target_model)
    target, tokenizer = load_model_or_checkpoint(source, dtype)
    loaded = load_head(heads_dir)
    kind = loaded.kind
    head = kind.fit(loaded.module, target, source.spec)
    reports = []
    for n, category in enumerate(categories):
        chosen = heldout_prompts(tokenizer, prompts, skip=skip, category=category, partial=category != "all")
        if not chosen:
            continue
        greedy, greedy_s = greedy_outputs(target, chosen, max_new_tokens, tokenizer.eos_token_id)
        suffix = "" if category == "all" else f" ({category})"
        shapes = kind.validation_shapes(head, heads_dir, tree, chain, explore and n == 0)
        reports += [measure_head(kind, target, head, chosen, max_new_tokens, shape, mode + suffix,
                                 tokenizer.eos_token_id, greedy, greedy_s) for mode, shape in shapes]
    return reports
