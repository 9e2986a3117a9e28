"""What a user sets for ``compound push``, declared once with ``toolkit.options.option``: the CLI flags and the
recipe's ``push`` section (``toolkit.recipes.schema.PushSection``) are derived from these fields."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.options import option


@dataclass(frozen=True)
class PushOptions:
    """Where an artifact goes on the Hub and how the commit is made (``toolkit.hub.push`` takes each)."""

    repo: str = option(help="Hub repo id, namespace/name; created when missing.")
    private: bool = option(False, "Create the repo private (an existing repo keeps its visibility).",
                           flag="--private")
    revision: str | None = option(None, "Branch to commit to (created from main when missing); default main.")
    tags: tuple[str, ...] = option((), "Extra model-card tag; repeatable.", aliases=("--tag",))
    commit_message: str | None = option(None, "The commit's message (default: \"Upload <checkpoint or heads> with "
                                           "compound\"; a recipe's: \"compound run <recipe>\").")
