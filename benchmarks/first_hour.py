"""A new user's first hour, timed: the README's main job, then ``decode``, ``validate`` and ``eval`` on its output.

Each command runs as the user types it (a subprocess, the ``compound`` entry point, nothing preloaded), under three
conditions on this machine:

- quiet, default threads (``--threads auto``: on a quiet 2-core machine that is 2, torch's own default too);
- beside one other 2-thread torch process (a loop of 1024 × 1024 matmuls, started 3 s before), default threads
  (``auto`` then sees one core busy and takes the other);
- beside the same process with ``--threads 2``, torch's default of one thread per core (the old default).

The main job's command is read from README.md (the last ``&&`` part of the bash line after "**Main job**"), so the
table times exactly what the README says; its output directory is the checkpoint the other commands read. A run
that passes ``--limit`` × its quiet time (at least 120 s) is stopped and shown as "> N s".

    python benchmarks/first_hour.py [--verbs main,decode,validate,eval] [--limit 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import compound_argv, flag_argv  # noqa: E402
from report import cpu_name, markdown_table, update_section  # noqa: E402

RESULTS = ROOT / "benchmarks" / "first_hour_results.json"
SECTION = "First hour of a new user (README commands, SmolLM2, CPU)"
PROMPT = "Explain what a Python list comprehension is, with an example."
LOAD = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n")
CONDITIONS = (("quiet", "auto"), ("beside a 2-thread torch process", "auto"),
              ("beside a 2-thread torch process", "2"))


def main_job() -> list[str]:
    """The README's main-job command (``compound quantize ...``), as words."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*Main job\*\*.*?```bash\n(.*?)\n```", text, re.S)
    if block is None:
        raise SystemExit("README.md has no '**Main job**' bash block")
    return shlex.split(block.group(1).split("&&")[-1].strip())


def commands() -> dict[str, list[str]]:
    """Verb → command words (the ``--threads`` flag is added per condition)."""
    job = main_job()
    checkpoint = job[job.index("--output") + 1]
    return {"main job (quantize --eval)": job,
            "decode": compound_argv("decode", model=checkpoint, prompt=PROMPT),
            "validate": compound_argv("validate", model=checkpoint),
            "eval": compound_argv("eval", model=checkpoint, base="smollm2-135m", overwrite=True)}


def timed(command: list[str], limit: float | None) -> tuple[float | None, str]:
    """(wall seconds or None when stopped at ``limit``, the command's output)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, env={**env, "COLUMNS": "100"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = child.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        child.kill()
        return None, child.communicate()[0]
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({child.returncode}):\n{out[-3000:]}")
    return time.perf_counter() - started, out


def threads_line(out: str) -> str:
    """What the command said it chose, e.g. '1 thread (auto: 2 cores, 1.0 busy ...)'."""
    found = re.search(r"threads:?\s+(\d+ threads?)", out)
    return found.group(1) if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=float, default=3.0, help="stop a loaded run after this many quiet times")
    parser.add_argument("--verbs", default=None, help="comma-separated subset of: main, decode, validate, eval "
                        "(the others keep their rows in benchmarks/first_hour_results.json)")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    chosen = args.verbs.split(",") if args.verbs else None
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    quiet = {}
    for verb, command in commands().items():
        if chosen is not None and verb.split()[0] not in chosen:
            continue
        for condition, threads in CONDITIONS:
            load = None if condition == "quiet" else subprocess.Popen([sys.executable, "-c", LOAD])
            if load:
                time.sleep(3)
            try:
                limit = None if condition == "quiet" else max(args.limit * quiet[verb], 120)
                seconds, out = timed([*command, *flag_argv(threads=threads)], limit)
            finally:
                if load:
                    load.kill()
                    load.wait()
            if condition == "quiet":
                quiet[verb] = seconds
            shown = f"{seconds:.0f}" if seconds is not None else f"> {limit:.0f} (stopped)"
            ratio = f"{seconds / quiet[verb]:.1f}×" if seconds is not None else f"> {limit / quiet[verb]:.1f}×"
            row = [verb, condition, f"`--threads {threads}`", threads_line(out), shown, ratio,
                   f"{time.strftime('%Y-%m-%d')}, {cpu_name()}"]
            results[f"{verb}/{condition}/{threads}"] = row
            print(markdown_table(COLUMNS, [row]), flush=True)
    order = {verb: i for i, verb in enumerate(commands())}
    rows = sorted(results.values(), key=lambda r: order[r[0]])  # conditions keep their insertion order
    body = ("Each command from the repository root as README.md gives it, the main job first (its output is the "
            "checkpoint the others read); \"beside a 2-thread torch process\": a loop of matmuls on 2 threads, "
            "started 3 s before the command. Nothing else ran. Rows are kept in "
            "`benchmarks/first_hour_results.json`, each with its date and CPU.\n\n"
            + markdown_table(COLUMNS, rows) + "\n\nCommand: `python benchmarks/first_hour.py` (every verb and condition; "
            "`--verbs` re-measures some, keeping the others' rows)")
    print(body)
    if not args.no_write:
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        update_section(SECTION, body)


COLUMNS = ["command", "machine", "threads flag", "threads chosen", "wall time (s)", "vs quiet", "measured"]

if __name__ == "__main__":
    main()
