"""How well heads draft for their target, measured with compound's decode loop: accepted length, per-depth acceptance,
tokens/s against plain greedy, and losslessness (speculative greedy output identical to plain greedy).

Two proposal shapes for Medusa: ``chain_paths(K)``, each head's top-1 in a chain, which is what vLLM serves
(``method: medusa``), and ``DEFAULT_TREE``, a small static tree (Medusa's sparse trees, cut to 12 nodes because a CPU
target pays for every node it verifies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import copy

import torch
from torch import nn

from toolkit.calibration.sources import load_records
from toolkit.calibration.splits import iter_split
from toolkit.decode import Decoder, MedusaDrafter, generate, speculative_generate

# Top-k ranks per depth, most likely paths first (the shape of Medusa's sparse trees, cut to 12 nodes).
DEFAULT_TREE = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]


def chain_paths(num_heads: int) -> list[tuple[int, ...]]:
    """Each head's top-1 in a chain: [(0,), (0, 0), ...], vLLM's Medusa proposal."""
    return [(0,) * d for d in range(1, num_heads + 1)]


def tree_for(num_heads: int) -> list[tuple[int, ...]]:
    """``DEFAULT_TREE`` without the paths deeper than ``num_heads``."""
    return [p for p in DEFAULT_TREE if len(p) <= num_heads]


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int = 256, skip: int = 0,
                    source: str = "sharegpt") -> list[torch.Tensor]:
    """Chat-templated first user turns of ``source``'s eval split (never trained or calibrated on): records
    ``skip`` .. ``skip + n`` of those whose prompt fits ``max_prompt_tokens``."""
    prompts: list[torch.Tensor] = []
    seen = 0
    for record in iter_split(load_records(source), "eval"):
        if not record.is_conversation:
            continue
        turns = [m for m in record.messages if m["role"] == "user"][:1]
        if not turns or not turns[0]["content"].strip():
            continue
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens
        if len(ids) > max_prompt_tokens:
            continue
        seen += 1
        if seen > skip:
            prompts.append(torch.tensor(ids, dtype=torch.long))
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} held-out prompts of at most {max_prompt_tokens} tokens in {source}; "
                         f"asked for {n}")
    return prompts


@dataclass
class AcceptanceReport:
    """Speculative decoding of held-out prompts against plain greedy, for one proposal shape."""

    mode: str
    paths: list[tuple[int, ...]]
    mean_accepted_length: float
    acceptance_rate: list[float]  # per depth d (index d - 1): P(depth d accepted | depth d - 1 accepted)
    lossless: bool
    tokens: int
    speculative_tokens_per_s: float
    greedy_tokens_per_s: float
    per_prompt_accepted_length: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.greedy_tokens_per_s if self.greedy_tokens_per_s else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"speedup": self.speedup}


def heads_callable(heads: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [D] -> logits [K, V] for ``MedusaDrafter``, from a copy of ``heads`` in ``dtype``.

    bfloat16 by default, as vLLM runs heads in the serving dtype: on CPUs with bf16 matrix units a [K, H] x [H, V]
    product costs what one row does in bf16 and about K times that in float32. Proposals only need the top-k.
    """
    drafting = copy.deepcopy(heads).to(dtype).eval()
    return lambda hidden: drafting(hidden.to(dtype))


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


@torch.inference_mode()
def measure_acceptance(target: nn.Module, heads: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                       paths: list[tuple[int, ...]], mode: str, eos_token_id: int | None = None,
                       greedy: list[torch.Tensor] | None = None, greedy_s: float | None = None,
                       draft_dtype: torch.dtype = torch.bfloat16) -> AcceptanceReport:
    """Decode each prompt with Medusa ``heads`` drafting ``paths`` and compare with plain greedy decoding.

    greedy / greedy_s: plain greedy outputs and their total seconds from an earlier call, to reuse (the target is the
    same); computed when None. Accepted length is pooled over all verify steps of all prompts.
    """
    decoder = Decoder.from_model(target, max(len(p) for p in prompts) + max_new_tokens + len(paths) + 1)
    drafter = MedusaDrafter(heads_callable(heads, draft_dtype), paths)
    if greedy is None:
        greedy, greedy_s = greedy_outputs(target, prompts, max_new_tokens, eos_token_id)
    accepted: list[int] = []
    reached: list[int] = []
    hits: list[int] = []
    per_prompt, lossless, tokens, spec_s = [], True, 0, 0.0
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
    greedy_tokens = sum(len(g) - len(p) for g, p in zip(greedy, prompts))
    return AcceptanceReport(
        mode=mode, paths=paths,
        mean_accepted_length=1.0 + sum(accepted) / len(accepted) if accepted else 1.0,
        acceptance_rate=[a / r if r else 0.0 for a, r in zip(hits, reached)],
        lossless=lossless, tokens=tokens,
        speculative_tokens_per_s=tokens / spec_s if spec_s else 0.0,
        greedy_tokens_per_s=greedy_tokens / greedy_s if greedy_s else 0.0,
        per_prompt_accepted_length=per_prompt,
    )



def validate_heads(target_spec: str, heads_dir, prompts: int = 8, max_new_tokens: int = 64, skip: int = 4,
                   dtype: torch.dtype = torch.float32) -> list[AcceptanceReport]:
    """Medusa heads from ``heads_dir`` drafting for ``target_spec`` (run in ``dtype``) on held-out prompts, in the
    static tree and the top-1 chain that vLLM serves (one report each). Lossless means the speculative output equals
    plain greedy decoding in the same loop and dtype; in bfloat16 a near-tie can round differently in a tree forward
    than in a one-token forward, which float32 makes vanishingly rare.

    skip: held-out prompts left out at the start (``train-heads`` selects checkpoints on the first 4).
    """
    from toolkit.heads.export import load_medusa
    from toolkit.heads.pipeline import load_target

    heads = load_medusa(heads_dir).float()
    target, tokenizer = load_target(target_spec, dtype)
    if heads.config.hidden_size != target.config.hidden_size or heads.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"heads of hidden {heads.config.hidden_size} / vocab {heads.config.vocab_size} do not fit "
                         f"{target_spec} (hidden {target.config.hidden_size} / vocab {target.config.vocab_size})")
    chosen = heldout_prompts(tokenizer, prompts, skip=skip)
    greedy, greedy_s = greedy_outputs(target, chosen, max_new_tokens, tokenizer.eos_token_id)
    K = heads.config.num_heads
    return [measure_acceptance(target, heads, chosen, max_new_tokens, paths, mode, tokenizer.eos_token_id,
                               greedy, greedy_s)
            for mode, paths in (("tree", tree_for(K)), ("chain", chain_paths(K)))]
