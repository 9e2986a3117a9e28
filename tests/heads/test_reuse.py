"""Reuse of a train-heads work directory (toolkit/heads/reuse.py): work made for another target, dtype or answers,
or without a record, is rebuilt, never reused."""

import io
import json

import pytest
import torch
from rich.console import Console

from conftest import run_train_heads, text_of, tiny_config
from test_train_heads import _job, prepare_job
from toolkit.heads.reuse import LEDGER
from toolkit.identity import target_identity

pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, smol_tokenizer):
    """Target B: the tiny Llama's shapes and tokenizer with other random weights."""
    path = tmp_path_factory.mktemp("other-llama")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


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
    (dict(target_dtype="bfloat16"), "rebuilding hidden, made for dtype float32, not bfloat16"),
    (dict(self_distill=True), "rebuilding hidden, made for dataset answers, not self-distilled answers"),
])
def test_hidden_states_of_another_dtype_or_answers_are_rebuilt(tiny_llama_dir, tmp_path, change, why):
    base = dict(self_distill=False, batch_tokens=96)
    prepare_job(_job(tiny_llama_dir, tmp_path / "heads", **base), Console(quiet=True))
    shown = io.StringIO()
    _, data, _ = prepare_job(_job(tiny_llama_dir, tmp_path / "heads", **base | change), Console(file=shown))
    assert why in " ".join(shown.getvalue().split())
    assert data.index["target"]["dtype"] == change.get("target_dtype", "float32")
    assert data.index["target"]["answers"] == ("self-distilled" if change.get("self_distill") else "dataset")


def test_a_piece_without_a_record_is_rebuilt(tiny_llama_dir, tmp_path):
    """Work from before the record (or copied in without it) is not trusted to be this target's."""
    job = _job(tiny_llama_dir, tmp_path / "heads", self_distill=False, batch_tokens=96)
    prepare_job(job, Console(quiet=True))
    (job.work / LEDGER).unlink()
    shown = io.StringIO()
    _, data, _ = prepare_job(job, Console(file=shown))
    sha = target_identity(str(tiny_llama_dir))["sha256"]
    said = " ".join(shown.getvalue().split())
    assert (f"{job.work}: rebuilding hidden, made for an unrecorded target (this run: {tiny_llama_dir} (sha256 "
            f"{sha[:12]}) in float32 on dataset answers)") in said
    assert data.index["target"]["sha256"] == sha
