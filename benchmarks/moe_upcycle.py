"""A Mixture-of-Experts model with real weights: SmolLM2-135M-Instruct sparsely upcycled to Mixtral.

There is no real MoE checkpoint on this machine, so compound's MoE calibration is measured on one built from the
embedded SmolLM2 (sparse upcycling, Komatsuzaki et al. 2023, "Sparse Upcycling: Training Mixture-of-Experts from
Dense Checkpoints"): every decoder MLP is copied into ``experts`` experts (w1 = gate_proj, w3 = up_proj,
w2 = down_proj) and a seeded random router picks ``top_k`` of them per token. Mixtral renormalises the top-k softmax
weights to sum to 1, and every expert computes the same function, so the upcycled model's output equals SmolLM2's up
to float rounding whatever the router says; attention, norms, embeddings and the config values (RoPE theta, RMS eps,
tied embeddings, vocabulary, context length, no sliding window) are SmolLM2's.

The router only decides which tokens each expert *sees*, which is what MoE calibration must handle. A plain Gaussian
router would send most tokens to one expert per layer: the post-attention-norm hidden states share a large mean
direction, and the expert whose row points most along it wins nearly everywhere. So each layer's router rows are
drawn Gaussian (``seed``), projected orthogonal to that layer's mean normalised hidden state (measured on a few
calibration-split ShareGPT sequences through the dense model, which computes the same hidden states), and scaled so
the router logits have standard deviation ``logit_std`` on those tokens. Different experts then win on different
tokens (each gets a share between 5 % and 70 %: ``tests/test_moe_upcycle.py``).

    python benchmarks/moe_upcycle.py [--out benchmarks/.cache/moe/smollm2-upcycled-mixtral] [--experts 4] [--top-k 2]

writes a float32 Mixtral checkpoint (transformers' ``save_pretrained``: the Hub's per-expert names
``model.layers.{i}.block_sparse_moe.experts.{e}.w1/w2/w3``) with SmolLM2's tokenizer and chat template.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / ".cache" / "moe" / "smollm2-upcycled-mixtral"


def mixtral_config(dense_config, experts: int, top_k: int):
    """A MixtralConfig holding every value of the dense Llama config that the forward reads."""
    from transformers import MixtralConfig

    c = dense_config
    return MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
        sliding_window=None, num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        attention_dropout=0.0, dtype="float32",
    )


@torch.no_grad()
def normed_hidden_states(dense: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each decoder layer's post-attention-norm output (the router's input) on ``tokens`` [B, T]: [B·T, H] each."""
    seen: list[torch.Tensor] = []
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda module, args, out: seen.append(out.reshape(-1, out.shape[-1]).float()))
        for layer in dense.model.layers]
    try:
        dense(tokens)
    finally:
        for h in hooks:
            h.remove()
    return seen


def router_weights(x: torch.Tensor, experts: int, generator: torch.Generator, logit_std: float) -> torch.Tensor:
    """[experts, H] Gaussian rows orthogonal to the mean of ``x`` [N, H], scaled so that ``x @ W.T`` has standard
    deviation ``logit_std`` per expert."""
    mean = x.mean(0)
    u = mean / mean.norm()
    W = torch.randn(experts, x.shape[1], generator=generator)
    W -= (W @ u)[:, None] * u[None]  # drop the shared direction: no expert wins by it alone
    std = (x @ W.T).std(0)  # [experts]
    return W * (logit_std / std)[:, None]


@torch.no_grad()
def upcycle(dense: nn.Module, router_tokens: torch.Tensor, experts: int = 4, top_k: int = 2, seed: int = 0,
            logit_std: float = 1.0) -> nn.Module:
    """A float32 ``MixtralForCausalLM`` (fused experts, as transformers 5 holds them) whose every layer's experts are
    copies of ``dense``'s MLP, with routers made by ``router_weights`` from ``router_tokens`` [B, T]."""
    from transformers import MixtralForCausalLM

    dense.eval()  # load_model gives float32 (a GGUF-loaded model refuses .float())
    config = mixtral_config(dense.config, experts, top_k)
    moe = MixtralForCausalLM(config).float().eval()
    moe.model.embed_tokens.weight.copy_(dense.model.embed_tokens.weight)
    moe.model.norm.weight.copy_(dense.model.norm.weight)
    if not config.tie_word_embeddings:
        moe.lm_head.weight.copy_(dense.lm_head.weight)
    generator = torch.Generator().manual_seed(seed)
    for layer, source, x in zip(moe.model.layers, dense.model.layers, normed_hidden_states(dense, router_tokens)):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
        layer.input_layernorm.weight.copy_(source.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        mlp, block = source.mlp, layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2I, H]: gate rows, then up rows
        block.experts.gate_up_proj.copy_(gate_up.expand(experts, -1, -1))  # [E, 2I, H]
        block.experts.down_proj.copy_(mlp.down_proj.weight.expand(experts, -1, -1))  # [E, H, I]
        block.gate.weight.copy_(router_weights(x, experts, generator, logit_std))
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe


def router_tokens(tokenizer, sequences: int = 8, seq_len: int = 256) -> torch.Tensor:
    """Calibration-split ShareGPT tokens [sequences, seq_len] for the routers' mean and scale (seed 1: not the
    benchmark's seed-0 calibration batch, never the held-out windows)."""
    from toolkit.calibration import calibration_batch

    return calibration_batch(tokenizer, "sharegpt", sequences, seq_len, seed=1)


def build(out: Path = DEFAULT_OUT, experts: int = 4, top_k: int = 2, seed: int = 0, logit_std: float = 1.0) -> Path:
    """Upcycle the embedded SmolLM2-135M-Instruct and save it (with its tokenizer) to ``out``."""
    from toolkit.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    dense = load_model("smollm2-135m")
    moe = upcycle(dense, router_tokens(tokenizer), experts, top_k, seed, logit_std)
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logit-std", type=float, default=1.0, help="router logits' standard deviation per expert")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(build(args.out, args.experts, args.top_k, args.seed, args.logit_std))


if __name__ == "__main__":
    main()
