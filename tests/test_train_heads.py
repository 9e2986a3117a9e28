"""train-heads end to end on a tiny Llama: self-distilled ShareGPT turns, cached hidden states, a few steps with
selection by accepted length, an export that reads back, and a rerun that resumes instead of redoing the work."""

import json
from dataclasses import fields

import pytest
import torch
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.heads.medusa_export import load_medusa
from toolkit.heads.options import DataOptions, EagleOptions, MedusaOptions, SelectOptions
from toolkit.heads.train import TrainConfig
from toolkit.train_heads import HeadsJob, train_heads

PARTS = {"medusa": MedusaOptions, "eagle": EagleOptions, "data": DataOptions, "select": SelectOptions}


def _job(target, output, **overrides):
    """A small job; each setting goes to the options object that declares it."""
    settings = dict(num_heads=2, samples=4, max_len=96, distill_tokens=6, distill_batch=4, target_dtype="float32",
                    eval_prompts=2, eval_tokens=6,
                    train=TrainConfig(steps=4, batch_size=2, micro_batch_size=1, eval_every=2, save_every=2,
                                      warmup_steps=1, train_dtype="float32")) | overrides
    parts = {part: cls(**{f.name: settings.pop(f.name) for f in fields(cls) if f.name in settings})
             for part, cls in PARTS.items()}
    return HeadsJob(model=str(target), output=output, **parts, **settings)


def prepare_job(job, console):
    """Phases 1-2 of ``job`` (``train_heads.prepare``), its target resolved as ``train_heads`` resolves it."""
    from toolkit.models import resolve_model
    from toolkit.train_heads import prepare

    return prepare(job, resolve_model(job.model), console)


def test_pipeline_trains_selects_and_exports(tiny_llama_dir, tmp_path, one_thread):
    from rich.console import Console

    job = _job(tiny_llama_dir, tmp_path / "heads")
    result = train_heads(job, Console(quiet=True))
    heads = load_medusa(tmp_path / "heads")
    assert heads.config.num_heads == 2 and heads.config.hidden_size == 64
    manifest = json.loads((tmp_path / "heads" / "compound.json").read_text())
    assert json.dumps(manifest).count(str(tiny_llama_dir)) >= 1
    assert result.examples == 4 and result.best_step in (2, 4) and result.best_metrics["mean_accepted_length"] >= 1
    distilled = (job.work / "distill.jsonl").read_text().splitlines()
    assert len(distilled) == 4 and all(json.loads(line)["messages"][-1]["role"] == "assistant" for line in distilled)
    assert (job.work / "hidden" / "index.json").exists()
    evals = [json.loads(line) for line in (job.train_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4]
    best = max(evals, key=lambda e: e["mean_accepted_length"])  # the first of equals is kept
    assert best["step"] == result.best_step

    # A rerun with more steps resumes: nothing is generated or cached again, training continues from step 4.
    import toolkit.train_heads as pipeline

    calls = []
    real = pipeline.write_hidden_shards
    pipeline.write_hidden_shards = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        longer = _job(tiny_llama_dir, tmp_path / "heads", overwrite=True,
                      train=TrainConfig(steps=6, batch_size=2, micro_batch_size=1, eval_every=2, save_every=2,
                                        warmup_steps=1, train_dtype="float32"))
        train_heads(longer, Console(quiet=True))
    finally:
        pipeline.write_hidden_shards = real
    assert calls == []
    assert [json.loads(line)["step"] for line in (job.train_dir / "eval.jsonl").read_text().splitlines()] \
        == [2, 4, 6]


def test_refuses_existing_output_and_bad_options(tiny_llama_dir, tmp_path):
    from rich.console import Console

    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        train_heads(_job(tiny_llama_dir, tmp_path / "taken"), Console(quiet=True))
    with pytest.raises(ValueError, match="--head"):
        _job(tiny_llama_dir, tmp_path / "x", head="hydra")
    with pytest.raises(ValueError, match="--select-mode"):
        _job(tiny_llama_dir, tmp_path / "x", select_mode="beam")


def test_cli_dry_run_shows_the_trained_tokens(tiny_llama_dir, tmp_path):
    result = CliRunner().invoke(app, ["train-heads", "--model", str(tiny_llama_dir), "-o", str(tmp_path / "h"),
                                      "--dry-run", "--samples", "2", "--max-len", "128", "--target-dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "tokens trained" in result.output
    assert not (tmp_path / "h").exists()


@pytest.mark.slow  # several processes or minutes of retries: the second tier
def test_same_command_under_torchrun(tiny_llama_dir, tmp_path):
    """Two gloo ranks: rank 0 prepares the data while rank 1 waits, each caches half of the hidden states (the cache
    is the one-process cache), both train, rank 0 exports."""
    import os
    import shutil
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "heads"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), shutil.which("compound"), "train-heads", "--model", str(tiny_llama_dir),
               "-o", str(out), "--num-heads", "2", "--samples", "4", "--max-len", "96", "--distill-tokens", "6",
               "--target-dtype", "float32", "--steps", "2", "--batch-size", "2", "--micro-batch-size", "1",
               "--eval-every", "2", "--save-every", "2", "--eval-prompts", "1", "--eval-tokens", "4",
               "--batch-tokens", "96"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert load_medusa(out).config.num_heads == 2
    assert len((tmp_path / "heads.work" / "distill.jsonl").read_text().splitlines()) == 4
    from rich.console import Console

    from toolkit.heads.hidden_states import HiddenStateDataset

    ranked = HiddenStateDataset(tmp_path / "heads.work" / "hidden")
    assert {name.split("-")[1] for name in ranked.index["shards"]} == {"r000", "r001"}
    (tmp_path / "one.work").mkdir()  # the same examples (the distilled answers), cached by one process
    for piece in ("distill.jsonl", "made-for.json"):  # the answers, and the record of the target they are of
        (tmp_path / "one.work" / piece).write_text((tmp_path / "heads.work" / piece).read_text())
    _, one, _ = prepare_job(_job(tiny_llama_dir, tmp_path / "one", batch_tokens=96), Console(quiet=True))
    assert [e["id"] for e in one.examples] == [e["id"] for e in ranked.examples]
    for got, want in zip(ranked, one):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_online_mode_writes_no_cache(tiny_llama_dir, tmp_path, one_thread):
    from rich.console import Console

    job = _job(tiny_llama_dir, tmp_path / "heads", online=True,
               train=TrainConfig(steps=2, batch_size=2, micro_batch_size=2, eval_every=2, save_every=2,
                                 train_dtype="float32"))
    result = train_heads(job, Console(quiet=True))
    assert result.best_step == 2 and load_medusa(tmp_path / "heads").config.num_heads == 2
    assert not (job.work / "hidden").exists()


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_cli_trains_and_validates_eagle_heads(tiny_llama_dir, tmp_path, one_thread, head):
    """train-heads --head eagle|eagle3 through the CLI: cached states of the right layers, a reduced draft vocabulary
    (eagle3), an export that reads back, and validate --heads measuring it losslessly in every shape."""
    from toolkit.heads.eagle_export import load_eagle

    out = tmp_path / head
    args = ["train-heads", "--model", str(tiny_llama_dir), "-o", str(out), "--head", head, "--samples", "4",
            "--max-len", "96", "--distill-tokens", "6", "--target-dtype", "float32", "--steps", "2",
            "--batch-size", "2", "--micro-batch-size", "1", "--eval-every", "2", "--save-every", "2", "--eval-prompts",
            "1", "--eval-tokens", "4", "--depth", "3", "--top-k", "2", "--draft-tokens", "4", "--ttt-steps", "2",
            "--draft-vocab", "300", *(["--loss", "ce"] if head == "eagle" else [])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    loaded = load_eagle(out)
    assert loaded.config.kind == head
    assert f'"method": "{head}"' in result.output  # vLLM's serving flags; SGLang's EAGLE-3 needs 3 aux layers:
    assert ("--speculative-num-steps 3 --speculative-eagle-topk 2" in result.output) == (head == "eagle")
    work = tmp_path / f"{head}.work"
    if head == "eagle3":
        assert loaded.config.draft_vocab_size == 300 and loaded.config.aux_layers == (1,)
        assert "draft vocabulary: 300" in result.output
        assert (work / "hidden-1-final" / "index.json").exists()
    else:
        assert (work / "hidden" / "index.json").exists() and (work / "train-eagle-ce").is_dir()  # --loss ce
    checked = CliRunner().invoke(app, ["validate", "--model", str(tiny_llama_dir), "--heads", str(out),
                                       "--prompts", "1", "--max-new-tokens", "6", "--json", str(tmp_path / "v.json")])
    assert checked.exit_code == 0, checked.output
    assert "recommended:" in checked.output
    reports = {r["mode"]: r for r in json.loads((tmp_path / "v.json").read_text())}
    assert reports["tree"]["shape"] == "tree: depth 3, top-2, 4 nodes"  # the shape it was trained and selected with
    assert reports["chain"]["shape"] == "chain of 3" and set(reports) >= {"chain-2", "chain-4", "tree-wide"}
    assert all(r["lossless"] for r in reports.values())


def test_stream_target_caches_the_in_memory_states(tiny_llama_dir, tmp_path, one_thread):
    """--stream-target (one target layer at a time from the shards) writes the cache the in-memory target writes;
    it refuses what needs the whole target at once."""
    from rich.console import Console

    settings = dict(head="eagle3", aux_layers=(1, 2), self_distill=False, batch_tokens=128)
    _, expected, _ = prepare_job(_job(tiny_llama_dir, tmp_path / "memory", **settings), Console(quiet=True))
    examples, streamed, _ = prepare_job(_job(tiny_llama_dir, tmp_path / "streamed", stream_target=True, **settings),
                                        Console(quiet=True))
    assert (tmp_path / "streamed.work" / "hidden-1-2-final" / "index.json").exists()
    assert len(streamed) == len(expected) == len(examples) == 4 and streamed.layers == [1, 2, -1]
    for got, want in zip(streamed, expected):
        assert got["hidden"].shape[1] == 3 and all(torch.equal(got[k], want[k]) for k in want)
    for bad in (dict(self_distill=True), dict(self_distill=False, online=True)):
        with pytest.raises(ValueError, match="--stream-target"):
            _job(tiny_llama_dir, tmp_path / "x", stream_target=True, **bad)


def test_target_larger_than_memory_is_refused_naming_stream_target(tiny_llama_dir, tmp_path, monkeypatch):
    from rich.console import Console

    from toolkit.engine import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 10_000)  # bytes: less than the tiny target's weights
    with pytest.raises(memory.MemoryLimitError, match="--stream-target --dataset-answers"):
        prepare_job(_job(tiny_llama_dir, tmp_path / "heads"), Console(quiet=True))
    assert not (tmp_path / "heads.work" / "hidden").exists()
