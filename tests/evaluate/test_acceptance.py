"""Acceptance measurement: lossless against plain greedy, and exact on an oracle that knows the greedy future."""

import dataclasses

import pytest
import torch
from conftest import tiny_model
from torch import nn

from toolkit.decode import greedy_outputs
from toolkit.evaluate import acceptance
from toolkit.heads.hidden_states import target_hidden_states
from toolkit.heads.kinds.medusa import DEFAULT_TREE, chain_paths, tree_for
from toolkit.heads.medusa import MedusaHeads

NEW = 24


@pytest.fixture(scope="module")
def target(one_thread):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 49152, (n,), generator=g) for n in (5, 9)]


class Oracle(nn.Module):
    """Heads that look up where a hidden state sits in the greedy output and return the tokens 2 + k ahead."""

    def __init__(self, target, outputs, num_heads):
        super().__init__()
        self.rows = [(target_hidden_states(target, out[None])[0], out) for out in outputs]
        self.num_heads = num_heads

    def forward(self, hidden):
        logits = torch.zeros(self.num_heads, 49152)
        for states, sequence in self.rows:
            distance = (states - hidden).norm(dim=-1)
            i = int(distance.argmin())
            if distance[i] < 1e-3:
                for k in range(self.num_heads):
                    if i + 2 + k < len(sequence):
                        logits[k, sequence[i + 2 + k]] = 1.0
                return logits
        raise AssertionError("hidden state not found in the greedy outputs")


def test_random_heads_are_lossless_in_both_modes(target, prompts):
    heads = MedusaHeads.from_target(target, num_heads=3)
    with torch.no_grad():
        for head in heads.blocks:
            head[0].linear.weight.normal_(0, 0.5)
    greedy, seconds = greedy_outputs(target, prompts, NEW)
    for mode, paths in (("tree", tree_for(3)), ("chain", chain_paths(3))):
        report = acceptance.measure_acceptance(target, heads, prompts, NEW, paths, mode, None, greedy, seconds)
        assert report.lossless and report.tokens == 2 * NEW
        # random heads over a 49,152-token vocabulary guess none of the target's tokens: each step keeps only the
        # target's own token (a count that took the bonus token for an accepted draft would say 2)
        assert report.mean_accepted_length == 1.0 and report.acceptance_rate == [0.0, 0.0, 0.0]
        assert report.per_prompt_accepted_length == [1.0, 1.0]
        assert report.greedy_tokens_per_s > 0 and report.speculative_tokens_per_s > 0
        assert report.draft_ms_per_step > 0 and report.verify_ms_per_step > 0
        step_s = (report.draft_ms_per_step + report.verify_ms_per_step) / 1000
        assert step_s < report.tokens / report.speculative_tokens_per_s  # a step is a part of the whole run


def test_break_even_is_the_step_cost_in_greedy_tokens():
    """A 2 ms draft and an 8 ms verification against greedy's 50 tokens/s (20 ms a token): a step costs half a
    greedy token, so it pays for itself from an accepted length of 0.5; at 100 tokens/s, 1.0; no greedy rate, 0."""
    report = acceptance.AcceptanceReport(mode="chain", shape="chain", nodes=3, mean_accepted_length=1.0,
                                         acceptance_rate=[], lossless=True, tokens=10, speculative_tokens_per_s=40.0,
                                         greedy_tokens_per_s=50.0, draft_ms_per_step=2.0, verify_ms_per_step=8.0)
    assert report.break_even_accepted_length == pytest.approx(0.5)
    assert report.speedup == pytest.approx(0.8)
    faster_greedy = dataclasses.replace(report, greedy_tokens_per_s=100.0)
    assert faster_greedy.break_even_accepted_length == pytest.approx(1.0)
    assert dataclasses.replace(report, greedy_tokens_per_s=0.0).break_even_accepted_length == 0.0


def test_oracle_heads_are_always_accepted(target, prompts):
    greedy, seconds = greedy_outputs(target, prompts, NEW)
    oracle = Oracle(target, greedy, num_heads=3)
    report = acceptance.measure_acceptance(target, oracle, prompts, NEW, chain_paths(3), "chain", None,
                                           greedy, seconds, draft_dtype=torch.float32)
    assert report.lossless
    assert report.acceptance_rate == [1.0, 1.0, 1.0]
    # 24 tokens: the prefill's token, then steps of 4 until fewer than 4 are left (the last step is cut by max_len).
    assert report.mean_accepted_length == pytest.approx(4.0, abs=0.5)


def test_tree_shapes():
    assert chain_paths(3) == [(0,), (0, 0), (0, 0, 0)]
    assert all(len(p) <= 2 for p in tree_for(2)) and (1,) in tree_for(2)
    assert tree_for(4) == DEFAULT_TREE


def test_heldout_prompts_come_from_the_eval_split(smol_tokenizer):
    from toolkit.calibration.sources import load_records
    from toolkit.calibration.splits import split_of

    prompts = acceptance.heldout_prompts(smol_tokenizer, 3, max_prompt_tokens=128)
    later = acceptance.heldout_prompts(smol_tokenizer, 2, max_prompt_tokens=128, skip=1)
    assert torch.equal(later[0], prompts[1]) and all(len(p) <= 128 for p in prompts)
    text = smol_tokenizer.decode(prompts[0])
    assert text.rstrip().endswith("assistant")
    first_eval = next(r for r in load_records("sharegpt") if split_of(r.id) == "eval" and r.is_conversation)
    assert first_eval.messages[0]["content"].strip()[:20] in text or len(prompts) == 3
