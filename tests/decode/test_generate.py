"""The plain decode loop against transformers: greedy tokens, seeded sampling, and the real model's speed."""

import time

import pytest
import torch

from conftest import cli, refused, tiny_model
from toolkit.decode import Decoder, SamplingConfig, generate
from toolkit.decode.sampling import probs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_equals_transformers_generate():
    model = tiny_model("qwen2", vocab=256)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    prompt = torch.tensor([[5, 9, 100, 3, 77]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)[0]
    ids, stats = generate(Decoder.from_model(model, max_len=32), prompt, 20)
    assert torch.equal(ids, expected)
    assert stats.new_tokens == stats.target_forwards == 20 and stats.mean_accepted_length == 1.0


def test_sampling_draws_from_the_model_distribution_with_the_seeded_generator():
    model = tiny_model("llama", vocab=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    prompt = torch.tensor([5, 9, 10])
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, seed=11)
    ids, _ = generate(Decoder.from_model(model, max_len=16), prompt, 8, sampling)
    g, sequence = sampling.generator(), prompt  # the same draws, from transformers' logits without a cache
    for _ in range(8):
        with torch.no_grad():
            logits = model(sequence[None]).logits[0, -1]
        sequence = torch.cat([sequence, torch.multinomial(probs(logits, sampling), 1, generator=g)])
    assert torch.equal(ids, sequence)


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_generate(smol_tokenizer):
    from toolkit.models import load_model

    model = load_model("smollm2-135m")
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    prompt = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = torch.as_tensor(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    n = 32
    decoder = Decoder.from_model(model, max_len=prompt.shape[1] + n)
    generate(decoder, prompt, 4)  # warm-up
    ids, stats = generate(decoder, prompt, n)
    start = time.perf_counter()
    expected = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=smol_tokenizer.eos_token_id)[0]
    hf_s = time.perf_counter() - start
    print(f"SmolLM2-135M greedy, {n} tokens, {torch.get_num_threads()} thread(s): toolkit.decode "
          f"{stats.tokens_per_s:.1f} tok/s, transformers generate {n / hf_s:.1f} tok/s")
    assert torch.equal(ids, expected)


RUNS_END_EMPTY = True  # conftest's runs: every case here leaves it empty
run = cli




@pytest.mark.parametrize("prompt,new_tokens,needle", [
    ("word " * 300, 4, "shorten the prompt"),
    ("Hi", 1000, "lower --max-new-tokens to"),
])
def test_decode_beyond_the_context(runs, tiny_llama_dir, prompt, new_tokens, needle):
    refused(run("decode", "--model", tiny_llama_dir, "--prompt", prompt, "--max-new-tokens", new_tokens),
            "max_position_embeddings = 256", needle)
