"""Training examples for draft heads: chat rendering with a loss mask over assistant tokens, and self-distillation.

A conversation is rendered with the tokenizer's own chat template, so the heads see the framing the target sees
when served (a base model's, without one, as plain text: ``toolkit.calibration.render_chat``). Which tokens are trainable is found generically, without per-template rules: the prefixes
``messages[:1]``, ``messages[:2]``, ... are rendered in turn and each assistant message's added text is located.
The loss mask covers an assistant message's content and its end-of-turn marker (``<|im_end|>`` for SmolLM2),
so the heads learn to stop; the role header before the content (``<|im_start|>assistant\\n``) and the whitespace
after the end marker are prompt side, because a served model is given the header and stops at the end marker.

Self-distillation (``self_distill``) regenerates the assistant replies with the target itself: heads trained on
the target's own outputs predict what it will actually say, which is what speculative decoding accepts.
"""

from __future__ import annotations

import itertools
import json
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from toolkit.calibration import render_chat
from toolkit.calibration.sources import Record

# Stands in for an assistant message's content to find where the template's role header ends.
_CONTENT_SENTINEL = "\x00compound-assistant-content\x00"


class ChatTemplateError(ValueError):
    """A chat template whose assistant turns cannot be located; the message says which turn and why."""


@dataclass
class Example:
    """One rendered conversation: token ids [T] and a loss mask [T] (True = an assistant token the heads learn)."""

    id: str
    input_ids: torch.LongTensor  # (T,)
    loss_mask: torch.BoolTensor  # (T,)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask}


def render_example(tokenizer, messages: Sequence[dict[str, str]], max_len: int, record_id: str = "") -> Example | None:
    """``messages`` rendered with the chat template and cut to ``max_len`` tokens; None when no token is trainable.

    Raises :class:`ChatTemplateError` when the template is not prefix-stable (a longer conversation does not
    extend the rendering of a shorter one), and jinja's ``TemplateError`` when the template rejects the messages.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be a positive number of tokens, got {max_len}")
    text, spans = _assistant_spans(tokenizer, list(messages))
    try:
        # The template already wrote the special tokens; don't add them twice.
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError as e:  # slow (Python) tokenizers have no offsets
        raise ChatTemplateError(f"{type(tokenizer).__name__} gives no character offsets; load a fast tokenizer") from e
    input_ids = encoding["input_ids"][:max_len]
    offsets = encoding["offset_mapping"][:max_len]
    loss_mask = [end > start and any(lo <= start and end <= hi for lo, hi in spans) for start, end in offsets]
    if not any(loss_mask):
        return None
    return Example(record_id, torch.tensor(input_ids, dtype=torch.long), torch.tensor(loss_mask, dtype=torch.bool))


def _assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of its trainable assistant text."""
    text, spans = "", []
    for i, message in enumerate(messages):
        rendered = _render(tokenizer, messages[: i + 1])
        if not rendered.startswith(text):
            raise ChatTemplateError(
                f"the chat template is not prefix-stable: rendering messages[:{i + 1}] does not extend the rendering "
                f"of messages[:{i}], so assistant turns cannot be located; use a template that renders each turn "
                f"independently"
            )
        if message["role"] == "assistant":
            header = _assistant_header(tokenizer, messages[:i], text)
            added = rendered[len(text) :]
            if not added.startswith(header):
                raise ChatTemplateError(
                    f"message {i}: the template frames this assistant turn differently from a placeholder reply "
                    f"(header {header!r}, got {added[: len(header)]!r}); the assistant content cannot be located"
                )
            spans.append((len(text) + len(header), len(text) + len(added.rstrip())))
        text = rendered
    return text, spans


def _assistant_header(tokenizer, history: list[dict[str, str]], history_text: str) -> str:
    """What the template writes before an assistant message's content after ``history`` (the role header)."""
    rendered = _render(tokenizer, [*history, {"role": "assistant", "content": _CONTENT_SENTINEL}])
    if not rendered.startswith(history_text) or _CONTENT_SENTINEL not in rendered[len(history_text) :]:
        raise ChatTemplateError(
            f"message {len(history)}: the chat template does not write an assistant message's content verbatim "
            f"after the conversation so far, so the assistant content cannot be located"
        )
    return rendered[len(history_text) : rendered.index(_CONTENT_SENTINEL, len(history_text))]


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return render_chat(tokenizer, messages, add_generation_prompt)


def build_examples(tokenizer, records: Iterable[Record], n: int, max_len: int) -> list[Example]:
    """The first ``n`` renderable examples of ``records``; skipped records are counted and warned about once."""
    examples: list[Example] = []
    skipped: Counter[str] = Counter()
    first_template_error = ""
    for record in records:
        if len(examples) == n:
            break
        if not record.is_conversation:
            skipped["not a conversation"] += 1
            continue
        if not any(m["role"] == "assistant" for m in record.messages):
            skipped["no assistant turn"] += 1
            continue
        try:
            example = render_example(tokenizer, record.messages, max_len, record.id)
        except (TemplateError, ChatTemplateError) as e:
            skipped["chat template error"] += 1
            first_template_error = first_template_error or f" (first: record {record.id}: {e})"
            continue
        if example is None:
            skipped[f"no assistant token within {max_len} tokens"] += 1
            continue
        examples.append(example)
    if skipped:
        reasons = ", ".join(f"{count} {reason}" for reason, count in skipped.most_common())
        warnings.warn(f"skipped {sum(skipped.values())} record(s): {reasons}{first_template_error}", stacklevel=2)
    if len(examples) < n:
        warnings.warn(f"the records gave only {len(examples)} of the {n} examples asked for", stacklevel=2)
    return examples


def check_trainable(examples: Sequence[Example]) -> None:
    """Raise ``ValueError`` unless some example has a trainable token (training refuses data with none)."""
    if not examples:
        raise ValueError("no examples to train on; check that the data has conversations with assistant replies")
    if not any(bool(example.loss_mask.any()) for example in examples):
        raise ValueError(
            f"none of the {len(examples)} examples has an assistant token to train on (every loss_mask is False); "
            f"check that the chat template renders assistant turns and that the data has assistant replies"
        )


def show_example(console: Console, tokenizer, example: Example, max_tokens: int = 200) -> None:
    """Print ``example``'s first ``max_tokens`` tokens, trained ones highlighted, and "N of M tokens trained"."""
    input_ids = example.input_ids[:max_tokens].tolist()
    loss_mask = example.loss_mask[:max_tokens].tolist()
    text = Text()
    start = 0
    # Decode runs of equally masked tokens, not single tokens, so characters split across tokens print whole.
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or loss_mask[end] != loss_mask[start]:
            run = tokenizer.decode(input_ids[start:end], skip_special_tokens=False)
            text.append(run, style="bold black on green" if loss_mask[start] else "")
            start = end
    console.print(Text(f"example {example.id}", style="bold"))
    console.print(text)
    shown = f" (showing the first {max_tokens})" if len(example.input_ids) > max_tokens else ""
    console.print(f"{int(example.loss_mask.sum())} of {len(example.input_ids)} tokens trained{shown}", markup=False)


def self_distill(
    model,
    tokenizer,
    records: Iterable[Record],
    n: int,
    out_path: Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    max_prompt_len: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> list[Record]:
    """``n`` conversations whose assistant reply the target ``model`` wrote itself, saved to ``out_path`` (JSONL).

    Each record's prompt is its leading system message (if any) and first user message; the reply is generated
    greedily (``temperature == 0``) or sampled after ``torch.manual_seed(seed)``, in left-padded batches, up to
    ``max_new_tokens`` or an end-of-sequence token. Records that are not conversations, have no user message, or
    whose prompt exceeds ``max_prompt_len`` tokens are skipped. One line ``{"id", "messages"}`` is appended per
    record, in record order, flushed every 8 batches (generated shortest prompt first); a rerun skips the ids
    already in the file, so an interrupted run resumes.
    Returns the first ``n`` records of the file.
    """
    if n <= 0 or batch_size <= 0 or max_new_tokens <= 0:
        raise ValueError(f"n, batch_size and max_new_tokens must be positive, got {n}, {batch_size}, {max_new_tokens}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done_ids = {record.id for record in _read_resumable(out_path)}
    if temperature > 0:
        torch.manual_seed(seed)
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    prompts = itertools.islice(_prompts(tokenizer, records, done_ids, max_prompt_len), max(n - len(done_ids), 0))
    completed, generated_tokens, started = min(len(done_ids), n), 0, time.perf_counter()
    with _distill_progress(progress) as bar, out_path.open("a", encoding="utf-8") as out:
        task = bar.add_task("self-distilling", total=n, completed=completed, tok_s=0.0)
        # Windows of 8 batches: generated shortest prompt first (a batch pads little), written in record order.
        while window := list(itertools.islice(prompts, batch_size * 8)):
            by_length = sorted(window, key=lambda prompt: len(prompt[2]))
            lines: dict[str, str] = {}
            for start in range(0, len(by_length), batch_size):
                batch = by_length[start:start + batch_size]
                generated_tokens += _distill_batch(model, tokenizer, batch, lines, eos_ids, pad_id, max_new_tokens,
                                                   temperature)
                completed += len(batch)
                bar.update(task, completed=completed, tok_s=generated_tokens / (time.perf_counter() - started))
            out.writelines(lines[record_id] for record_id, _, _ in window)
            out.flush()
    distilled = read_distilled(out_path)
    if len(distilled) < n:
        warnings.warn(f"the records gave only {len(distilled)} of the {n} prompts asked for", stacklevel=2)
    return distilled[:n]


def _prompts(tokenizer, records: Iterable[Record], done_ids: set[str], max_prompt_len: int):
    """(id, prompt messages, prompt token ids) of each record still to distill, each id once."""
    seen = set(done_ids)
    for record in records:
        prompt = _prompt_of(record)
        if prompt is None or record.id in seen:
            continue
        text = _render(tokenizer, prompt, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(prompt_ids) > max_prompt_len:
            continue
        seen.add(record.id)
        yield record.id, prompt, prompt_ids


def _prompt_of(record: Record) -> list[dict[str, str]] | None:
    """The leading system message (if any) and the first user message; None without a non-empty user message."""
    if not record.is_conversation:
        return None
    user = next((m for m in record.messages if m["role"] == "user"), None)
    if user is None or not user["content"].strip():
        return None
    system = [record.messages[0]] if record.messages[0]["role"] == "system" else []
    return [*system, user]


def _eos_ids(model, tokenizer) -> list[int]:
    """Token ids that end a reply: the model's generation eos ids and the tokenizer's eos, in that order."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer has an eos token; set one")
    return ids


@torch.no_grad()
def _distill_batch(model, tokenizer, batch, lines: dict[str, str], eos_ids, pad_id, max_new_tokens,
                   temperature) -> int:
    """Generate replies for ``batch``, put each record's JSON line in ``lines`` by id; returns the tokens generated."""
    width = max(len(ids) for _, _, ids in batch)
    # Left padding, so every prompt ends at the same column and generation continues it directly.
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for _, _, ids in batch])  # (B, width)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, _, ids in batch])  # (B, width)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    output = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        **sampling,
    )
    generated = 0
    for (record_id, prompt, _), row in zip(batch, output[:, width:].tolist()):  # (B, new tokens)
        stop = next((i for i, token in enumerate(row) if token in eos_ids), len(row))
        generated += stop
        reply = tokenizer.decode(row[:stop], skip_special_tokens=True)
        messages = [*prompt, {"role": "assistant", "content": reply}]
        lines[record_id] = json.dumps({"id": record_id, "messages": messages}, ensure_ascii=False) + "\n"
    return generated


def _distill_progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tok_s]:.0f} tok/s"), TimeElapsedColumn(), disable=not enabled)


def read_distilled(path: Path) -> list[Record]:
    """The records of a ``self_distill`` file; a truncated last line (an interrupted write) is dropped, warning."""
    records, _ = _read_lines(Path(path))
    return records


def _read_resumable(path: Path) -> list[Record]:
    """The complete records of ``path`` (none if it does not exist), leaving the file ready to append to.

    A truncated last line is cut from the file, and a complete last line that lost its newline gets one back.
    """
    if not path.exists():
        return []
    records, kept_bytes = _read_lines(path)
    with path.open("r+b") as f:
        f.truncate(kept_bytes)
        if kept_bytes:
            f.seek(kept_bytes - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
    return records


def _read_lines(path: Path) -> tuple[list[Record], int]:
    """Records of ``path``'s lines and the byte length of the lines kept (all but a truncated last one)."""
    data = path.read_bytes()
    records, offset, kept_bytes = [], 0, 0
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        offset += len(line)
        if line.strip():
            try:
                item = json.loads(line)
                records.append(Record(id=str(item["id"]), messages=tuple(item["messages"])))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                if offset == len(data) and not line.endswith(b"\n"):  # the last write was cut off
                    warnings.warn(f"{path} line {number} is truncated (an interrupted write); dropping it",
                                  stacklevel=3)
                    break
                raise ValueError(f"{path} line {number} is not a self-distilled record ({e}); fix or delete it") from e
        kept_bytes = offset
    return records, kept_bytes
