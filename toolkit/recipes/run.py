"""The run: each step run or reused by fingerprint, then the gates, then the push."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.formats.checkpoint import write_text_atomic
from toolkit.recipes.gates import GateResult, check_gates
from toolkit.recipes.plan import Step, plan, step_fingerprints
from toolkit.recipes.records import cached, record_path, store
from toolkit.recipes.schema import Recipe

NO_TOKEN = ("no Hugging Face token configured (set HF_TOKEN or run `hf auth login`), so nothing was pushed; "
            "set push.enabled: false to silence this")


@dataclass
class StepSummary:
    """status: ran | cached | failed | skipped, or in a dry run: would run | cached."""

    name: str
    status: str
    seconds: float = 0.0
    fingerprint: str | None = None
    results: dict = field(default_factory=dict)
    note: str = ""


@dataclass
class RunSummary:
    """What a run did, step by step, and every gate it checked."""

    recipe: str
    output: Path
    steps: list[StepSummary] = field(default_factory=list)
    gates: list[GateResult] = field(default_factory=list)
    dry_run: bool = False

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates) and all(s.status != "failed" for s in self.steps)

    def step(self, name: str) -> StepSummary | None:
        """The summary of step ``name``, None if the run did not reach it."""
        return next((s for s in self.steps if s.name == name), None)

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "output": str(self.output), "passed": self.passed, "dry_run": self.dry_run,
                "steps": [asdict(s) for s in self.steps],
                "gates": [asdict(g) | {"text": str(g)} for g in self.gates]}


class GateError(RuntimeError):
    """One or more gates failed; ``summary`` holds every step and gate, the message names the failed gates."""

    def __init__(self, summary: RunSummary):
        self.summary = summary
        super().__init__("; ".join(str(g) for g in summary.gates if not g.passed))


def run_recipe(recipe: Recipe, *, resume: bool = True, dry_run: bool = False, api=None, console,
               show: Callable[[RunSummary], None] = lambda summary: None) -> RunSummary:
    """Run ``recipe``'s steps in order, skipping (with ``resume``) those whose fingerprint and outputs are unchanged,
    then check the gates and push when every gate passed and ``api`` (an ``HfApi``) is given.

    console: where the steps say what they do (``print``, ``rule``). dry_run: plan the steps (fingerprints, which
    would be skipped) and touch nothing. Raises ``GateError`` when a gate fails (nothing is pushed) and re-raises a
    failing step's error; either way the summary is handed to ``show`` (the CLI renders it) and, outside a dry run,
    written to ``<output>/summary.json``.
    """
    prints = step_fingerprints(recipe)
    summary = RunSummary(recipe.name, recipe.output, dry_run=dry_run)
    if dry_run:
        for step in plan(recipe):
            reused = resume and cached(recipe, step.name, prints[step.name], step.outputs)
            summary.steps.append(StepSummary(step.name, "cached" if reused else "would run",
                                             fingerprint=prints[step.name]))
        summary.steps.append(StepSummary("gates", "would run", note="always checked"))
        if recipe.push:
            status, note = ("would run", "if every gate passes and a Hub token is set") if recipe.push.enabled \
                else ("skipped", "disabled")
            if recipe.push.enabled and resume and cached(recipe, "push", prints["push"]):
                status, note = "cached", "already pushed"
            summary.steps.append(StepSummary("push", status, fingerprint=prints["push"], note=note))
        show(summary)
        return summary
    try:
        results: dict[str, dict] = {}
        for step in plan(recipe):
            _run_step(recipe, step, prints[step.name], resume, console, summary)
            results[step.name] = summary.steps[-1].results
        summary.gates = check_gates(recipe.gates, results)
        failed = [g for g in summary.gates if not g.passed]
        note = f"{len(summary.gates) - len(failed)}/{len(summary.gates)} passed" + \
            (f"; failed: {', '.join(g.name for g in failed)}" if failed else "")
        summary.steps.append(StepSummary("gates", "failed" if failed else "ran", note=note))
        for gate in failed:
            console.print(f"[bold red]gate failed[/] {gate}")
        if failed:
            raise GateError(summary)
        if recipe.push:
            summary.steps.append(_push_step(recipe, prints["push"], results, api, resume, console))
    finally:
        write_text_atomic(recipe.output / "summary.json", json.dumps(summary.to_dict(), indent=1, default=str) + "\n")
        show(summary)
    return summary


def _run_step(recipe: Recipe, step: Step, fingerprint: str, resume: bool, console,
              summary: RunSummary) -> None:
    """Run or reuse ``step``, appending its summary (a failing step is appended as failed, then re-raised)."""
    record = cached(recipe, step.name, fingerprint, step.outputs) if resume else None
    if record:
        console.print(f"[dim]{step.name}: cached ({fingerprint[:12]})[/]")
        summary.steps.append(StepSummary(step.name, "cached", 0.0, fingerprint, record["results"]))
        return
    record_path(recipe, step.name).unlink(missing_ok=True)  # a record exists only beside complete outputs
    if step.work is not None:
        _prepare_work(step.work, fingerprint, resume)
    console.rule(f"{step.name} ({fingerprint[:12]})")
    started = time.perf_counter()
    try:
        results = step.run(recipe, console)
    except Exception as err:
        summary.steps.append(StepSummary(step.name, "failed", time.perf_counter() - started, fingerprint,
                                         note=f"{type(err).__name__}: {err}"))
        raise
    seconds = time.perf_counter() - started
    store(recipe, step.name, fingerprint, step.inputs, results, seconds)
    summary.steps.append(StepSummary(step.name, "ran", seconds, fingerprint, results))


def _prepare_work(work: Path, fingerprint: str, resume: bool) -> None:
    """Keep a step's own resumable state (heads: data, hidden states, training checkpoints) only when it belongs to
    this fingerprint and the run resumes, so an interrupted training continues; otherwise start it empty."""
    stamp = work / "recipe-fingerprint"
    if work.exists() and not (resume and stamp.is_file() and stamp.read_text() == fingerprint):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)


def _push_step(recipe: Recipe, fingerprint: str, results: dict, api, resume: bool, console) -> StepSummary:
    """Push the checkpoint and the heads, each to its repo; skipped when disabled or without a Hub client."""
    push = recipe.push
    if not push.enabled:
        return StepSummary("push", "skipped", fingerprint=fingerprint, note="disabled (push.enabled: false)")
    if api is None:
        console.print(f"[yellow]push skipped:[/] {NO_TOKEN}")
        return StepSummary("push", "skipped", fingerprint=fingerprint, note="no Hugging Face token")
    record = cached(recipe, "push", fingerprint) if resume else None
    if record:
        console.print(f"[dim]push: cached, already pushed ({fingerprint[:12]})[/]")
        return StepSummary("push", "cached", 0.0, fingerprint, record["results"])
    from toolkit.hub import push as hub_push

    common = {"gates": {g.name: str(g).partition(": ")[2] for g in check_gates(recipe.gates, results)}}
    if recipe.source:
        common["command"] = f"compound run {recipe.source}"
    targets = []  # (directory, repo, the card's results in toolkit.hub's keys)
    if recipe.quantize:
        targets.append((recipe.checkpoint, push.repo, {"eval": results["evaluate"], **common}))
    if recipe.heads:
        targets.append((recipe.heads_dir, push.heads_repo_for(recipe.heads.head), {"acceptance": list(results["heads_eval"].values()),
                                                           **common}))
    started = time.perf_counter()
    pushed = {}
    for directory, repo_id, card in targets:
        console.print(f"pushing {directory} → {repo_id}")
        result = hub_push(api, directory, repo_id, private=push.private, revision=push.revision, tags=list(push.tags),
                          commit_message=push.commit_message or f"compound run {recipe.name}", results=card)
        pushed[repo_id] = asdict(result)
    seconds = time.perf_counter() - started
    store(recipe, "push", fingerprint, asdict(push), pushed, seconds)
    return StepSummary("push", "ran", seconds, fingerprint, pushed)
