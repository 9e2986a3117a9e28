"""Write a benchmark's results into BENCHMARKS.md, replacing only that benchmark's own section."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
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
