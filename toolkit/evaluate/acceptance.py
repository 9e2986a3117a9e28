"""How well heads draft for their target, measured with compound's decode loop: accepted length, per-depth acceptance,
tokens/s against plain greedy, and losslessness (speculative greedy output identical to plain greedy).

Two proposal shapes for Medusa: ``chain_paths(K)``, each head's top-1 in a chain, which is what vLLM serves
(``method: medusa``), and ``DEFAULT_TREE``, a small static tree (Medusa's sparse trees, cut to 12 nodes because a CPU
target pays for every node it verifies). EAGLE heads draft a chain of k tokens (vLLM's ``eagle``/``eagle3``) or an
EAGLE-2 dynamic tree (SGLang's steps / top-k / draft tokens), ``toolkit.heads.eagle_draft.TreeShape``. Held-out
prompts can be restricted to one slice (``toolkit.evaluate.slices``: prose, code, non-English, structured): acceptance
drops out of distribution.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from toolkit.calibration import conversation_ids
from toolkit.calibration.sources import load_records
from toolkit.calibration.splits import iter_split
from toolkit.decode import Decoder, Drafter, MedusaDrafter, greedy_outputs, speculative_generate
from toolkit.evaluate.slices import SLICES, slice_of
from toolkit.formats.checkpoint import MANIFEST
from toolkit.heads.eagle_draft import EagleDrafter, TreeShape, eagle_decoder

# Top-k ranks per depth, most likely paths first (the shape of Medusa's sparse trees, cut to 12 nodes).
DEFAULT_TREE = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]


def chain_paths(num_heads: int) -> list[tuple[int, ...]]:
    """Each head's top-1 in a chain: [(0,), (0, 0), ...], vLLM's Medusa proposal."""
    return [(0,) * d for d in range(1, num_heads + 1)]


def tree_for(num_heads: int) -> list[tuple[int, ...]]:
    """``DEFAULT_TREE`` without the paths deeper than ``num_heads``."""
    return [p for p in DEFAULT_TREE if len(p) <= num_heads]


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


def heads_callable(heads: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [D] -> logits [K, V] for ``MedusaDrafter``, from a copy of ``heads`` in ``dtype``.

    bfloat16 by default, as vLLM runs heads in the serving dtype: on CPUs with bf16 matrix units a [K, H] x [H, V]
    product costs what one row does in bf16 and about K times that in float32. Proposals only need the top-k.
    """
    drafting = copy.deepcopy(heads).to(dtype).eval()
    return lambda hidden: drafting(hidden.to(dtype))


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


def measure_acceptance(target: nn.Module, heads: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                       paths: list[tuple[int, ...]], mode: str, eos_token_id: int | None = None,
                       greedy: list[torch.Tensor] | None = None, greedy_s: float | None = None,
                       draft_dtype: torch.dtype = torch.bfloat16) -> AcceptanceReport:
    """Medusa ``heads`` drafting ``paths`` for ``target`` (see ``measure_drafter``).

    greedy / greedy_s: plain greedy outputs and their total seconds from an earlier call, to reuse (the target is the
    same); computed when None.
    """
    decoder = Decoder.from_model(target, max(len(p) for p in prompts) + max_new_tokens + len(paths) + 1)
    drafter = MedusaDrafter(heads_callable(heads, draft_dtype), paths)
    greedy, greedy_s = _greedy(target, prompts, max_new_tokens, eos_token_id, greedy, greedy_s)
    shape = f"chain of {len(paths)}" if paths == chain_paths(len(paths)) else f"{len(paths)}-node tree"
    return measure_drafter(decoder, drafter, prompts, max_new_tokens, mode, shape, len(paths), eos_token_id, greedy,
                           greedy_s)


def measure_eagle(target: nn.Module, head: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  shape: TreeShape, mode: str, eos_token_id: int | None = None,
                  greedy: list[torch.Tensor] | None = None, greedy_s: float | None = None,
                  draft_dtype: torch.dtype = torch.bfloat16) -> AcceptanceReport:
    """An attached EAGLE ``head`` drafting in ``shape`` for ``target`` (see ``measure_drafter``), from a copy in
    ``draft_dtype``: bfloat16 by default, as engines draft in the serving dtype (on this CPU it halves the draft's
    time; verification keeps the output the target's whatever the draft computes)."""
    max_len = max(len(p) for p in prompts) + max_new_tokens + shape.nodes + 1
    drafting = copy.deepcopy(head).to(draft_dtype).eval()
    drafter = EagleDrafter(drafting, shape.depth, shape.top_k, shape.total_tokens, max_len=max_len)
    greedy, greedy_s = _greedy(target, prompts, max_new_tokens, eos_token_id, greedy, greedy_s)
    return measure_drafter(eagle_decoder(target, max_len, head), drafter, prompts, max_new_tokens, mode,
                           shape.describe(), shape.nodes, eos_token_id, greedy, greedy_s)


def eagle_shapes(tree: TreeShape, chain: int) -> list[tuple[str, TreeShape]]:
    """The shapes validation measures: ``tree`` (SGLang's dynamic tree), ``chain`` (vLLM's ``chain`` speculative
    tokens), and shorter and longer chains and a wider tree, to recommend the fastest."""
    shapes = [("tree", tree), ("chain", TreeShape(chain))]
    for k in sorted({max(1, chain - 1), chain + 1}):
        shapes.append((f"chain-{k}", TreeShape(k)))
    wide = TreeShape(tree.depth + 1, max(tree.top_k, 2), 2 * tree.nodes)  # a tree even when ``tree`` is a chain
    shapes.append(("tree-wide", wide))
    return shapes


def recommended(reports: Sequence[AcceptanceReport]) -> AcceptanceReport:
    """The lossless report with the most tokens/s."""
    return max((r for r in reports if r.lossless), key=lambda r: r.speculative_tokens_per_s, default=reports[0])


def validate_heads(target_spec: str, heads_dir, prompts: int = 8, max_new_tokens: int = 64, skip: int = 4,
                   dtype: torch.dtype = torch.float32, categories: Sequence[str] = ("all",),
                   tree: TreeShape | None = None, chain: int | None = None,
                   explore: bool = True) -> list[AcceptanceReport]:
    """Heads from ``heads_dir`` (Medusa or EAGLE, told apart by their config) drafting for ``target_spec`` (run in
    ``dtype``) on held-out prompts. Medusa: its static tree and the top-1 chain that vLLM serves. EAGLE: ``tree`` (an
    EAGLE-2 dynamic tree as SGLang drafts) and vLLM's chain of ``chain`` tokens (defaults: ``trained_shape``), and on
    the first category (with ``explore``) neighbouring shapes to recommend the fastest (``recommended``).
    categories: prompt subsets (``CATEGORIES``), each reported separately (mode suffixed with the category); a slice
    the held-out split has no prompt of is left out.

    Lossless means the speculative output equals plain greedy decoding in the same loop and dtype; in bfloat16 a
    near-tie can round differently in a tree forward than in a one-token forward, which float32 makes vanishingly
    rare. skip: held-out prompts left out at the start (``train-heads`` selects checkpoints on the first 4).
    """
    from toolkit.runtime.load import load_model_or_checkpoint

    target, tokenizer = load_model_or_checkpoint(target_spec, dtype)
    eagle = is_eagle_dir(heads_dir)
    if eagle:
        from toolkit.heads.eagle_export import load_eagle

        head = load_eagle(heads_dir).float().attach(target)
        trained_tree, trained_chain = trained_shape(heads_dir)
        tree, chain = tree or trained_tree, chain or trained_chain
    else:
        from toolkit.heads.medusa_export import load_medusa

        heads = load_medusa(heads_dir).float()
        if (heads.config.hidden_size != target.config.hidden_size
                or heads.config.vocab_size != target.config.vocab_size):
            raise ValueError(f"heads of hidden {heads.config.hidden_size} / vocab {heads.config.vocab_size} do not "
                             f"fit {target_spec} (hidden {target.config.hidden_size} / vocab "
                             f"{target.config.vocab_size})")
    reports = []
    for n, category in enumerate(categories):
        chosen = heldout_prompts(tokenizer, prompts, skip=skip, category=category, partial=category != "all")
        if not chosen:
            continue
        greedy, greedy_s = greedy_outputs(target, chosen, max_new_tokens, tokenizer.eos_token_id)
        suffix = "" if category == "all" else f" ({category})"
        if eagle:
            explored = explore and n == 0
            shapes = eagle_shapes(tree, chain) if explored else [("tree", tree), ("chain", TreeShape(chain))]
            reports += [measure_eagle(target, head, chosen, max_new_tokens, shape, mode + suffix,
                                      tokenizer.eos_token_id, greedy, greedy_s) for mode, shape in shapes]
        else:
            K = heads.config.num_heads
            reports += [measure_acceptance(target, heads, chosen, max_new_tokens, paths, mode + suffix,
                                           tokenizer.eos_token_id, greedy, greedy_s)
                        for mode, paths in (("tree", tree_for(K)), ("chain", chain_paths(K)))]
    return reports


def trained_shape(directory) -> tuple[TreeShape, int]:
    """(tree, chain length) an EAGLE head was selected with (its manifest's ``training.draft_shape``), else
    SGLang's Llama default tree (depth 5, top-4, 8 nodes) and vLLM's usual chain of 3."""
    manifest = Path(directory) / MANIFEST
    shape = json.loads(manifest.read_text()).get("training", {}).get("draft_shape") if manifest.is_file() else None
    if not shape:
        return TreeShape(5, 4, 8), 3
    return TreeShape(shape["depth"], shape["top_k"], shape["draft_tokens"]), shape["depth"]


def is_eagle_dir(directory) -> bool:
    """Whether a head directory holds an EAGLE head (its config names an EAGLE architecture)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json in {directory}: not a head directory written by train-heads")
    return "eagle" in json.dumps(json.loads(config.read_text()).get("architectures", [])).lower()
