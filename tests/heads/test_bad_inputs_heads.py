"""train-heads faults (issue #26, items 4, 5, 12) on tiny targets: options out of the target's range are refused
before any work (``--dry-run`` too) with exit 2, one line naming the flag and nothing on disk; work made for another
target, dtype or answers is rebuilt, saying so; a log line torn by a crash is dropped on resume."""

import io
import json
from dataclasses import replace

import pytest
import torch
from conftest import tiny_config
from rich.console import Console
from test_train_heads import _job
from test_train_loop import CONFIG, chain_data, loss_fn, new_heads
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.heads.reuse import LEDGER
from toolkit.heads.train import train
from toolkit.identity import target_identity
from toolkit.train_heads import prepare

pytestmark = pytest.mark.usefixtures("one_thread")

# The cheap settings of tests/test_train_heads.py, as flags; a flag given again after them wins.
CHEAP = ["--num-heads", "2", "--samples", "4", "--max-len", "96", "--distill-tokens", "6", "--dtype", "float32",
         "--steps", "2", "--batch-size", "2", "--micro-batch-size", "1", "--eval-every", "2", "--save-every", "2",
         "--eval-prompts", "1", "--eval-tokens", "4"]


def run_train_heads(model, output, *args):
    return CliRunner().invoke(app, ["train-heads", "--model", str(model), "-o", str(output), *CHEAP,
                                    *map(str, args)])


def text_of(result) -> str:
    return " ".join(result.output.split())


def assert_refused(result, parent, *needles):
    """Exit 2, a message holding every needle, no traceback, and nothing new in ``parent``."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert all(needle in text_of(result) for needle in needles), result.output
    assert list(parent.iterdir()) == []


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, smol_tokenizer):
    """Target B: the tiny Llama's shapes and tokenizer with other random weights."""
    path = tmp_path_factory.mktemp("other-llama")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """Targets known by their config alone (the refusals read nothing else): a Gemma and a one-layer Llama."""
    dirs = {}
    for name, config in {"gemma": tiny_config("gemma"), "one-layer": tiny_config("llama", layers=1)}.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        config.save_pretrained(dirs[name])
    return dirs


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("args, needles", [
    (["--head", "eagle3", "--aux-layers", "99"], ["--aux-layers 99 is out of range", "2 decoder layers", "1..1"]),
    (["--head", "eagle3", "--aux-layers", "1,1"], ["--aux-layers must be increasing", "got 1,1"]),
    (["--head", "eagle3", "--aux-layers", "0"], ["--aux-layers must be increasing target layer indices >= 1"]),
    (["--head", "eagle3", "--aux-layers", "x"], ["--aux-layers", "comma-separated integers"]),
    (["--head", "eagle3", "--draft-vocab", "60000"], ["--draft-vocab 60000 is larger than the target's vocabulary",
                                                      "1..49152"]),
    (["--head", "eagle3", "--draft-vocab", "0"], ["--draft-vocab", "must be >= 1"]),
    (["--num-heads", "0"], ["--num-heads", "num_heads >= 1"]),
    (["--num-layers", "0"], ["--num-layers", "num_layers >= 1"]),
    (["--max-len", "4096"], ["--max-len 4096 is longer than the target's context of 256 tokens", "8..256"]),
    (["--steps", "0"], ["steps must be >= 1, got 0 (--steps)"]),
    (["--batch-size", "3", "--micro-batch-size", "2"], ["--batch-size or --micro-batch-size"]),
    (["--eval-prompts", "0"], ["--eval-prompts and --eval-tokens must be >= 1"]),
    (["--eval-tokens", "0"], ["--eval-prompts and --eval-tokens must be >= 1"]),
    (["--distill-tokens", "0"], ["--distill-tokens and --distill-batch must be >= 1"]),
    (["--distill-batch", "0"], ["--distill-tokens and --distill-batch must be >= 1"]),
])
def test_out_of_range_options_are_refused_before_any_work(tiny_llama_dir, tmp_path, dry_run, args, needles):
    parent = tmp_path / "runs"
    parent.mkdir()
    result = run_train_heads(tiny_llama_dir, parent / "heads", *args, *(["--dry-run"] if dry_run else []))
    assert_refused(result, parent, *needles)


@pytest.mark.parametrize("target, args, needles", [
    ("gemma", ["--head", "eagle"], ["--head eagle cannot draft for a gemma target", "--head medusa"]),
    ("gemma", ["--head", "eagle3"], ["--head eagle3 cannot draft for a gemma target", "llama"]),
    ("one-layer", ["--head", "eagle3"], ["--head eagle3", "1 decoder layer", "--head eagle"]),
])
def test_head_kind_the_target_cannot_have_is_refused(config_dirs, tmp_path, target, args, needles):
    parent = tmp_path / "runs"
    parent.mkdir()
    result = run_train_heads(config_dirs[target], parent / "heads", *args, "--dry-run")
    assert_refused(result, parent, *needles)


def test_work_of_another_target_is_rebuilt(tiny_llama_dir, other_llama_dir, tmp_path):
    """A, then B into the same output and work directory, then A again: each run rebuilds the answers, the hidden
    states and the training state of the other, saying so, and A's second run reproduces its first."""
    out, work = tmp_path / "heads", tmp_path / "heads.work"
    pieces = ("distill.jsonl", "hidden", "train-medusa-k2-l1-own")
    targets = (tiny_llama_dir, other_llama_dir, tiny_llama_dir)
    sha = {target: target_identity(str(target))["sha256"] for target in targets}
    assert sha[tiny_llama_dir] != sha[other_llama_dir]
    texts, answers = [], []
    for target in targets:
        result = run_train_heads(target, out, "--overwrite")
        assert result.exit_code == 0, result.output
        index = json.loads((work / "hidden" / "index.json").read_text())
        ledger = json.loads((work / LEDGER).read_text())
        assert index["target"]["sha256"] == sha[target] and index["target"]["dtype"] == "float32"
        assert {ledger[piece]["sha256"] for piece in pieces} == {sha[target]}
        assert [json.loads(line)["step"] for line in (work / pieces[2] / "eval.jsonl").read_text().splitlines()] \
            == [2]  # trained afresh: a resumed run would have had nothing left to train
        texts.append(text_of(result))
        answers.append((work / "distill.jsonl").read_text())
    assert "rebuilding" not in texts[0]
    for text, before, now in zip(texts[1:], targets, targets[1:]):
        assert text.count("rebuilding") == 1
        assert (f"{work}: rebuilding {', '.join(pieces)}, made for target {before} (sha256 {sha[before][:12]}), "
                f"not {now} (sha256 {sha[now][:12]})") in text
    assert answers[1] != answers[0] and answers[2] == answers[0]  # B's own answers; A's again, not a mix


@pytest.mark.parametrize("change, why", [
    (dict(dtype="bfloat16"), "rebuilding hidden, made for dtype float32, not bfloat16"),
    (dict(self_distill=True), "rebuilding hidden, made for dataset answers, not self-distilled answers"),
])
def test_hidden_states_of_another_dtype_or_answers_are_rebuilt(tiny_llama_dir, tmp_path, change, why):
    base = dict(self_distill=False, batch_tokens=96)
    prepare(_job(tiny_llama_dir, tmp_path / "heads", **base), Console(quiet=True))
    shown = io.StringIO()
    _, data, _ = prepare(_job(tiny_llama_dir, tmp_path / "heads", **base | change), Console(file=shown))
    assert why in " ".join(shown.getvalue().split())
    assert data.index["target"]["dtype"] == change.get("dtype", "float32")
    assert data.index["target"]["answers"] == ("self-distilled" if change.get("self_distill") else "dataset")


def test_a_piece_without_a_record_is_rebuilt(tiny_llama_dir, tmp_path):
    """Work from before the record (or copied in without it) is not trusted to be this target's."""
    job = _job(tiny_llama_dir, tmp_path / "heads", self_distill=False, batch_tokens=96)
    prepare(job, Console(quiet=True))
    (job.work / LEDGER).unlink()
    shown = io.StringIO()
    _, data, _ = prepare(job, Console(file=shown))
    sha = target_identity(str(tiny_llama_dir))["sha256"]
    said = " ".join(shown.getvalue().split())
    assert (f"{job.work}: rebuilding hidden, made for an unrecorded target (this run: {tiny_llama_dir} (sha256 "
            f"{sha[:12]}) in float32 on dataset answers)") in said
    assert data.index["target"]["sha256"] == sha


def tear_last_line(path) -> None:
    """Cut ``path``'s last line in the middle of its record, as a crash during the append would."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])


def test_torn_logs_and_answers_resume_through_the_cli(tiny_llama_dir, tmp_path):
    out, work = tmp_path / "heads", tmp_path / "heads.work"
    assert run_train_heads(tiny_llama_dir, out).exit_code == 0
    answers = (work / "distill.jsonl").read_text()
    train_dir = work / "train-medusa-k2-l1-own"
    for path in (work / "distill.jsonl", train_dir / "train.jsonl", train_dir / "eval.jsonl"):
        tear_last_line(path)
    with pytest.warns(UserWarning, match="truncated") as caught:  # on stderr, outside pytest
        result = run_train_heads(tiny_llama_dir, out, "--overwrite", "--steps", "4")
    assert result.exit_code == 0, result.output
    assert "rebuilding" not in text_of(result)
    said = " ".join(str(w.message) for w in caught)
    for torn in ("distill.jsonl line 4", "train.jsonl line 1", "eval.jsonl line 1"):
        assert f"{torn} is truncated (an interrupted write); dropping it" in said
    assert (work / "distill.jsonl").read_text() == answers  # the torn answer generated again, the same
    for log, steps in (("train.jsonl", [4]), ("eval.jsonl", [4])):  # step 2's torn lines dropped, 3-4 trained
        assert [json.loads(line)["step"] for line in (train_dir / log).read_text().splitlines()] == steps


def test_torn_logs_resume_bit_identically(tmp_path):
    data = chain_data()

    def eval_fn(model):
        return {"score": 0.0}

    whole = new_heads()
    train(whole, loss_fn, data, CONFIG, tmp_path / "whole", eval_fn=eval_fn, progress=False)
    first = new_heads()
    train(first, loss_fn, data, CONFIG, tmp_path / "split", eval_fn=eval_fn, progress=False, stop_after=6)
    for log in ("train.jsonl", "eval.jsonl"):
        tear_last_line(tmp_path / "split" / log)
    resumed = new_heads()
    with pytest.warns(UserWarning, match="truncated") as caught:
        train(resumed, loss_fn, data, CONFIG, tmp_path / "split", eval_fn=eval_fn, progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert "train.jsonl line 3 is truncated" in said and "eval.jsonl line 1 is truncated" in said
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    steps = {log: [json.loads(line)["step"] for line in (tmp_path / "split" / log).read_text().splitlines()]
             for log in ("train.jsonl", "eval.jsonl")}
    assert steps == {"train.jsonl": [2, 4, 8, 10, 12], "eval.jsonl": [8, 12]}  # the torn step 6 and eval 4 dropped


def test_a_fresh_start_drops_the_logs_of_a_crash_before_any_checkpoint(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"step": 2, "loss": 9.0}\n{"step": 4, "lo')
    with pytest.warns(UserWarning, match="train.jsonl line 2 is truncated"):
        train(new_heads(), loss_fn, chain_data(), replace(CONFIG, steps=4), tmp_path, progress=False)
    logged = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [2, 4] and all("lr" in r for r in logged)  # this run's records only


def test_a_corrupt_log_line_before_the_last_is_refused_naming_the_file(tmp_path):
    train(new_heads(), loss_fn, chain_data(), replace(CONFIG, steps=4), tmp_path, progress=False)
    log = tmp_path / "train.jsonl"
    log.write_text('{"step": 2}\nnot json\n{"step": 4}\n')
    with pytest.raises(ValueError, match="train.jsonl line 2 is not a record with a step; fix or delete"):
        train(new_heads(), loss_fn, chain_data(), replace(CONFIG, steps=6), tmp_path, progress=False)
