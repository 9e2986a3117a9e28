"""Publishing an artifact to the Hugging Face Hub: its model card, and one all-or-nothing commit.

An artifact is a directory compound wrote with a ``compound.json`` manifest (``toolkit.formats.checkpoint``): a
quantized checkpoint (``config.json`` with ``quantization_config``), Medusa heads (``"format": "medusa"``) or an EAGLE
head (``"format": "eagle"``).
``push`` uploads exactly the bytes the manifest hashed, plus a generated ``README.md`` (and ``acceptance.png`` when
acceptance was measured), as a single ``create_commit``: the Hub moves the branch only when every file is stored, so
a failure leaves the repo as it was, and rerunning the push retries (LFS objects already stored are not re-sent).

Nothing local is published: the files compound writes with names in them (``NAMING_FILES``) go up with every local
path cut to its last component (``/home/me/models/llama`` → ``llama``; the manifest then hashes the bytes uploaded),
and so do the card's results (a recipe's ``compound run /home/me/r.yaml`` → ``compound run r.yaml``); the files on
disk are not changed.

The ``HfApi`` is passed in; its token (``HfApi(token=...)``, ``HF_TOKEN`` or ``hf auth login``) is the only one
used, and it is never printed or written.

``results`` (optional, all measured; the card shows only what is given):

| key | content | written by |
|---|---|---|
| ``divergence`` | ``kl``, ``top1_agreement``, ``perplexity``, ``base_perplexity``, ``tokens`` [, ``dataset``, ``windows``, ``seq_len``] | ``toolkit.evaluate.divergence`` |
| ``eval`` | an ``eval.json`` report (schema ``compound.eval/1``, docs/usage.md "Evaluation report"); ``--results`` may name an ``eval.json`` itself | ``compound eval``, ``compound run`` |
| ``acceptance`` | ``[{"mode", "shape", "nodes", "mean_accepted_length", "acceptance_rate", "speculative_tokens_per_s", ...}]`` | ``compound validate --heads --json`` |
| ``heads_eval`` | the same reports keyed by mode | ``compound run`` |
| ``gates`` | the thresholds checked, as lines of text | ``compound run`` |
| ``command`` | the exact command line(s) that produced the artifact and the numbers | the caller |

Any other key is shown in a table of its numbers and strings.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import yaml

from toolkit.evaluate.report import SCHEMA, generation_lines, slice_lines
from toolkit.formats.checkpoint import MANIFEST
from toolkit.models import EMBEDDED

CARD = "README.md"
PLOT = "acceptance.png"
# Files an engine may load as weights: one left from an earlier push could shadow the new ones (vLLM follows a
# stale model.safetensors.index.json), so push deletes those the new artifact lacks.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".gguf")
RESULT_KEYS = ("divergence", "eval", "acceptance", "heads_eval", "gates", "command")
# Files of an artifact in which compound writes names (the model, dataset, target, conversion source; a
# FasterDecoding-layout Medusa config names its target): push uploads them with local paths cut. The other files come
# from transformers (tokenizer, generation config), which writes no path into them.
NAMING_FILES = (MANIFEST, "config.json")
# A word of free text that may be a path: what lies between spaces, quotes and brackets.
_WORD = re.compile(r"[^\s'\"`|,;()\[\]{}<>=]+")


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
    plot = _acceptance_png(_acceptance(results))
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
    kind, _ = _describe(directory)
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


def model_card(directory: Path | str, results: dict | None = None, *, repo_id: str | None = None,
               tags: tuple[str, ...] | list[str] = ()) -> str:
    """``README.md`` for the artifact in ``directory``: YAML front matter the Hub reads (base model, tags, library,
    pipeline), what it is, how to serve it (with ``repo_id``, else the directory name) and tables of ``results``
    (local paths in them cut to their last component)."""
    directory = Path(directory)
    kind, is_heads = _describe(directory)
    head_kind = _head_kind(directory)
    source = json.loads((directory / MANIFEST).read_text()).get("target" if is_heads else "model")
    base = _base_model(source) if source else None  # the model itself, not its published name, tells its base
    manifest, results = published(directory)[0], _public(results)  # what the card shows names no local path
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    name = repo_id or directory.name
    meta: dict = {}
    if base:
        meta["base_model"] = base
    if is_heads:
        meta["tags"] = _unique(["compound", head_kind.name, "speculative-decoding", *tags])
    else:
        quant = manifest.get("quantization") or {}
        method = (config.get("quantization_config") or {}).get("quant_method")
        bits = quant.get("bits")
        if base:
            meta["base_model_relation"] = "quantized"
        meta["library_name"] = "transformers"
        meta["pipeline_tag"] = "text-generation"
        gguf = "gguf" if _gguf_files(manifest) else None  # the Hub lists GGUF repos by this tag
        meta["tags"] = _unique(["compound", method, quant.get("method"), f"{bits}-bit" if bits else None, gguf,
                                *tags])
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {name.split('/')[-1]}", ""]
    lines += _heads_body(head_kind, manifest, config, name, base, source) if is_heads else \
        _checkpoint_body(manifest, config, name, base, source, kind)
    lines += _results_body(results)
    lines += ["## Files", "", f"`{MANIFEST}` holds the SHA-256 of every file (`compound validate` checks them).", "",
              "| file | SHA-256 |", "|---|---|"]
    lines += [f"| `{file}` | `{digest}` |" for file, digest in manifest.get("files", {}).items()]
    return "\n".join(lines) + "\n"


def published(directory: Path | str) -> tuple[dict, dict[str, bytes]]:
    """(the manifest as pushed, {file name: bytes uploaded instead of the file on disk}): each of ``NAMING_FILES``
    that names a local path, rewritten with the path cut to its last component, the manifest hashing the rewritten
    bytes. The files on disk are left as they are."""
    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    files = manifest.get("files", {})
    rewritten = {}
    for name in NAMING_FILES[1:]:
        raw = json.loads((directory / name).read_text()) if name in files else None
        if (scrubbed := _public(raw)) != raw:
            rewritten[name] = (json.dumps(scrubbed, indent=2) + "\n").encode()
    hashes = {name: hashlib.sha256(data).hexdigest() for name, data in rewritten.items()}
    public = {**_public(manifest), "files": {**files, **hashes}}
    if public != manifest:
        rewritten[MANIFEST] = (json.dumps(public, indent=2) + "\n").encode()
    return public, rewritten


def _public(value):
    """``value`` (parsed JSON) with every local path in it, whole or inside text, cut to its last component."""
    if isinstance(value, dict):
        return {key: _public(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_public(item) for item in value]
    if isinstance(value, str):
        return _display(value) if _is_local_path(value) else _WORD.sub(lambda word: _display(word.group()), value)
    return value


def _is_local_path(text: str) -> bool:
    """Whether ``text`` names a place on this machine (absolute, home- or dot-relative, or an existing relative
    path) by more than its last component."""
    path = Path(text)
    anchored = text.startswith(("/", "~/", "./", "../")) or ("/" in text and path.exists())
    return anchored and path.name not in ("", text)


def _head_kind(directory: Path):
    """The head kind of ``directory`` (``toolkit.heads.load.detect_head``), None for a checkpoint."""
    from toolkit.heads.load import detect_head  # torch loads for heads only when a card is made

    return detect_head(directory)


def _describe(directory: Path) -> tuple[str, bool]:
    """(a few words naming the artifact, whether it is draft heads)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    head_kind = _head_kind(directory)
    if head_kind is not None:
        return head_kind.card_title(manifest), True
    quant = manifest.get("quantization") or {}
    method = str(quant.get("method", "")).upper()
    return f"{quant.get('bits', '?')}-bit {method} checkpoint ({manifest.get('format')})", False


def _checkpoint_body(manifest: dict, config: dict, name: str, base: str | None, source, kind: str) -> list[str]:
    quant = manifest.get("quantization") or {}
    calib = manifest.get("calibration") or {}
    kv = manifest.get("kv_cache") or {}
    rows = [("method", quant.get("method")), ("format", manifest.get("format")), ("bits", quant.get("bits")),
            ("group size", quant.get("group_size")), ("symmetric", quant.get("sym")),
            ("left unquantized", ", ".join(quant.get("skip", [])) or None),
            ("calibration", f"{calib['samples']} × {calib['seq_len']} tokens of {calib['dataset']}, "
                            f"seed {calib['seed']}"
             if {"samples", "seq_len", "dataset", "seed"} <= calib.keys() else None),
            ("calibration fingerprint", calib.get("fingerprint")),
            ("KV-cache scales", f"{kv.get('dtype')}, per {kv.get('strategy')}" if kv else None),
            ("dtype of unquantized tensors", config.get("torch_dtype")),
            *[("GGUF for llama.cpp", f"`{file}`: the same codes as {file.rpartition('-')[2].removesuffix('.gguf')} "
                                     "blocks, Q8_0 embeddings") for file in _gguf_files(manifest)],
            ("compound version", manifest.get("compound_version"))]
    dtype = f" --dtype {config['torch_dtype']}" if config.get("torch_dtype") else ""
    llama_cpp = [f"llama-server -hf {name}:{file.rpartition('-')[2].removesuffix('.gguf')}"
                 for file in _gguf_files(manifest)]
    return [f"A {kind} of {_link(base, source)}, made with compound. vLLM, SGLang and transformers read it; "
            "engines detect the quantization from `config.json`.", "",
            "## Quantization", "", "| setting | value |", "|---|---|",
            *[f"| {key} | {_fmt(value)} |" for key, value in rows if value is not None], "",
            "## Serve", "", "```bash", f"vllm serve {name}{dtype}", *llama_cpp, "```", ""]


def _gguf_files(manifest: dict) -> list[str]:
    """The GGUF files a checkpoint carries beside its safetensors (``compound quantize --gguf``)."""
    return sorted(file for file in manifest.get("files", {}) if file.endswith(".gguf"))


def _heads_body(head_kind, manifest: dict, config: dict, name: str, base: str | None, source) -> list[str]:
    training = manifest.get("training") or {}
    quantized_target = bool(source) and (Path(str(source)).expanduser() / MANIFEST).is_file()
    target = f"a compound checkpoint of {_link(base, source)}" if quantized_target else _link(base, source)
    served = base if base and not quantized_target else "TARGET"
    lines = head_kind.card_lines(manifest, config, name, target, served)
    if training:
        rows = [(key.replace("_", " "), training.get(key)) for key in
                ("examples", "tokens", "trained_tokens", "steps", "best_step", "select_mode", "self_distill")]
        rows += [(f"at best step: {key.replace('_', ' ')}", value)
                 for key, value in (training.get("best_metrics") or {}).items()]
        lines += ["## Training", "", "Measured by compound while training (selection prompts, its decode loop).", "",
                  "| measure | value |", "|---|---|", *[f"| {key} | {_fmt(v)} |" for key, v in rows if v is not None],
                  ""]
    return lines


def _results_body(results: dict | None) -> list[str]:
    if not results:
        return ["## Results", "", "No measurements were published with this artifact.", ""]
    source = "; the commands under Reproduce produced them" if results.get("command") else ""
    lines = ["## Results", "", f"Measured, not estimated{source}.", ""]
    if quality := _quality(results):
        where = f" on {quality['windows']}×{quality['seq_len']} held-out tokens of {quality['dataset']}" \
            if {"windows", "seq_len", "dataset"} <= quality.keys() else ""
        names = {"perplexity": "perplexity", "base_perplexity": "base perplexity",
                 "perplexity_ratio": "perplexity / base perplexity", "perplexity_increase": "perplexity − base",
                 "kl": "KL(base ‖ this), nats/token", "top1_agreement": "top-1 agreement with base",
                 "tokens": "tokens compared"}
        lines += [f"### Quality against the base model{where}", "", "| measure | value |", "|---|---|",
                  *[f"| {label} | {_fmt(quality[key])} |" for key, label in names.items() if key in quality], ""]
    if (report := results.get("eval")) and report.get("base"):
        lines += [f"### By slice of held-out text (`compound eval`, up to {report['windows_per_slice']}×"
                  f"{report['seq_len']} tokens per slice)", "", *slice_lines(report), ""]
    if report and report.get("generation"):
        lines += ["### Generation checks (greedy; JSON must parse, Python must compile, facts must match)", "",
                  *generation_lines(report), ""]
    if reports := _acceptance(results):
        lines += ["### Speculative decoding", "", "Accepted length: tokens per target forward (the target's own "
                  "token included). Acceptance at depth d: P(depth d accepted | depth d − 1 accepted). Break-even "
                  "length: the accepted length at which a step (draft + verify) costs what greedy decoding takes "
                  "for one token on the machine that measured it.", "",
                  "| mode | draft nodes | accepted length | acceptance per depth | tokens/s | greedy tokens/s | "
                  "speedup | break-even length | lossless |", "|---|---:|---:|---|---:|---:|---:|---:|---|"]
        for r in reports:
            speedup = f"{r['speedup']:.2f}×" if isinstance(r.get("speedup"), (int, float)) else "–"
            cells = [r.get("mode"), r.get("nodes") or "–", r.get("mean_accepted_length"),
                     " ".join(f"{a:.2f}" for a in r["acceptance_rate"]), r.get("speculative_tokens_per_s", "–"),
                     r.get("greedy_tokens_per_s", "–"), speedup, r.get("break_even_accepted_length", "–"),
                     r.get("lossless", "–")]
            lines.append("| " + " | ".join(_fmt(cell) for cell in cells) + " |")
        lines += ["", f"![acceptance per draft depth]({PLOT})", "",
                  "Acceptance per draft depth: one group of bars per depth (depth 1 at the left), one bar per mode in "
                  "the table's order; gridlines at 0.25, 0.5, 0.75 and 1.", ""]
    if gates := results.get("gates"):
        lines += ["### Gates", "", *[f"- {_fmt(gate)}" for gate in gates], ""]
    if flat := _flatten({key: value for key, value in results.items() if key not in RESULT_KEYS}):
        lines += ["### Other measurements", "", "| measure | value |", "|---|---|",
                  *[f"| {key} | {_fmt(value)} |" for key, value in flat], ""]
    if command := results.get("command"):
        lines += ["### Reproduce", "", "```bash", *([command] if isinstance(command, str) else command), "```", ""]
    return lines


def card_results(raw: dict) -> dict:
    """Results for ``model_card``/``push`` from a results file: one keyed as above, or an ``eval.json`` alone."""
    return {"eval": raw} if raw.get("schema") == SCHEMA else raw


def _quality(results: dict) -> dict | None:
    """Quality against the base, from ``divergence`` (Divergence fields) or an ``eval`` report's total."""
    if raw := results.get("divergence"):
        return raw
    report = results.get("eval")
    if not report or not report.get("base"):
        return None
    overall = report["overall"]
    return {**overall, "perplexity_increase": overall["perplexity"] - overall["base_perplexity"],
            "dataset": report["dataset"], "windows": overall["windows"], "seq_len": report["seq_len"]}


def _acceptance(results: dict | None) -> list[dict]:
    """Acceptance reports with a per-depth acceptance, from ``acceptance`` (a list) or ``heads_eval`` (by mode)."""
    raw = (results or {}).get("acceptance") or (results or {}).get("heads_eval") or []
    reports = [{"mode": mode, **report} for mode, report in raw.items()] if isinstance(raw, dict) else list(raw)
    return [r for r in reports if r.get("acceptance_rate")]


def _acceptance_png(reports: list[dict]) -> bytes | None:
    """A bar chart of acceptance per draft depth (one group per depth, one bar per report), as PNG bytes.

    Drawn by hand (RGB rows, zlib, CRC) so the card needs no plotting library; the axis is fixed at [0, 1].
    """
    if not reports:
        return None
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    depths = max(len(r["acceptance_rate"]) for r in reports)
    bar, gap, margin, plot_h = 14, 14, 10, 160
    width = 2 * margin + depths * (len(reports) * bar + gap)
    height = plot_h + 2 * margin
    rows = [bytearray(b"\xff" * 3 * width) for _ in range(height)]
    for level in (0.25, 0.5, 0.75, 1.0):
        rows[margin + round(plot_h * (1 - level))][3 * margin:3 * (width - margin)] = b"\xdd" * 3 * (width - 2 * margin)
    for d in range(depths):
        for m, report in enumerate(reports):
            rate = report["acceptance_rate"][d] if d < len(report["acceptance_rate"]) else 0.0
            x0 = margin + gap // 2 + d * (len(reports) * bar + gap) + m * bar
            top = margin + round(plot_h * (1 - min(max(rate, 0.0), 1.0)))
            for y in range(top, margin + plot_h):
                rows[y][3 * x0:3 * (x0 + bar - 2)] = bytes(colors[m % len(colors)]) * (bar - 2)
    rows[margin + plot_h][3 * margin:3 * (width - margin)] = b"\x00" * 3 * (width - 2 * margin)  # x axis

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    pixels = zlib.compress(b"".join(b"\x00" + bytes(row) for row in rows), 9)  # filter type 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def _base_model(spec: str, follow: bool = True) -> str | None:
    """The Hub id a model spec stands for: an alias's source model, a Hub id as is, a compound checkpoint's own
    base (one level), else None (a local file the Hub cannot link)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if spec in EMBEDDED:
        return EMBEDDED[spec].source
    path = Path(spec).expanduser()
    if follow and (path / MANIFEST).is_file():
        inner = json.loads((path / MANIFEST).read_text()).get("model")
        return _base_model(inner, follow=False) if isinstance(inner, str) else None
    if path.exists() or spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") != 1:
        return None
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return None
    return spec


def _link(base: str | None, source) -> str:
    if base:
        return f"[{base}](https://huggingface.co/{base})"
    return f"`{_display(source)}` (local files)" if source else "an unnamed model"


def _display(spec) -> str:
    """A model spec as the card shows it: local paths by their last component only (no directory layout leaks)."""
    text = str(spec)
    return Path(text).name if _is_local_path(text) else text


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flatten(value, f"{name}.")
        elif isinstance(value, (str, int, float, bool)):
            out.append((name, value))
    return out


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return re.sub(r"[|\n]", " ", str(value))


def _unique(items) -> list[str]:
    return list(dict.fromkeys(str(item) for item in items if item))


def _status(err) -> str:
    response = getattr(err, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(err).__name__
