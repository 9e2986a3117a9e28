"""What a user sets for ``compound train-heads``, one frozen dataclass per job; the training loop's own options are
``toolkit.heads.train.TrainConfig``.

* ``MedusaOptions``: the Medusa heads and their export layout;
* ``EagleOptions``: an EAGLE head (``eagle``, ``eagle3``) and the draft shape it is selected on;
* ``DataOptions``: the conversations and the target's hidden states the heads train on;
* ``SelectOptions``: how a checkpoint is chosen (accepted length on held-out prompts).

Every user-settable field is a ``toolkit.options.option``: its name is the CLI flag and the recipe key, so names are
unique across these classes and ``TrainConfig``. These sit apart from ``MedusaConfig`` / ``EagleConfig``, which
describe a built head (its sizes come from the target) and are what an export records.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.heads.eagle import LOSSES
from toolkit.heads.eagle_draft import TreeShape
from toolkit.heads.medusa import check_medusa_shape
from toolkit.heads.medusa_export import LAYOUTS, check_layout
from toolkit.models import FLOAT_DTYPES
from toolkit.options import check_choices, option

SELECT_MODES = ("tree", "chain")


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa heads: how many, how deep, whether they share the target's lm_head, and the layout they export in."""

    num_heads: int = option(4, "Medusa: heads (tokens drafted beyond the target's own).")
    num_layers: int = option(1, "Medusa: residual blocks per head.")
    shared_lm_head: bool = option(
        False, "Heads share one frozen copy of the target's lm_head (Medusa-2, vLLM original_lm_head: one output "
        "product for all heads) instead of one trained output layer each.", flag="--shared-lm-head/--own-lm-heads")
    layout: str = option("vllm", "Export layout: vllm (vLLM's Medusa) | medusa (FasterDecoding's).", choices=LAYOUTS)

    def __post_init__(self):
        check_medusa_shape(self.num_heads, self.num_layers)
        check_layout(self.layout)


@dataclass(frozen=True)
class EagleOptions:
    """An EAGLE head: eagle3's fused layers, draft vocabulary and training-time test; the draft shape of both kinds."""

    aux_layers: tuple[int, ...] | None = option(
        None, "eagle3: target layers fused, as transformers hidden_states indices = vLLM ids, e.g. 2,15,27 "
        "(default: 2, N/2, N-3).")
    draft_vocab: int = option(32000, "eagle3: draft vocabulary size, the most frequent trained tokens (at most the "
                              "target's vocabulary).")
    ttt_steps: int = option(5, "eagle3: unrolled draft steps of the training-time test.")
    loss: str = option("kl", "EAGLE: token loss: kl (forward KL against the target's distribution over the draft "
                       "vocabulary) | ce (cross-entropy on the target's greedy token).", choices=LOSSES)
    depth: int = option(5, "EAGLE: draft steps (tree depth; chain length in --select-mode chain).")
    top_k: int = option(4, "EAGLE: children per expanded node of the EAGLE-2 dynamic tree.")
    draft_tokens: int = option(8, "EAGLE: tree nodes verified per step.")

    def __post_init__(self):
        check_choices(self)  # "--loss must be one of kl, ce, got ..."
        if min(self.draft_vocab, self.ttt_steps, self.depth, self.top_k, self.draft_tokens) < 1:
            raise ValueError("--draft-vocab, --ttt-steps, --depth, --top-k and --draft-tokens must be >= 1, got "
                             f"{self.draft_vocab}, {self.ttt_steps}, {self.depth}, {self.top_k}, {self.draft_tokens}")
        aux = self.aux_layers
        if aux is not None and (not aux or aux[0] < 1 or list(aux) != sorted(set(aux))):
            raise ValueError(f"--aux-layers must be increasing target layer indices >= 1 such as 2,15,27, got "
                             f"{','.join(map(str, aux)) or 'none'}")

    def check_target(self, num_layers: int, vocab_size: int) -> None:
        """Refuse, for an eagle3 head, what a target of ``num_layers`` decoder layers and ``vocab_size`` tokens lacks:
        aux layers outside 1..num_layers - 1 (the residual stream entering a decoder layer) and a draft vocabulary
        larger than its own."""
        if num_layers < 2:
            raise ValueError(f"--head eagle3 fuses the states entering decoder layers 1 and up, and the target has "
                             f"{num_layers} decoder layer; use --head eagle or --head medusa")
        if self.aux_layers and self.aux_layers[-1] >= num_layers:
            raise ValueError(f"--aux-layers {','.join(map(str, self.aux_layers))} is out of range: the target has "
                             f"{num_layers} decoder layers, so aux layers lie in 1..{num_layers - 1}")
        if self.draft_vocab > vocab_size:
            raise ValueError(f"--draft-vocab {self.draft_vocab} is larger than the target's vocabulary; choose "
                             f"1..{vocab_size}")

    @property
    def tree(self) -> TreeShape:
        """The EAGLE-2 dynamic tree of these options (what SGLang serves with ``--speculative-eagle-topk``)."""
        return TreeShape(self.depth, self.top_k, self.draft_tokens)

    def shape(self, select_mode: str) -> TreeShape:
        """The draft shape selected on in ``select_mode``: the dynamic tree, or the chain of ``depth`` (vLLM's)."""
        return self.tree if select_mode == "tree" else TreeShape(self.depth)


@dataclass(frozen=True)
class DataOptions:
    """The conversations trained on, how their answers are made, and how the target's hidden states are computed."""

    dataset: str = option("sharegpt", "Conversations: sharegpt, a .json/.jsonl/.parquet file, or a datasets id (its "
                          "train split).")
    samples: int = option(1000, "Conversations trained on.")
    max_len: int = option(1024, "Tokens per example at most.")
    self_distill: bool = option(True, "Answer the first user turns again with the target (default), or train on the "
                                "dataset's own assistant turns.", flag="--self-distill/--dataset-answers")
    distill_tokens: int = option(256, "Self-distillation: new tokens per answer at most.")
    distill_batch: int = option(16, "Self-distillation: prompts generated together.")
    target_dtype: str = option("bfloat16", "The target's dtype while it answers (self-distillation) and its hidden "
                               "states are computed.", choices=FLOAT_DTYPES)
    online: bool = option(False, "Compute hidden states while training instead of caching them.")
    stream_target: bool = option(
        False, "Cache the hidden states with the target read one decoder layer at a time from the shards of a local "
        "safetensors directory (a target larger than memory; needs --dataset-answers). Training and checkpoint "
        "selection still load the target.", flag="--stream-target")
    batch_tokens: int = option(4096, "Padded tokens per target forward while caching hidden states (raise it with "
                               "--stream-target: each forward reads every layer).")
    distill_prompt_tokens: int = 384  # longest prompt self-distilled: long prompts cost prefill and cache, not signal

    def __post_init__(self):
        if self.samples < 1 or self.max_len < 8:
            raise ValueError(f"need --samples >= 1 and --max-len >= 8, got {self.samples} and {self.max_len}")
        check_choices(self)
        if self.batch_tokens < 1:
            raise ValueError("--batch-tokens must be >= 1")
        if min(self.distill_tokens, self.distill_batch) < 1:
            raise ValueError(f"--distill-tokens and --distill-batch must be >= 1, got {self.distill_tokens} and "
                             f"{self.distill_batch}")
        if self.stream_target and (self.online or self.self_distill):
            raise ValueError("--stream-target runs the target one layer at a time over the whole cache; it cannot "
                             "generate answers (use --dataset-answers) or compute states while training (drop "
                             "--online)")

    def check_target(self, max_positions: int | None) -> None:
        """Refuse examples longer than the target's context (its ``max_position_embeddings``, when it has one)."""
        if max_positions is not None and self.max_len > max_positions:
            raise ValueError(f"--max-len {self.max_len} is longer than the target's context of {max_positions} "
                             f"tokens (max_position_embeddings); choose 8..{max_positions}")


@dataclass(frozen=True)
class SelectOptions:
    """Checkpoint selection: the held-out prompts the heads draft on, and the decoding their accepted length is of."""

    eval_prompts: int = option(4, "Held-out prompts for checkpoint selection.")
    eval_tokens: int = option(64, "Tokens decoded per selection prompt.")
    select_mode: str = option("tree", "Select the checkpoint by accepted length in: tree (compound's loop) | chain "
                              "(vLLM's).", choices=SELECT_MODES)

    def __post_init__(self):
        check_choices(self)  # "--select-mode must be one of tree, chain, got ..."
        if min(self.eval_prompts, self.eval_tokens) < 1:
            raise ValueError(f"--eval-prompts and --eval-tokens must be >= 1, got {self.eval_prompts} and "
                             f"{self.eval_tokens}")
