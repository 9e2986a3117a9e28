"""Generation checks: greedy answers to small prompt sets, judged by a program, not by eye.

Three sets (``calibration/prompts/*.jsonl``, written for this project):

- ``json``: the answer must hold JSON that ``json.loads`` accepts (the first fenced block, else the span from the
  first ``{``/``[`` to the last ``}``/``]``);
- ``code``: the answer must hold Python that ``compile()`` accepts (the first fenced block, else the whole answer)
  and that does something (a statement or call, not only bare names: a one-word answer is valid Python);
- ``factual``: the answer is correct when it contains the expected answer as a word (case-folded); against a base
  model, it also counts as *same* when its first line equals the base's first line (whitespace and case folded).

Each prompt is chat-templated and decoded greedily, a set at a time in batches (``toolkit.decode.batched``),
stopping at EOS.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from toolkit.calibration import chat_prompt_ids
from toolkit.decode.batched import greedy_batch

SETS = ("json", "code", "factual")
_FENCED = re.compile(r"```[\w+-]*\n(.*?)(```|$)", re.DOTALL)


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    answer: str | None = None


@dataclass
class CheckResult:
    """One prompt set's pass rates: ``passed`` per model (``model`` and, when given, ``base``), over ``prompts``;
    ``same_as_base``: the share of factual answers identical to the base's (None for other sets or without a base);
    ``outputs``: each prompt's id → decoded answer, per model."""

    set: str
    prompts: int
    passed: dict[str, float]
    same_as_base: float | None = None
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)


def prompt_set(name: str, directory: Path | None = None) -> list[Prompt]:
    """The prompts of set ``name`` from ``directory`` (default: the ones shipped in ``toolkit.calibration``)."""
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(SETS)}")
    path = (directory or resources.files("toolkit.calibration") / "prompts") / f"{name}.jsonl"
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Prompt(**json.loads(line)) for line in lines]


def passes(check: str, answer: str, expected: str | None = None) -> bool:
    """Whether ``answer`` passes ``check`` ("json", "code" or "factual", the latter against ``expected``)."""
    if check == "json":
        return _parses(_fenced(answer) or _json_span(answer))
    if check == "code":
        return _compiles(_fenced(answer) or answer)
    if check == "factual":
        return bool(expected) and re.search(rf"(?<!\w){re.escape(expected.casefold())}(?!\w)", answer.casefold()) is not None
    raise ValueError(f"unknown check {check!r}; choose from {', '.join(SETS)}")


def run_checks(models: dict[str, nn.Module], tokenizer, max_new_tokens: int = 96,
               sets: tuple[str, ...] = SETS, directory: Path | None = None,
               progress: Callable[[str, int], Callable[[int], None]] | None = None) -> list[CheckResult]:
    """Every prompt set on every model (name → model; a model named ``base`` is the reference for same-as-base).
    ``progress(phase, prompts)`` starts each set's decoding on a model and returns what counts its decoded prompts."""
    results = []
    for name in sets:
        prompts = prompt_set(name, directory)
        ids = [torch.tensor(chat_prompt_ids(tokenizer, p.prompt), dtype=torch.long) for p in prompts]
        outputs: dict[str, dict[str, str]] = {}
        for label, model in models.items():
            advance = progress(f"generation checks: {name}, {label}", len(ids)) if progress else None
            decoded = greedy_batch(model, ids, max_new_tokens, tokenizer.eos_token_id, on_prompts=advance)
            outputs[label] = {p.id: tokenizer.decode(out[len(i):], skip_special_tokens=True)
                              for p, i, out in zip(prompts, ids, decoded)}
        passed = {label: sum(passes(name, got[p.id], p.answer) for p in prompts) / len(prompts)
                  for label, got in outputs.items()}
        same = None
        if name == "factual" and {"model", "base"} <= outputs.keys():
            same = sum(_first_line(outputs["model"][p.id]) == _first_line(outputs["base"][p.id])
                       for p in prompts) / len(prompts)
        results.append(CheckResult(name, len(prompts), passed, same, outputs))
    return results


def _fenced(text: str) -> str | None:
    match = _FENCED.search(text)
    return match.group(1) if match else None


def _json_span(text: str) -> str:
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    end = max(text.rfind("}"), text.rfind("]"))
    return text[min(starts): end + 1] if starts and end > min(starts) else text


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _compiles(code: str) -> bool:
    """Compiles, and holds more than bare names or constants (a one-word prose answer is valid Python)."""
    try:
        compile(code, "<generated>", "exec")
    except (SyntaxError, ValueError):
        return False
    return any(not isinstance(s, ast.Expr) or isinstance(s.value, ast.Call) for s in ast.parse(code).body)


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[0].casefold().split()) if lines else ""
