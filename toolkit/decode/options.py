"""What a user sets for ``compound decode``, declared once with ``toolkit.options.option`` (the flags are derived)."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.decode.kv_cache import CACHE_DTYPES
from toolkit.engine.devices import device_option
from toolkit.options import check_choices, option

MAX_NEW_TOKENS = 64  # tokens generated per prompt at most, by every verb that decodes (decode, validate --heads, eval)


@dataclass(frozen=True)
class DecodeOptions:
    """One reply: how many tokens, greedy or sampled, on which device, and the KV cache it is decoded with (``kv_cache_dtype``, vLLM's
    name for it; ``quantize --kv-cache`` is another setting: which static scales a checkpoint calibrates)."""

    max_new_tokens: int = option(MAX_NEW_TOKENS, "Tokens to generate at most (stops early at end-of-sequence).")
    temperature: float = option(0.0, "0: greedy; above 0: sample at this temperature.")
    kv_cache_dtype: str = option("float", "What the KV cache stores: float (the model dtype) | int8 (scales per "
                                 "token and head) | int8-static (the checkpoint's calibrated scales, from quantize "
                                 "--kv-cache int8: what a static-scale engine stores; BENCHMARKS.md).",
                                 choices=tuple(CACHE_DTYPES))
    seed: int = option(0, "Sampling seed.")
    device: str = device_option()

    def __post_init__(self):
        check_choices(self)
