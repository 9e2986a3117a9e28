"""Decoding: compound's own Llama-family forward over a static KV cache, plain and speculative decode loops.

    decoder = Decoder.from_model(model, max_len=2048, kv_dtype=torch.int8)       # shares the model's modules
    ids, stats = generate(decoder, prompt_ids, 128)                               # greedy
    ids, stats = generate(decoder, prompt_ids, 128, SamplingConfig(0.7, 0.9, seed=0))
    drafter = ModelDrafter(Decoder.from_model(draft_model, 2048), k=4)            # or MedusaDrafter, any Drafter
    ids, stats = speculative_generate(decoder, drafter, prompt_ids, 128)
    stats.mean_accepted_length, stats.acceptance_rate, stats.tokens_per_s

Modules: ``model`` (the forward), ``kv_cache`` (float / INT8 cache, compaction), ``sampling``, ``generate`` (plain
loop, stats), ``tree`` (tree masks, Medusa static trees, EAGLE-2 dynamic trees), ``speculative`` (the ``Drafter``
protocol, verification, the speculative loop), ``drafters`` (draft model, Medusa heads).
"""

from toolkit.decode.drafters import MedusaDrafter, ModelDrafter
from toolkit.decode.generate import DecodeStats, check_context, decode_one_token, generate, greedy_outputs, prefill
from toolkit.decode.kv_cache import KVCache
from toolkit.decode.model import DecodeError, Decoder
from toolkit.decode.sampling import SamplingConfig
from toolkit.decode.speculative import DraftContext, Drafter, Proposal, speculative_generate, verify
from toolkit.decode.tree import eagle2_tree, static_tree

__all__ = [
    "Decoder", "DecodeError", "KVCache", "SamplingConfig", "DecodeStats", "prefill", "decode_one_token", "generate",
    "greedy_outputs", "check_context",
    "Drafter", "DraftContext", "Proposal", "verify", "speculative_generate", "ModelDrafter", "MedusaDrafter",
    "eagle2_tree", "static_tree",
]
