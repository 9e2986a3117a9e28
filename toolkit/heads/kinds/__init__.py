"""The head registry: each kind of draft head (``medusa``, ``eagle`` for EAGLE-1/2, ``eagle3``) is one ``HeadKind``,
registered here once, that declares everything the rest of compound asks of a kind:

* what it is: ``name`` (the ``--head`` value), ``title`` (in words), ``options`` (the option dataclass it reads);
* training: ``check_target``, ``hidden_layers``, ``train_dir``, ``build`` (the new head, its loss and its label
  count), ``training_record`` (what the manifest records of its training);
* evaluation: ``selection_shape`` and ``validation_shapes`` (the draft shapes measured), ``shape_label``, ``fit``
  (a loaded head made ready for a target) and ``drafting`` (the decoder and drafter of compound's loop);
  ``toolkit.evaluate.acceptance.measure_head`` measures any kind through these;
* on disk: ``detects`` (its ``config.json``), ``load``, ``export`` (its layouts, read back), ``serving_lines`` and
  the model card's ``card_title`` / ``card_lines``.

``KINDS`` maps names to kinds in registration order (the first is ``--head``'s default). ``toolkit.heads.load`` is
the one place that tells head directories apart, by asking each kind's ``detects``. Adding a kind means a module
here (imported at the end of this file), never a branch on a kind's name elsewhere (tests/heads/test_kinds.py
checks that no module outside this package compares a value with a kind's name).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from torch import nn

from toolkit.decode import Decoder, Drafter

Loss = Callable[[nn.Module, dict], Any]  # (head, batch) -> (loss sum, label count, metrics)


class Built(NamedTuple):
    """A new head for a target, with its training loss and ``count``: the labels a batch trains (its first draft)."""

    head: nn.Module
    loss: Loss
    count: Callable[[dict], int]


def first_draft_labels(batch: dict) -> int:
    """Labels the first draft sees: the first two positions have no hidden state 2 tokens earlier."""
    return int(batch["loss_mask"][:, 2:].sum())


class HeadKind:
    """One kind of draft head; subclasses implement every method (see the module docstring)."""

    name: str
    title: str
    options: type  # the option dataclass of ``toolkit.heads.options`` this kind reads
    signature: str  # what ``detects`` looks for in a ``config.json``, for the refusal of an unknown directory

    def describe(self, opts) -> str:
        """A few words naming the heads ``opts`` describe ("4 medusa heads")."""
        raise NotImplementedError

    def check_target(self, opts, config, vocab_size: int) -> None:
        """Refuse, from the target's config and vocabulary size alone, what it cannot serve with these heads."""

    def hidden_layers(self, opts, num_layers: int) -> list[int]:
        """The target hidden states the head trains on: the final-norm state (-1) unless the kind reads more."""
        return [-1]

    def train_dir(self, opts) -> str:
        """The name of the training directory of this head shape (runs of other shapes share the data)."""
        raise NotImplementedError

    def build(self, opts, target: nn.Module, examples, console: Console) -> Built:
        """A new head for ``target`` trained on ``examples``, its loss and label count."""
        raise NotImplementedError

    def training_record(self, opts) -> dict:
        """What the manifest's ``training`` records of this kind beyond what every kind records."""
        return {}

    def selection_shape(self, opts, select_mode: str):
        """The draft shape checkpoints are selected on in ``select_mode`` (tree | chain)."""
        raise NotImplementedError

    def validation_shapes(self, head: nn.Module, directory: Path, tree, chain: int | None,
                          explore: bool) -> list[tuple[str, Any]]:
        """(mode, draft shape) measured by ``compound validate --heads`` of ``head`` read from ``directory``;
        ``tree``/``chain``: the user's EAGLE shapes, ``explore``: neighbouring shapes too."""
        raise NotImplementedError

    def shape_label(self, shape) -> tuple[str, int]:
        """(the shape in words, the draft tokens verified per step)."""
        raise NotImplementedError

    def fit(self, head: nn.Module, target: nn.Module, target_name: str) -> nn.Module:
        """A loaded ``head`` in float32, ready to draft for ``target``; refuses a target it does not fit."""
        raise NotImplementedError

    def drafting(self, head: nn.Module, target: nn.Module, shape, max_len: int,
                 draft_dtype: torch.dtype) -> tuple[Decoder, Drafter]:
        """The decoder over ``target`` and the drafter (a copy of ``head`` in ``draft_dtype``) that draft ``shape``
        in compound's loop, for sequences up to ``max_len``."""
        raise NotImplementedError

    def detects(self, config: dict) -> bool:
        """Whether a head directory's ``config.json`` (parsed) is this kind's."""
        raise NotImplementedError

    def load(self, directory: Path) -> nn.Module:
        """The head (float32, not attached) of a directory this kind ``detects``, every tensor checked."""
        raise NotImplementedError

    def export(self, head: nn.Module, output: Path, opts, *, target: str, target_sha256: str | None,
               target_architectures: list[str], overwrite: bool, extra_manifest: dict, console: Console) -> None:
        """Write ``head`` to ``output`` in this kind's layouts and read each back."""
        raise NotImplementedError

    def serving_lines(self, output: Path, opts) -> list[str]:
        """What ``compound train-heads`` prints after export: how to serve the heads in ``output``."""
        return []

    def card_title(self, manifest: dict) -> str:
        """A few words naming the heads of ``manifest`` on a model card."""
        raise NotImplementedError

    def card_lines(self, manifest: dict, config: dict, name: str, target: str, served: str) -> list[str]:
        """The model card's text on what the heads are and how to serve them (repo ``name``, ``target`` as a
        link, ``served`` the model id to serve them with, or TARGET)."""
        raise NotImplementedError


KINDS: dict[str, HeadKind] = {}


def register(kind: HeadKind) -> HeadKind:
    """Add ``kind`` to ``KINDS``; refuses a second kind of the same name."""
    if kind.name in KINDS:
        raise ValueError(f"head kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def kind_named(name: str) -> HeadKind:
    """The registered kind ``name``; a clear error naming the others."""
    if name not in KINDS:
        raise ValueError(f"--head {name!r} is not supported; choose one of {', '.join(KINDS)}")
    return KINDS[name]


# Last, because each kind module registers its kinds with ``register`` above when imported; Medusa first: the default.
from toolkit.heads.kinds import medusa, eagle  # noqa: E402,F401,I001
