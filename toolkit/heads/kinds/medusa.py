"""The ``medusa`` kind: K heads over the target's last hidden state (``toolkit.heads.medusa``), exported in vLLM's or
FasterDecoding's layout (``toolkit.heads.medusa_export``), drafting a static tree or vLLM's chain.

Draft shapes: ``chain_paths(K)``, each head's top-1 in a chain, which is what vLLM serves (``method: medusa``), and
``DEFAULT_TREE``, a small static tree (Medusa's sparse trees, cut to 12 nodes because a CPU target pays for every node
it verifies).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from toolkit.decode import Decoder, MedusaDrafter
from toolkit.heads.kinds import Built, HeadKind, first_draft_labels, register
from toolkit.heads.medusa import MedusaHeads, medusa_loss
from toolkit.heads.medusa_export import export_medusa, layout_of, load_medusa
from toolkit.heads.options import MedusaOptions

# Top-k ranks per depth, most likely paths first (the shape of Medusa's sparse trees, cut to 12 nodes).
DEFAULT_TREE = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]


def chain_paths(num_heads: int) -> list[tuple[int, ...]]:
    """Each head's top-1 in a chain: [(0,), (0, 0), ...], vLLM's Medusa proposal."""
    return [(0,) * d for d in range(1, num_heads + 1)]


def tree_for(num_heads: int) -> list[tuple[int, ...]]:
    """``DEFAULT_TREE`` without the paths deeper than ``num_heads``."""
    return [p for p in DEFAULT_TREE if len(p) <= num_heads]


def heads_callable(heads: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [D] -> logits [K, V] for ``MedusaDrafter``, from a copy of ``heads`` in ``dtype``.

    bfloat16 by default, as vLLM runs heads in the serving dtype: on CPUs with bf16 matrix units a [K, H] x [H, V]
    product costs what one row does in bf16 and about K times that in float32. Proposals only need the top-k.
    """
    drafting = copy.deepcopy(heads).to(dtype).eval()
    return lambda hidden: drafting(hidden.to(dtype))


class MedusaKind(HeadKind):
    name = "medusa"
    title = "Medusa"
    options = MedusaOptions
    signature = "Medusa: model_type 'medusa' (vLLM) or medusa_num_heads (FasterDecoding)"

    def describe(self, opts: MedusaOptions) -> str:
        return f"{opts.num_heads} {self.name} heads"

    def train_dir(self, opts: MedusaOptions) -> str:
        output = "shared" if opts.shared_lm_head else "own"
        return f"train-{self.name}-k{opts.num_heads}-l{opts.num_layers}-{output}"

    def build(self, opts: MedusaOptions, target, examples, console) -> Built:
        heads = MedusaHeads.from_target(target, opts.num_heads, opts.num_layers, opts.shared_lm_head)
        return Built(heads, lambda model, batch: medusa_loss(model, batch["hidden"], batch["input_ids"],
                                                             batch["loss_mask"]), first_draft_labels)

    def selection_shape(self, opts: MedusaOptions, select_mode: str) -> list[tuple[int, ...]]:
        return tree_for(opts.num_heads) if select_mode == "tree" else chain_paths(opts.num_heads)

    def validation_shapes(self, head, directory, tree, chain, explore) -> list[tuple[str, list[tuple[int, ...]]]]:
        K = head.config.num_heads
        return [("tree", tree_for(K)), ("chain", chain_paths(K))]

    def shape_label(self, shape: list[tuple[int, ...]]) -> tuple[str, int]:
        n = len(shape)
        return (f"chain of {n}" if shape == chain_paths(n) else f"{n}-node tree"), n

    def fit(self, head: MedusaHeads, target, target_name: str) -> MedusaHeads:
        heads = head.float()
        if heads.config.hidden_size != target.config.hidden_size or heads.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"heads of hidden {heads.config.hidden_size} / vocab {heads.config.vocab_size} do not "
                             f"fit {target_name} (hidden {target.config.hidden_size} / vocab "
                             f"{target.config.vocab_size})")
        return heads

    def drafting(self, head, target, shape, max_len, draft_dtype):
        return Decoder.from_model(target, max_len), MedusaDrafter(heads_callable(head, draft_dtype), shape)

    def detects(self, config: dict) -> bool:
        return layout_of(config) is not None

    def load(self, directory: Path) -> MedusaHeads:
        return load_medusa(directory)

    def export(self, head, output, opts: MedusaOptions, *, target, target_sha256, target_architectures, overwrite,
               extra_manifest, console) -> None:
        export_medusa(head, output, layout=opts.layout, target=target, target_sha256=target_sha256,
                      overwrite=overwrite, extra_manifest=extra_manifest)
        load_medusa(output)  # the written directory reads back with every tensor

    def card_title(self, manifest: dict) -> str:
        return f"{self.title} draft heads ({manifest.get('layout', 'vllm')} layout)"

    def card_lines(self, manifest, config, name, target, served) -> list[str]:
        medusa = manifest.get(self.name) or {}  # the manifest records the heads' config under the kind's name
        k = medusa.get("num_heads", config.get("num_heads"))
        lines = [f"{k} Medusa draft heads ({medusa.get('num_layers', 1)} residual block(s) each) for {target}, "
                 "trained with compound on the target's own hidden states. Each head proposes one more token; the "
                 "target verifies them, so the output is the target's own.", ""]
        if layout_of(config) != "vllm":
            lines += ["These are in FasterDecoding's layout (`medusa_lm_head.safetensors`). For vLLM, convert them: "
                      "`export_medusa(load_medusa(dir), out, layout='vllm')` (`toolkit.heads.medusa_export`).", ""]
        else:
            spec = json.dumps({"method": self.name, "model": name, "num_speculative_tokens": k},
                              separators=(",", ":"))
            lines += ["## Serve", "", "```bash", f"vllm serve {served} --speculative-config '{spec}'", "```", ""]
            if served == "TARGET":
                lines += ["TARGET: the Hub id or directory of the model the heads were trained for (above).", ""]
        return lines


MEDUSA = register(MedusaKind())
