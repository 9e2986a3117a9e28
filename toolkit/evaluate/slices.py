"""Held-out data by slice: prose, code, non-English, structured, so a model that breaks on one kind of text shows it.

A record belongs to exactly one slice, tested in this order (the first that matches wins):

1. ``code``: a code fence (```), or at least ``CODE_LINES`` lines that read as code (a statement keyword at the start
   of the line, or a line ending in ``;``, ``{`` or ``}``), for prompts that paste code without fences;
2. ``structured``: a markdown table (a ``|---|---|`` separator row) or JSON (at least two ``"key": value`` pairs);
3. ``non-english``: under 70 % of the letters are ASCII (other scripts), or the text has at least ``MIN_WORDS`` words
   with more common Spanish/French/German/Italian/Portuguese function words than English ones, at least 10 % of the
   words (Latin-script languages; keyword lists and base64 have neither and stay prose);
4. ``prose``: everything else.

Each slice's records are rendered (chat template) and packed into windows of their own, so the windows of a slice
hold only that slice's text, and the slices' predicted-token counts add up to the total.
"""

from __future__ import annotations

import re
import torch

from toolkit.calibration.render import Renderer
from toolkit.calibration.sources import SHAREGPT, Record, load_records
from toolkit.calibration.splits import iter_split

SLICES = ("prose", "code", "non-english", "structured")
CODE_LINES = 2
MIN_WORDS = 12
RECORD_WINDOWS = 2  # windows' worth of tokens one record may give its slice: long chats do not fill it alone
_FENCE = "```"
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from [\w.]+ import |#include|public |private |function |const |let |var |return\b|"
    r"SELECT |for \(|if \(|while \(|console\.log)|[;{}]\s*$", re.MULTILINE)
_TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)+\|?\s*$", re.MULTILINE)
_JSON_PAIR = re.compile(r'"[^"\n]{1,80}"\s*:\s*["\d\[{tfn-]')
_WORD = re.compile(r"[^\W\d_]+")
_ENGLISH = frozenset(
    "the a an and or of to in on for with is are was were be been it this that these those you your i we they he she "
    "what how why which who can could would should will do does did not have has had my me our as at by from if "
    "about there their them so but".split())
_OTHER = frozenset(  # Spanish, French, German, Italian, Portuguese function words that are not English words
    "el la los las del que y en un una es por para con se lo al como más pero su le les des et est une pour dans "
    "qui pas sur du au ce il vous nous der die das und ist nicht mit ein eine zu den dem sie ich es auf für von "
    "di che non per sono della gli ma anche não em os uma com são da".split())


def slice_of(text: str) -> str:
    """The slice of ``text``: "code", "structured", "non-english" or "prose" (see the module docstring)."""
    if _FENCE in text or len(_CODE_LINE.findall(text)) >= CODE_LINES:
        return "code"
    if _TABLE_RULE.search(text) or len(_JSON_PAIR.findall(text)) >= 2:
        return "structured"
    letters = [c for c in text if c.isalpha()]
    if letters and sum(c.isascii() for c in letters) / len(letters) < 0.7:
        return "non-english"
    words = _WORD.findall(text.lower())
    if len(words) >= MIN_WORDS:
        english, other = sum(w in _ENGLISH for w in words), sum(w in _OTHER for w in words)
        if other > english and other >= 0.1 * len(words):
            return "non-english"
    return "prose"


def record_text(record: Record) -> str:
    """All of a record's text (every turn of a conversation), as slice detection reads it."""
    if record.is_conversation:
        return "\n".join(m["content"] for m in record.messages)
    return record.text or ""


def slice_windows(tokenizer, source: str = SHAREGPT, windows: int = 16, seq_len: int = 512,
                  slices: tuple[str, ...] = SLICES) -> dict[str, torch.Tensor]:
    """Up to ``windows`` windows of ``seq_len`` tokens per slice from the eval split of ``source``, in file order
    (each record gives at most ``RECORD_WINDOWS`` windows' worth of its first tokens):
    slice → LongTensor [n, seq_len]. Reading stops once every slice is full; a slice the split cannot fill gets the
    whole windows it has (none: an empty [0, seq_len] tensor), so callers report each slice's own token count."""
    unknown = set(slices) - set(SLICES)
    if unknown:
        raise ValueError(f"unknown slice(s) {', '.join(sorted(unknown))}; choose from {', '.join(SLICES)}")
    need = windows * seq_len
    renderer = Renderer(tokenizer)
    streams: dict[str, list[int]] = {name: [] for name in slices}
    for record in iter_split(load_records(source), "eval"):
        stream = streams.get(slice_of(record_text(record)))
        if stream is not None and len(stream) < need:
            stream.extend(renderer.tokens(record)[: min(RECORD_WINDOWS * seq_len, need - len(stream))])
        if all(len(s) >= need for s in streams.values()):
            break
    renderer.warn_skipped(source)
    return {name: torch.tensor(s[: len(s) // seq_len * seq_len], dtype=torch.long).view(-1, seq_len)
            for name, s in streams.items()}
