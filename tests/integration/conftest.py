"""Fixtures of the vLLM speculative-decoding tests (test_vllm_medusa.py, test_vllm_eagle.py)."""

import pytest
import torch

SPEC_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
                "Give three tips for learning to cook."]


@pytest.fixture(scope="module")
def spec_target(tmp_path_factory, one_thread):
    """(the float SmolLM2 model, its Hugging Face directory for vLLM, the SHA-256 of its weights, the chat-templated
    token ids of ``SPEC_PROMPTS``)."""
    from toolkit.formats.checkpoint import sha256_file, write_checkpoint
    from toolkit.models import load_model, load_tokenizer

    model, tokenizer = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
    directory = write_checkpoint(tmp_path_factory.mktemp("vllm-spec") / "target", model, tokenizer, {}, None,
                                 {"model": "smollm2-135m"}, torch.float32)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for text in SPEC_PROMPTS]
    return model, directory, sha256_file(directory / "model.safetensors"), prompts
