"""Write a benchmark's results into BENCHMARKS.md, replacing only that benchmark's own section."""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nEvery table below is written by a script under `benchmarks/`; each section names its command.\n"


def update_section(title: str, body: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the ``## title`` section of BENCHMARKS.md with ``body``."""
    text = path.read_text() if path.exists() else HEADER
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def cpu_name() -> str:
    """This machine's CPU model and usable cores, for a benchmark's header."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({len(os.sched_getaffinity(0))} cores)"
    return platform.machine()


def command_line(env: str = "") -> str:
    """The one command that regenerates a section: this script as it was run (``python benchmarks/<name>.py ARGS``),
    after ``env`` (variables it needs, ``ATEN_CPU_CAPABILITY=avx2``), as the section states it."""
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return " ".join([*([env] if env else []), "python", str(script), *map(_quoted, sys.argv[1:])])


def _quoted(word: str) -> str:
    """``word`` as a shell reads it back: bare when it can be, else in single quotes, or in double quotes when it
    holds a single quote (a section title such as "Kernels (torch's op ...)")."""
    if "'" not in word or shlex.quote(word) == word:
        return shlex.quote(word)
    return '"' + "".join("\\" + c if c in '\\"$`' else c for c in word) + '"'
