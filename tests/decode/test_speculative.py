"""Speculative decoding is lossless: greedy output equals plain greedy for every drafter; sampling keeps the target's
distribution (chi-square against the exact softmax), and a wrong accept rule is caught by the same test."""

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

from toolkit.decode import (
    Decoder,
    MedusaDrafter,
    ModelDrafter,
    Proposal,
    SamplingConfig,
    eagle2_tree,
    generate,
    speculative,
    speculative_generate,
)
from toolkit.decode.sampling import probs

VOCAB = 512
PROMPT = torch.tensor([3, 17, 101, 9, 250, 44, 7, 300])


pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(seed, vocab=VOCAB, logit_scale=40.0, layers=2):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab=vocab, layers=layers)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="module")
def target():
    return random_model(0)


def target_logits(model, sequences):
    """The target's next-token logits [len(sequences), vocab] after each (equal-length) sequence, without a cache."""
    with torch.no_grad():
        return model(torch.stack(sequences)).logits[:, -1].float()


class RandomDrafter:
    """Uniformly random chains: almost never accepted."""

    def __init__(self, k, vocab, seed=0):
        self.k, self.vocab, self.g = k, vocab, torch.Generator().manual_seed(seed)

    def propose(self, ctx):
        return Proposal.chain(torch.randint(0, self.vocab, (self.k,), generator=self.g), draft_forwards=0)


class OracleMedusa(MedusaDrafter):
    """Heads that know the target: head d's logits are the target's d tokens ahead along its greedy continuation."""

    def __init__(self, model, paths):
        super().__init__(heads=None, paths=paths)
        self.model = model

    def head_logits(self, ctx):
        assert ctx.hidden.shape[0] == ctx.tokens.shape[0] - 1  # one hidden state per cached token
        if ctx.sampling is None:  # hidden[-1] is what lm_head read to predict the root
            assert int(self.model.lm_head(ctx.hidden[-1]).argmax()) == int(ctx.tokens[-1])
        sequence, rows = ctx.tokens, []
        for _ in range(self.n_heads):
            rows.append(target_logits(self.model, [sequence])[0])
            sequence = torch.cat([sequence, rows[-1].argmax().view(1)])
        return torch.stack(rows)


class OracleEagle:
    """An EAGLE-2 dynamic tree whose draft distribution is the target's own, by calling the target on each path."""

    def __init__(self, model, depth=4, top_k=3, total_tokens=12):
        self.model, self.depth, self.top_k, self.total_tokens = model, depth, top_k, total_tokens

    def propose(self, ctx):
        def expand(tokens, parents, frontier):
            def path(node):
                out = []
                while node >= 0:
                    out.append(int(tokens[node]))
                    node = int(parents[node])
                return torch.tensor(out[::-1], dtype=torch.long)

            logits = target_logits(self.model, [torch.cat([ctx.tokens, path(int(f))]) for f in frontier])
            return torch.log_softmax(logits, dim=-1)

        tokens, parents, calls = eagle2_tree(expand, self.depth, self.top_k, self.total_tokens)
        return Proposal(tokens, parents, None, draft_forwards=calls)


MEDUSA_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def drafters(target):
    return {
        "self": (ModelDrafter(Decoder.from_model(target, max_len=96), k=4), 5.0),
        "random": (RandomDrafter(4, VOCAB), None),
        "small_model": (ModelDrafter(Decoder.from_model(random_model(1, layers=1), max_len=96), k=3), None),
        "medusa_oracle": (OracleMedusa(target, MEDUSA_PATHS), 5.0),
        "eagle_oracle": (OracleEagle(target), None),
    }


@pytest.mark.parametrize("name", ["self", "random", "small_model", "medusa_oracle", "eagle_oracle"])
def test_greedy_speculative_equals_greedy(target, name):
    decoder = Decoder.from_model(target, max_len=96)
    plain, plain_stats = generate(decoder, PROMPT, 40)
    drafter, exact_tau = drafters(target)[name]
    ids, stats = speculative_generate(decoder, drafter, PROMPT, 40)
    assert torch.equal(ids, plain), name
    assert stats.new_tokens == 40 and plain_stats.new_tokens == 40
    assert stats.target_forwards == 1 + len(stats.accepted)
    assert stats.draft_s > 0 and stats.verify_s > 0 and stats.tokens_per_s > 0
    if exact_tau is not None:  # every draft accepted: τ = drafts per step + 1
        assert stats.mean_accepted_length == exact_tau
        assert stats.acceptance_rate == [1.0] * 4
    if name == "random":
        assert stats.mean_accepted_length < 1.2
    if name == "eagle_oracle":  # the greedy path usually survives reranking
        assert stats.mean_accepted_length > 3.0
        assert stats.draft_forwards == 4 * len(stats.accepted)


def test_speculative_sampling_runs_every_drafter(target):
    decoder = Decoder.from_model(target, max_len=96)
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)
    for name, (drafter, _) in drafters(target).items():
        ids, stats = speculative_generate(decoder, drafter, PROMPT, 20, sampling)
        again, _ = speculative_generate(decoder, drafter, PROMPT, 20, sampling)
        assert ids.shape == (len(PROMPT) + 20,) and torch.equal(ids, again), name  # seeded: reproducible


def test_eos_stops_the_run(target):
    decoder = Decoder.from_model(target, max_len=96)
    plain, _ = generate(decoder, PROMPT, 40)
    eos = int(plain[len(PROMPT) + 5])
    stop = plain.tolist().index(eos, len(PROMPT)) + 1
    ids, _ = speculative_generate(decoder, ModelDrafter(Decoder.from_model(target, 96), k=4), PROMPT, 40,
                                  eos_token_id=eos)
    assert ids.tolist() == plain[:stop].tolist()


# --- sampling keeps the target's distribution -----------------------------------------------------------------------

SMALL_VOCAB = 8
DRAWS = 1500


def chi_square_p_value(counts, expected):
    """Pearson's test, cells with expected count < 5 pooled; p-value from the regularized upper gamma function."""
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    want = torch.cat([expected[~small], expected[small].sum().view(1)])
    if want[-1] == 0:
        observed, want = observed[:-1], want[:-1]
    statistic = ((observed - want) ** 2 / want).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


def exact_joint(model, prompt, sampling):
    """P(t1, t2) [vocab, vocab] under the target's sampling distribution."""
    p1 = probs(target_logits(model, [prompt])[0], sampling)
    p2 = probs(target_logits(model, [torch.cat([prompt, torch.tensor([t])]) for t in range(SMALL_VOCAB)]), sampling)
    return p1[:, None] * p2


def sampled_joint(decoder, drafter, prompt, sampling):
    counts = torch.zeros(SMALL_VOCAB * SMALL_VOCAB)
    for seed in range(DRAWS):
        ids, _ = speculative_generate(decoder, drafter, prompt, 2,
                                      SamplingConfig(sampling.temperature, sampling.top_p, seed))
        counts[int(ids[-2]) * SMALL_VOCAB + int(ids[-1])] += 1
    return counts


@pytest.fixture(scope="module")
def tiny_vocab_setup():
    target = random_model(0, vocab=SMALL_VOCAB, logit_scale=60.0, layers=1)
    draft = random_model(0, vocab=SMALL_VOCAB, logit_scale=60.0, layers=1)
    with torch.no_grad():  # close to the target but not equal: about 3 drafts in 4 accepted, the rest resampled
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
        draft.lm_head.weight.add_(0.3 * noise)
    prompt = torch.tensor([1, 5, 2, 7])
    sampling = SamplingConfig(temperature=1.0, top_p=1.0)
    joint = exact_joint(target, prompt, sampling)
    expected = joint.flatten() * DRAWS
    # static heads that roughly rank the target's likely second tokens first (depth-2 guesses are random)
    g = torch.Generator().manual_seed(9)
    medusa_heads = torch.randn(3, SMALL_VOCAB, generator=g)
    medusa_heads[0] = joint.sum(0).log() + torch.randn(SMALL_VOCAB, generator=g)
    drafters = {
        "model": ModelDrafter(Decoder.from_model(draft, max_len=16), k=2),  # a chain drafted with q: Leviathan's rule
        "tree": MedusaDrafter(lambda h: medusa_heads, [(0,), (1,), (2,), (0, 0), (1, 0)]),  # point masses, siblings
    }
    return Decoder.from_model(target, max_len=16), drafters, prompt, sampling, expected


@pytest.mark.parametrize("drafter_name", ["model", "tree"])
def test_speculative_sampling_keeps_the_target_distribution(tiny_vocab_setup, drafter_name):
    decoder, drafters, prompt, sampling, expected = tiny_vocab_setup
    counts = sampled_joint(decoder, drafters[drafter_name], prompt, sampling)
    assert chi_square_p_value(counts, expected) > 1e-3


@pytest.mark.parametrize("drafter_name", ["model", "tree"])
def test_always_accepting_fails_the_same_test(tiny_vocab_setup, drafter_name, monkeypatch):
    decoder, drafters, prompt, sampling, expected = tiny_vocab_setup
    monkeypatch.setattr(speculative, "_accepts", lambda p_x, q_x, u: True)
    counts = sampled_joint(decoder, drafters[drafter_name], prompt, sampling)
    assert chi_square_p_value(counts, expected) < 1e-6


def test_verify_with_sampled_siblings_keeps_the_distribution():
    """Several children per node, each drawn i.i.d. from its own q (SpecInfer's case), on fixed distributions."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(4, SMALL_VOCAB, generator=g) * 2  # rows: root, then the three nodes
    q = torch.softmax(torch.randn(SMALL_VOCAB, generator=g) * 2, dim=-1)
    sampling = SamplingConfig()
    counts = torch.zeros(SMALL_VOCAB)
    draws = 6000
    for _ in range(draws):
        children = torch.multinomial(q, 3, replacement=True, generator=g)
        path, token = speculative.verify(children, torch.tensor([-1, -1, -1]), p_logits, sampling, g,
                                         q.expand(3, -1))
        counts[int(children[path[0]]) if path else token] += 1
    expected = probs(p_logits[0], sampling) * draws
    assert chi_square_p_value(counts, expected) > 1e-3


@pytest.mark.slow
def test_smollm2_with_its_own_w4_quantization_as_draft_is_lossless(smol_tokenizer):
    """A real small draft model: SmolLM2 quantized to RTN W4 g64 drafts for the float SmolLM2. Greedy speculative
    output must equal the target's own greedy output, and a draft this close is accepted most of the time."""
    from toolkit.engine.loop import quantize_layers
    from toolkit.methods import driver_for
    from toolkit.models import load_model
    from toolkit.quant.configs import RTNConfig

    target, draft = load_model("smollm2-135m"), load_model("smollm2-135m")
    quantize_layers(draft, RTNConfig(group_size=64), driver_for(RTNConfig()), None, lambda *a: None)
    messages = [{"role": "user", "content": "List three uses of a paperclip."}]
    prompt = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = torch.as_tensor(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)[0]
    n = 24
    expected, _ = generate(Decoder.from_model(target, prompt.numel() + n), prompt, n)
    drafter = ModelDrafter(Decoder.from_model(draft, prompt.numel() + n + 8), k=3)
    ids, stats = speculative_generate(Decoder.from_model(target, prompt.numel() + n + 8), drafter, prompt, n)
    print(f"\nW4 draft for float SmolLM2: mean accepted length {stats.mean_accepted_length:.2f}")
    assert torch.equal(ids[: expected.numel()], expected)
    assert stats.mean_accepted_length > 2.0
