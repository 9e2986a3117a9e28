"""The EAGLE kinds: ``eagle`` (EAGLE-1, drafting EAGLE-2 trees too) and ``eagle3`` (EAGLE-3), one decoder layer over
the target's hidden states (``toolkit.heads.eagle``), drafting a chain (vLLM's) or an EAGLE-2 dynamic tree (SGLang's)
(``toolkit.heads.eagle_draft``), exported in the EAGLE layout (``toolkit.heads.eagle_export``) and, for eagle3, in the
speculators layout as well (``toolkit.heads.speculators_export``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from toolkit.formats.checkpoint import MANIFEST
from toolkit.heads.eagle import EagleHead, draft_vocabulary, eagle3_loss, eagle_loss
from toolkit.heads.eagle_config import EAGLE1, EAGLE3, EagleConfig, check_family, default_aux_layers
from toolkit.heads.eagle_draft import EagleDrafter, TreeShape, eagle_decoder
from toolkit.heads.eagle_export import export_eagle, load_eagle, serving_flags
from toolkit.heads.kinds import Built, HeadKind, first_draft_labels, register
from toolkit.heads.options import EagleOptions
from toolkit.heads.speculators_export import (
    SUBDIR,
    export_speculators,
    is_speculators,
    is_speculators_config,
    load_speculators,
    vllm_verifier,
)


def eagle_shapes(tree: TreeShape, chain: int) -> list[tuple[str, TreeShape]]:
    """The shapes validation measures: ``tree`` (SGLang's dynamic tree), ``chain`` (vLLM's ``chain`` speculative
    tokens), and shorter and longer chains and a wider tree, to recommend the fastest."""
    shapes = [("tree", tree), ("chain", TreeShape(chain))]
    for k in sorted({max(1, chain - 1), chain + 1}):
        shapes.append((f"chain-{k}", TreeShape(k)))
    wide = TreeShape(tree.depth + 1, max(tree.top_k, 2), 2 * tree.nodes)  # a tree even when ``tree`` is a chain
    shapes.append(("tree-wide", wide))
    return shapes


def trained_shape(directory) -> tuple[TreeShape, int]:
    """(tree, chain length) an EAGLE head was selected with (its manifest's ``training.draft_shape``), else
    SGLang's Llama default tree (depth 5, top-4, 8 nodes) and vLLM's usual chain of 3."""
    manifest = Path(directory) / MANIFEST
    shape = json.loads(manifest.read_text()).get("training", {}).get("draft_shape") if manifest.is_file() else None
    if not shape:
        return TreeShape(5, 4, 8), 3
    return TreeShape(shape["depth"], shape["top_k"], shape["draft_tokens"]), shape["depth"]


def _loss_suffix(opts: EagleOptions) -> str:
    return "" if opts.loss == "kl" else f"-{opts.loss}"  # kl: the directory names of earlier runs


class EagleKind(HeadKind):
    """EAGLE-1: the final-norm state and the next token's embedding, logits through the target's ``lm_head``."""

    variant = EAGLE1
    name = variant.name
    title = "EAGLE-1/2"
    options = EagleOptions

    @property
    def signature(self) -> str:
        return f"{self.title}: architectures {self.variant.architectures[0]}"

    def describe(self, opts: EagleOptions) -> str:
        return f"an {self.name} head"

    def check_target(self, opts: EagleOptions, config, vocab_size: int) -> None:
        try:
            check_family(config.model_type, self.name)
        except ValueError as err:
            raise ValueError(f"--head {self.name} cannot draft for a {config.model_type} target: {err}; use --head "
                             "medusa") from None

    def train_dir(self, opts: EagleOptions) -> str:
        return f"train-{self.name}{_loss_suffix(opts)}"

    def build(self, opts: EagleOptions, target, examples, console) -> Built:
        head = EagleHead.from_target(target, self.name)
        return Built(head, lambda model, batch: eagle_loss(model, batch["hidden"], batch["input_ids"],
                                                           batch["loss_mask"], loss=opts.loss), first_draft_labels)

    def training_record(self, opts: EagleOptions) -> dict:
        return {"draft_shape": {"depth": opts.depth, "top_k": opts.top_k, "draft_tokens": opts.draft_tokens},
                "ttt_steps": None}

    def selection_shape(self, opts: EagleOptions, select_mode: str) -> TreeShape:
        return opts.shape(select_mode)

    def validation_shapes(self, head, directory, tree, chain, explore) -> list[tuple[str, TreeShape]]:
        trained_tree, trained_chain = trained_shape(directory)
        tree, chain = tree or trained_tree, chain or trained_chain
        return eagle_shapes(tree, chain) if explore else [("tree", tree), ("chain", TreeShape(chain))]

    def shape_label(self, shape: TreeShape) -> tuple[str, int]:
        return shape.describe(), shape.nodes

    def fit(self, head: EagleHead, target, target_name: str) -> EagleHead:
        return head.float().attach(target)

    def drafting(self, head, target, shape, max_len, draft_dtype):
        drafting = copy.deepcopy(head).to(draft_dtype).eval()  # engines draft in the serving dtype
        return eagle_decoder(target, max_len, head), EagleDrafter(drafting, shape.depth, shape.top_k,
                                                                  shape.total_tokens, max_len=max_len)

    def detects(self, config: dict) -> bool:
        return self.variant.architectures[0] in (config.get("architectures") or [])

    def load(self, directory: Path) -> EagleHead:
        return load_eagle(directory)

    def export(self, head, output, opts: EagleOptions, *, target, target_sha256, target_architectures, overwrite,
               extra_manifest, console) -> None:
        export_eagle(head, output, target=target, target_sha256=target_sha256, overwrite=overwrite,
                     extra_manifest=extra_manifest)
        load_eagle(output)

    def serving_lines(self, output: Path, opts: EagleOptions) -> list[str]:
        """vLLM's chain of the tree's depth (and the speculators layout, when written, that names its target
        itself), SGLang's chain and the tree the head was selected with."""
        tree = opts.tree
        flags = serving_flags(output, str(output), tree.depth, tree)
        lines = [f"serve it with vLLM (chain of {tree.depth}):", f"  vllm serve TARGET {flags['vllm']}"]
        if (output / SUBDIR).is_dir():
            lines.append(f"  vllm serve {output / SUBDIR}   # the same; its config names the target and chain")
        if "sglang" in flags:
            lines.append("with SGLang (chain, then the EAGLE-2 tree it was selected with):")
            lines += [f"  python -m sglang.launch_server --model-path TARGET {flags[key]}"
                      for key in ("sglang", "sglang_tree")]
        return lines

    def card_title(self, manifest: dict) -> str:
        return f"{self.title} draft head"

    def _card_what(self, config: EagleConfig) -> str:
        return f"An {self.title} draft head (one decoder layer over the target's last hidden state)"

    def card_lines(self, manifest, config, name, target, served) -> list[str]:
        head_config = EagleConfig.from_dict(manifest["eagle"])
        shape = (manifest.get("training") or {}).get("draft_shape") or {}
        flags = serving_flags(head_config, name, shape.get("depth", 3))
        lines = [f"{self._card_what(head_config)} for {target}, trained with compound on the target's own hidden "
                 "states. The target verifies every drafted token, so the output is the target's own.", "",
                 "## Serve", "", "```bash", f"vllm serve {served} {flags['vllm']}"]
        if "sglang" in flags:
            lines.append(f"python -m sglang.launch_server --model-path {served} {flags['sglang']}")
        lines += ["```", ""]
        if served == "TARGET":
            lines += ["TARGET: the Hub id or directory of the model the head was trained for (above).", ""]
        return lines


class Eagle3Kind(EagleKind):
    """EAGLE-3: ``fc`` over the target's aux layers, a draft vocabulary, the training-time test; also exported in
    the speculators layout (``OUTPUT/speculators``) when vLLM can load the target."""

    variant = EAGLE3
    name = variant.name
    title = "EAGLE-3"

    @property
    def signature(self) -> str:
        return f"{super().signature}, or a speculators config (speculators_config)"

    def check_target(self, opts: EagleOptions, config, vocab_size: int) -> None:
        super().check_target(opts, config, vocab_size)
        opts.check_target(config.num_hidden_layers, vocab_size)

    def hidden_layers(self, opts: EagleOptions, num_layers: int) -> list[int]:
        return [*(opts.aux_layers or default_aux_layers(num_layers)), -1]

    def train_dir(self, opts: EagleOptions) -> str:
        layers = "-".join(map(str, opts.aux_layers)) if opts.aux_layers else "default"
        return f"train-{self.name}-l{layers}-v{opts.draft_vocab}-s{opts.ttt_steps}{_loss_suffix(opts)}"

    def build(self, opts: EagleOptions, target, examples, console) -> Built:
        V = target.get_output_embeddings().weight.shape[0]
        vocab, covered = draft_vocabulary([e.input_ids[e.loss_mask] for e in examples], V, opts.draft_vocab)
        console.print(f"draft vocabulary: {len(vocab):,} of {V:,} target tokens, covering {covered:.1%} of the "
                      f"trained labels")
        head = EagleHead.from_target(target, self.name, opts.aux_layers, vocab)
        lm_head = target.get_output_embeddings().weight

        def loss(model, batch):
            return eagle3_loss(model, batch["hidden"], batch["input_ids"], batch["loss_mask"], lm_head,
                               opts.ttt_steps, loss=opts.loss)

        in_vocab = head.t2d.detach().cpu()  # count sees the batches before they move to the training device

        def count(batch):  # eagle3_loss trains only labels in the draft vocabulary
            return int((in_vocab[batch["input_ids"]] & batch["loss_mask"])[:, 2:].sum())

        return Built(head, loss, count)

    def training_record(self, opts: EagleOptions) -> dict:
        return super().training_record(opts) | {"ttt_steps": opts.ttt_steps}

    def detects(self, config: dict) -> bool:
        return super().detects(config) or is_speculators_config(config)

    def load(self, directory: Path) -> EagleHead:
        return load_speculators(directory) if is_speculators(directory) else load_eagle(directory)

    def export(self, head, output, opts: EagleOptions, *, target, target_sha256, target_architectures, overwrite,
               extra_manifest, console) -> None:
        super().export(head, output, opts, target=target, target_sha256=target_sha256,
                       target_architectures=target_architectures, overwrite=overwrite,
                       extra_manifest=extra_manifest, console=console)
        try:  # and the layout `vllm serve OUTPUT/speculators` serves without flags
            verifier = vllm_verifier(target)
        except ValueError as err:
            console.print(f"no speculators layout: {err}")
            return
        export_speculators(head, output / SUBDIR, verifier=verifier, verifier_architectures=target_architectures,
                           speculative_tokens=opts.depth, target=target, target_sha256=target_sha256,
                           extra_manifest=extra_manifest)
        load_speculators(output / SUBDIR)

    def _card_what(self, config: EagleConfig) -> str:
        return (f"An {self.title} draft head (one decoder layer over the target's hidden states "
                f"{list(config.aux_layers)}, a {config.draft_vocab_size}-token draft vocabulary)")


EAGLE = register(EagleKind())
EAGLE3 = register(Eagle3Kind())
