"""Records to token tensors: chat-template rendering, packing into fixed-length blocks.

Conversations are rendered with the tokenizer's chat template (so calibration sees the same
``<|im_start|>assistant`` framing the model sees when served) and tokenized without adding special
tokens again; plain texts are tokenized as they are and followed by EOS. Rendered records are
concatenated into one stream and cut into ``[n, seq_len]`` blocks; blocks cross record boundaries,
as in GPTQ's and AWQ's calibration loaders.

A base model's tokenizer has no chat template. Its conversations are rendered as plain text
(``render_chat``): the turns' contents joined by a blank line, no role tags, after the BOS token
where the tokenizer adds one; the generation prompt is the blank line that starts the next turn, so
a reply is generated in the context that training and evaluation render it in.
Every reader of conversations (calibration, evaluation, head training, decode prompts) renders
through ``render_chat``, so all of them see the same text.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence

import torch
from jinja2.exceptions import TemplateError

from toolkit.calibration.sources import SHAREGPT, CalibrationError, Record, load_records
from toolkit.calibration.splits import iter_split


def calibration_batch(
    tokenizer,
    source: str = SHAREGPT,
    samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    pool: int | None = None,
    text_field: str = "text",
) -> torch.Tensor:
    """``samples`` blocks of ``seq_len`` tokens from the calibration split of ``source``: LongTensor [samples, seq_len].

    Takes the first ``pool`` calibration records (default ``max(4 * samples, 256)``, doubled until
    they fill ``samples * seq_len`` tokens), shuffles them with ``random.Random(seed)``, renders and
    packs them. The same arguments give the same tensor.
    """
    _check_positive(samples=samples, seq_len=seq_len, pool=pool)
    need = samples * seq_len
    records = iter_split(load_records(source, text_field), "calibration")
    pool = pool or max(4 * samples, 256)
    renderer = Renderer(tokenizer)
    taken: list[Record] = []
    rendered: dict[int, list[int]] = {}  # index in taken -> tokens, kept while the pool grows

    def tokens_of(i: int) -> list[int]:
        if i not in rendered:
            rendered[i] = renderer.tokens(taken[i])
        return rendered[i]

    while True:
        taken.extend(itertools.islice(records, pool - len(taken)))
        order = list(range(len(taken)))
        random.Random(seed).shuffle(order)
        stream = (t for i in order for t in tokens_of(i))
        tokens = list(itertools.islice(stream, need))
        if len(tokens) == need:
            renderer.warn_skipped(source)
            return torch.tensor(tokens, dtype=torch.long).view(samples, seq_len)  # (samples, seq_len)
        if len(taken) < pool:  # the split is exhausted
            renderer.warn_skipped(source)
            raise _too_few(source, "calibration", len(tokens), samples, seq_len, "--samples")
        pool *= 2


def eval_windows(
    tokenizer,
    source: str = SHAREGPT,
    windows: int = 80,
    seq_len: int = 512,
    text_field: str = "text",
) -> torch.Tensor:
    """Held-out evaluation tokens: the eval split of ``source`` in file order, packed: LongTensor [windows, seq_len].

    No seed and no shuffle, so every model (and every calibration seed) is scored on the same windows.
    """
    _check_positive(windows=windows, seq_len=seq_len)
    need = windows * seq_len
    renderer = Renderer(tokenizer)
    records = iter_split(load_records(source, text_field), "eval")
    tokens = list(itertools.islice(renderer.stream(records), need))
    renderer.warn_skipped(source)
    if len(tokens) < need:
        raise _too_few(source, "eval", len(tokens), windows, seq_len, "--windows")
    return torch.tensor(tokens, dtype=torch.long).view(windows, seq_len)  # (windows, seq_len)


def train_records(source: str = SHAREGPT, text_field: str = "text") -> Iterator[Record]:
    """Records of the train split of ``source`` (conversations for chat data), for head training."""
    return iter_split(load_records(source, text_field), "train")


PLAIN_TURN_SEPARATOR = "\n\n"  # between two turns' contents when a base model's conversations are plain text


class PlainTextConversations(UserWarning):
    """Said once: the tokenizer has no chat template, so conversations are rendered as plain text."""


def render_chat(tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """``messages`` rendered as text: with the tokenizer's chat template, or as plain text (``PLAIN_TURN_SEPARATOR``
    between the turns' contents and as the generation prompt, no role tags, after BOS where the tokenizer adds one)
    for a tokenizer without one, which is said once in a warning. The text already holds its special tokens: tokenize it without adding them."""
    plain = {}
    if not getattr(tokenizer, "chat_template", None):
        plain["chat_template"] = _plain_template(_adds_bos(tokenizer))
        warnings.warn("the tokenizer has no chat template (a base model): conversations are rendered as plain text, "
                      "the turns joined by a blank line without role tags", PlainTextConversations)  # one place: once
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **plain)


def conversation_ids(tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered by ``render_chat`` (with the generation prompt by default)."""
    text = render_chat(tokenizer, messages, add_generation_prompt)
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn with the generation prompt (a base model: the text and a blank line)."""
    return conversation_ids(tokenizer, [{"role": "user", "content": text}])


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its BOS token before a text of its own accord (Gemma's does, Qwen's does not)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


@functools.cache
def _plain_template(with_bos: bool) -> str:
    """The Jinja template of the plain-text rendering: one rule, written once, for every reader of conversations."""
    separator = PLAIN_TURN_SEPARATOR.replace("\n", "\\n")
    bos = "{{ bos_token }}" if with_bos else ""
    between = "{{ '" + separator + "' }}"
    return (bos + "{% for message in messages %}{% if not loop.first %}" + between + "{% endif %}"
            + "{{ message['content'] }}{% endfor %}{% if add_generation_prompt and messages %}" + between
            + "{% endif %}")


def fingerprint(tokens: torch.Tensor) -> str:
    """sha256 hex of a token tensor, for manifests; dtype and shape are hashed too, so a reshape differs."""
    tokens = tokens.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{tokens.dtype}{tuple(tokens.shape)}".encode())
    digest.update(tokens.numpy().tobytes())
    return digest.hexdigest()


class Renderer:
    """Renders records to token ids, counting the conversations the chat template rejects."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.failed = 0
        self.first_failure = ""

    def stream(self, records: Iterable[Record]) -> Iterator[int]:
        for record in records:
            yield from self.tokens(record)

    def tokens(self, record: Record) -> list[int]:
        if record.is_conversation:
            if not any(m["content"].strip() for m in record.messages):
                return []
            try:
                text = render_chat(self.tokenizer, record.messages)
            except (TemplateError, ValueError) as e:  # e.g. a template that enforces user/assistant alternation
                self.failed += 1
                self.first_failure = self.first_failure or f"record {record.id}: {e}"
                return []
            # The template already wrote the special tokens (<|im_start|>, BOS where used); don't add them twice.
            return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if not record.text.strip():
            return []
        if self.tokenizer.eos_token_id is None:
            raise CalibrationError("the tokenizer has no eos_token to separate documents; set tokenizer.eos_token")
        return self.tokenizer(record.text, add_special_tokens=False, verbose=False)["input_ids"] + [
            self.tokenizer.eos_token_id
        ]

    def warn_skipped(self, source: str) -> None:
        if self.failed:
            warnings.warn(
                f"skipped {self.failed} conversation(s) of {source} that the chat template could not render "
                f"(first: {self.first_failure})",
                stacklevel=3,
            )


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise CalibrationError(f"{name} must be a positive integer, got {value}")


def _too_few(source: str, split: str, got: int, n: int, seq_len: int, option: str) -> CalibrationError:
    """The refusal of a split too small for ``option`` sequences of ``seq_len`` tokens, naming what can help: fewer
    sequences when it fills some, a larger --dataset when it fills none."""
    need = (f"dataset {source} gives only {got} tokens in its {split} split; "
            f"need {option.lstrip('-')}×seq_len = {n}×{seq_len} = {n * seq_len}")
    if got >= seq_len:
        return CalibrationError(f"{need}; lower {option} to {got // seq_len} (or lower --seq-len), or pass a larger "
                                "--dataset")
    return CalibrationError(f"{need}, not one {seq_len}-token sequence: pass a larger --dataset (lowering {option} "
                            f"or --seq-len leaves too little {split} data)")
