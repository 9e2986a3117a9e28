"""What a user sets for ``compound eval`` and for ``compound validate --heads``, declared once with
``toolkit.options.option``: the CLI flags and the recipe's ``evaluate`` section are derived from these fields.

* ``HeldOut``: the source whose eval split both verbs read (a recipe reads its ``calibration.dataset``);
* ``EvalOptions``: the held-out windows per slice and the generation checks (the recipe's evaluate step);
* ``EvalHeadsOptions``: ``eval --heads``, the heads' accepted length per slice;
* ``HeadsCheckOptions``: ``validate --heads`` (the recipe's heads_eval step): accepted length, speedup, lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.decode.options import MAX_NEW_TOKENS
from toolkit.evaluate.acceptance import CATEGORIES
from toolkit.evaluate.divergence import KL_THRESHOLD
from toolkit.evaluate.perplexity import EVAL_WINDOWS
from toolkit.evaluate.slices import SLICES
from toolkit.models import FLOAT_DTYPES
from toolkit.options import check_at_least, check_choices, option
from toolkit.quant.configs import ConfigError

WINDOWS_PER_SLICE = EVAL_WINDOWS // len(SLICES)
# the decode loop of --heads runs in float32 (where losslessness is exact) or bfloat16; float16 is not offered
HEADS_DTYPES = tuple(d for d in FLOAT_DTYPES if d != "float16")


@dataclass(frozen=True)
class HeldOut:
    """The held-out source of ``eval`` and ``validate``."""

    dataset: str = option("sharegpt", "Held-out source (its eval split).")


@dataclass(frozen=True)
class EvalOptions:
    """``compound eval``: windows × seq_len held-out tokens per slice, the KL threshold, the generation checks."""

    windows: int = option(WINDOWS_PER_SLICE, "Held-out windows per slice (each perplexity and ratio prints with its "
                          "95 % interval over windows).")
    seq_len: int = option(512, "Tokens per window.")
    kl_threshold: float = option(KL_THRESHOLD, "Report the share of tokens whose KL(base ‖ model) exceeds this "
                                 "(nats): where the model breaks.")
    generation: bool = option(True, "Run the JSON / code / factual generation checks.")
    generation_tokens: int = option(96, "Tokens decoded per generation-check prompt.", aliases=("--new-tokens",))

    def __post_init__(self):
        check_at_least(self, 1, "windows", "generation_tokens", error=ConfigError)
        check_at_least(self, 2, "seq_len", error=ConfigError)  # a window predicts seq_len - 1 tokens


@dataclass(frozen=True)
class EvalHeadsOptions:
    """``compound eval --heads``: held-out prompts per slice and tokens decoded per prompt."""

    head_prompts: int = option(4, "With --heads: held-out prompts per slice.")
    head_tokens: int = option(MAX_NEW_TOKENS, "With --heads: tokens decoded per prompt.")


@dataclass(frozen=True)
class HeadsCheckOptions:
    """``compound validate --heads``: held-out prompts decoded, in which dtype, over which prompt sets."""

    prompts: int = option(8, "With --heads: held-out prompts decoded.")
    max_new_tokens: int = option(MAX_NEW_TOKENS, "With --heads: tokens generated per prompt.")
    decode_dtype: str = option("float32", "With --heads: the target's dtype in the decode loop (float32: the "
                               "dtype in which speculative output is token-identical to greedy on CPUs).",
                               choices=HEADS_DTYPES)
    categories: tuple[str, ...] = option(("all",), "With --heads: held-out prompt sets, comma-separated, each "
                                         f"reported apart: {', '.join(CATEGORIES)}.", choices=CATEGORIES)

    def __post_init__(self):
        check_choices(self, ConfigError)
        check_at_least(self, 1, "prompts", "max_new_tokens", error=ConfigError)
        if not self.categories:
            raise ConfigError(f"--categories takes comma-separated prompt sets of {', '.join(CATEGORIES)}, got none")
