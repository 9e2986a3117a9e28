"""Publishing an artifact to the Hugging Face Hub: its model card, and one all-or-nothing commit.

An artifact is a directory compound wrote with a ``compound.json`` manifest (``toolkit.formats.checkpoint``): a
quantized checkpoint (``config.json`` with ``quantization_config``), Medusa heads (``"format": "medusa"``) or an EAGLE
head (``"format": "eagle"``).
``push`` uploads exactly the bytes the manifest hashed, plus a generated ``README.md`` (and ``acceptance.png`` when
acceptance was measured), as a single ``create_commit``: the Hub moves the branch only when every file is stored, so
a failure leaves the repo as it was, and rerunning the push retries (LFS objects already stored are not re-sent).

Nothing local is published: the files compound writes with names in them (``toolkit.published.NAMING_FILES``) go up with every local
path cut to its last component (``/home/me/models/llama`` → ``llama``; the manifest then hashes the bytes uploaded),
and so do the card's results (a recipe's ``compound run /home/me/r.yaml`` → ``compound run r.yaml``); the files on
disk are not changed.

The ``HfApi`` is passed in; its token (``HfApi(token=...)``, ``HF_TOKEN`` or ``hf auth login``) is the only one
used, and it is never printed or written.

``results``: measured numbers for the card, keyed as ``toolkit.model_card`` documents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from toolkit.formats.checkpoint import MANIFEST
from toolkit.model_card import PLOT, acceptance_chart, acceptance_reports, describe, model_card
from toolkit.published import published

CARD = "README.md"
# Files an engine may load as weights: one left from an earlier push could shadow the new ones (vLLM follows a
# stale model.safetensors.index.json), so push deletes those the new artifact lacks.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".gguf")


class HubError(RuntimeError):
    """A push refused before upload, or one that failed without committing anything."""


@dataclass(frozen=True)
class PushResult:
    """Where the artifact went: the repo URL, the commit that holds it, and the files in that commit."""

    repo_url: str
    commit_oid: str
    files: list[str]


def push(api, directory: Path | str, repo_id: str, *, private: bool = False, revision: str | None = None,
         tags: tuple[str, ...] | list[str] = (), commit_message: str | None = None,
         results: dict | None = None) -> PushResult:
    """Upload the artifact in ``directory`` with its model card to ``repo_id`` (``namespace/name``) as one commit.

    Steps: 1. check the repo id and the artifact's hashes (no request yet); 2. check the client has a token
    (``whoami``); 3. write the card, and the files that name local paths without them (``published``); 4. create
    the repo (an existing one is kept) and the branch ``revision`` (created from main when missing); 5. one commit:
    every file of the manifest, the manifest, the card (and the plot), deleting weight files left there by an earlier
    push that this artifact lacks.

    private: create the repo private (otherwise the namespace's default; an existing repo keeps its visibility).
    revision: the branch to commit to (default main). tags: extra card tags. results: measured numbers for the card
    (module docstring). Raises ``HubError`` with what to do.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
    from huggingface_hub.utils import validate_repo_id

    directory = Path(directory)
    try:  # 1
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1:
            raise HFValidationError("the namespace (user or organization) is missing.")
    except HFValidationError as err:
        raise HubError(f"invalid repo id {repo_id!r}: {err} Use namespace/name, e.g. "
                       "my-org/SmolLM2-135M-GPTQ-4bit") from None
    files = artifact_files(directory)
    try:  # 2
        account = api.whoami()
    except LocalTokenNotFoundError:
        raise HubError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass HfApi(token=...); "
                       "nothing was sent") from None
    except HfHubHTTPError as err:
        raise HubError(f"the Hub refused the token ({_status(err)}): check it is valid and has write access") from None
    except Exception as err:  # the HTTP library's own errors: connection refused, DNS, TLS, timeout
        raise HubError(f"cannot reach the Hub at {api.endpoint} ({type(err).__name__}: {err}); nothing was uploaded. "
                       "Check the network, or HF_ENDPOINT.") from err
    if (account.get("auth", {}).get("accessToken") or {}).get("role") == "read":
        raise HubError("the token is read-only: create one with write access and set HF_TOKEN to it")
    card = model_card(directory, results, repo_id=repo_id, tags=tags)  # 3
    _, public = published(directory)  # what goes up instead of the files that name local paths
    plot = acceptance_chart(acceptance_reports(results))
    try:  # 4
        repo = api.create_repo(repo_id, private=private or None, exist_ok=True)  # None: the namespace's default
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        existing = api.list_repo_files(repo_id, revision=revision)
    except Exception as err:  # HTTP refusals and the HTTP library's network errors alike
        raise HubError(f"could not create or read {repo_id} on the Hub ({_status(err)}): {err}; nothing was "
                       "uploaded") from err
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=public.get(name, str(directory / name)))
                  for name in files]
    operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    if plot is not None:
        operations.append(CommitOperationAdd(path_in_repo=PLOT, path_or_fileobj=plot))
    stale = [name for name in existing if name.endswith(WEIGHT_SUFFIXES) and name not in files]
    operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
    kind, _ = describe(directory)
    try:  # 5
        commit = api.create_commit(repo_id, operations, revision=revision,
                                   commit_message=commit_message or f"Upload {kind} with compound",
                                   commit_description=f"{MANIFEST} lists the SHA-256 of every file.")
    # Any failure here (HTTP, transfer, network) happened before the Hub moved the branch: say so, and how to retry.
    except Exception as err:
        cause = f" ({_status(err.__cause__)})" if err.__cause__ is not None else ""
        raise HubError(f"push to {repo_id}@{revision or 'main'} failed: {err}{cause} Nothing was committed (the upload "
                       "is one all-or-nothing commit); rerun the same push to retry: files the Hub already "
                       "stored are not sent again.") from err
    uploaded = [*files, CARD] + ([PLOT] if plot is not None else [])
    return PushResult(repo_url=str(repo), commit_oid=commit.oid, files=uploaded)


def artifact_files(directory: Path) -> list[str]:
    """The files of a compound artifact to publish: every file its manifest hashes, then the manifest; refuses a
    directory without a manifest, or one whose files changed or went missing since it was written."""
    from toolkit.formats.checkpoint import verify_manifest

    if not (directory / MANIFEST).is_file():
        raise HubError(f"{directory} has no {MANIFEST}: push publishes directories compound wrote "
                       "(compound quantize / train-heads), whose manifest hashes every file")
    changed = verify_manifest(directory)
    if changed:
        raise HubError(f"{directory}: {', '.join(changed)} changed or went missing since compound wrote it (SHA-256 "
                       f"differs from {MANIFEST}); nothing was uploaded. Re-create the artifact.")
    return [*json.loads((directory / MANIFEST).read_text()).get("files", {}), MANIFEST]


def _status(err) -> str:
    response = getattr(err, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(err).__name__
