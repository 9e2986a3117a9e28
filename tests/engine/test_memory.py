from dataclasses import dataclass

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, LlamaConfig

from toolkit.engine import memory
from toolkit.quant.configs import METHODS, GPTQConfig, RTNConfig, SignRoundConfig

MiB = 2**20


@pytest.fixture(scope="module")
def skeleton():
    """A Llama with known shapes on the meta device: hidden 64, intermediate 128, 4 heads / 2 KV heads (head_dim 16),
    2 layers, vocab 256, untied. Per layer: q, o 64×64; k, v 32×64; gate, up 128×64; down 64×128; 2 norms of 64:
    36992 values. Outside: embeddings 16384 + final norm 64; LM head 16384. Whole model: 106816."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_streamed_gptq_estimate_by_hand(skeleton):
    got = memory.estimate(skeleton, GPTQConfig(group_size=32), 16, 32, streamed=True)
    # packed linears (4 bits + 6 bytes per group of 32): q, o 2816; k, v 1408; gate, up, down 5632 → 25344 per layer
    assert got.parts == {
        "runtime": 512 * MiB,
        "float layer": 36992 * 4,
        "embeddings": (16384 + 64) * 4,
        "activations": 2 * 16 * 32 * 64 * 4,  # inputs and outputs of a layer: samples × seq_len × hidden, float32
        "forward": 8 * 32 * (3 * 128 + 2 * 4 * 32) * 4 + 3 * 8192 * 4,  # a batch's MLP ×3, scores ×2; a linear ×3
        "replay inputs": 16 * 32 * (64 + 128) * 4,  # o_proj's and down_proj's inputs, kept (true-sequential)
        "hessians": 3 * 128**2 * 4,  # widest input (down_proj, 128)
        "output": 2 * 25344,
    }
    assert got.total == sum(got.parts.values())


def test_learned_rounding_and_saved_layers_by_hand(skeleton):
    got = memory.estimate(skeleton, SignRoundConfig(group_size=32), 16, 32, streamed=True).parts
    forward = 8 * 32 * (3 * 128 + 2 * 4 * 32) * 4 + 3 * 8192 * 4
    # the float stream (the layer's inputs and outputs): 2 × samples × seq_len × hidden
    assert got["float stream"] == 2 * 16 * 32 * 64 * 4 and "float inputs" not in got
    # the layer's linear weights (q, o 4096; k, v 2048; gate, up, down 8192) × 8
    assert got["learned rounding"] == 8 * 36864 * 4 + 2 * forward
    # the checkpoint: packed linears, every other value in float16, extras; the saved layers: a byte per code of both
    # layers (73728), scale and zero in float32 per group of 32, the 4 norms of 64 in float32
    written = memory.disk_estimate(skeleton, RTNConfig(group_size=32), 0, 32, 2, offload=False)
    assert written == 2 * 25344 + (106816 - 73728) * 2 + memory.EXTRAS + 73728 + 73728 // 32 * 8 + 4 * 64 * 4


def test_in_memory_and_offloaded_estimates(skeleton):
    in_memory = memory.estimate(skeleton, RTNConfig(group_size=32), 0, 32, streamed=False)
    assert in_memory.parts == {"runtime": 512 * MiB, "float model": 106816 * 4, "output": 2 * 2 * 25344}
    offloaded = memory.estimate(skeleton, GPTQConfig(group_size=32), 128, 32, streamed=True, offload=True)
    assert offloaded.parts["activations"] == 2 * 8 * 32 * 64 * 4  # one batch of 8
    assert "replay inputs" not in offloaded.parts  # activations on disk: nothing is kept for replay


def test_statistics_parts_follow_the_capabilities(skeleton):
    def statistics(config):
        parts = memory.estimate(skeleton, config, 16, 32, streamed=True).parts
        return "hessians" in parts, "awq inputs" in parts, "learned rounding" in parts

    assert {name: statistics(cls(group_size=32)) for name, cls in METHODS.items()} == {
        "rtn": (False, False, False), "gptq": (True, False, False), "awq": (False, True, False),
        "awq+gptq": (True, True, False), "signround": (False, False, True),
    }

    @dataclass(frozen=True)
    class BothConfig(RTNConfig):  # a method declared here: no other file names it
        max_tokens: int = 64
        method = "both"
        needs_activations = True
        needs_hessian = True
        searches_scales = True

    got = memory.estimate(skeleton, BothConfig(group_size=32), 16, 32, streamed=True).parts
    assert got["hessians"] == 3 * 128**2 * 4  # widest input (down_proj, 128)
    assert got["awq inputs"] == 64 * (4 * 64 + 2 * 64 + 128) * 4  # max_tokens × q, k, v, o, gate, up, down inputs


def test_refusal_names_the_way_out(skeleton):
    config = GPTQConfig(group_size=32)
    in_memory = memory.estimate(skeleton, config, 16, 32, streamed=False)
    streamed = memory.estimate(skeleton, config, 16, 32, streamed=True)
    between = (in_memory.total + streamed.total) // 2
    with pytest.raises(memory.MemoryLimitError, match=r"needs about 0\.5 GiB \(in memory\) .* try --stream"):
        memory.check_fits(in_memory, between, streamed)
    memory.check_fits(streamed, between, None)
    with pytest.raises(memory.MemoryLimitError, match=r"fewer --samples \(the activations take 0\.0 GiB\), or "
                                                      r"--offload-activations"):
        memory.check_fits(streamed, MiB, None)
    memory.check_fits(in_memory, None, None)  # unknown: no refusal


def test_available_memory_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert memory.available_memory(meminfo) == 20000000 * 1024
    assert memory.available_memory(tmp_path / "missing") is None
