"""The head training loop on a tiny Medusa task: learning, bit-identical resume, 2-process gloo against 1 process,
best-checkpoint selection, bf16, and its refusals.

Run as a script (``python -m torch.distributed.run --nproc_per_node 2 test_train_loop.py OUT_DIR``), this file is
the 2-process side of ``test_two_processes_match_one``.
"""

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from toolkit.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss
from toolkit.heads.train import TrainConfig, collate, global_batch_indices, train

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN = 50, 16
CONFIG = TrainConfig(lr=3e-2, warmup_steps=2, steps=12, batch_size=8, micro_batch_size=4, train_dtype="float32",
                     eval_every=4, save_every=4, log_every=2)


def chain_data(num_examples: int = 40, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Token chains ``ids[t + 1] = (7 ids[t] + 3) % VOCAB`` (T in 5..20) with ``hidden[t]`` a fixed random embedding
    of ``ids[t]``: every later token is a function of the hidden state, so Medusa heads can learn them. Positions 0
    and 1 are never labels, so the default count_fn (the loss_mask sum) counts what medusa_loss averages over."""
    g = torch.Generator().manual_seed(seed)
    embedding = torch.randn(VOCAB, HIDDEN, generator=g)
    data = []
    for _ in range(num_examples):
        length = int(torch.randint(5, 21, (1,), generator=g))
        ids = [int(torch.randint(VOCAB, (1,), generator=g))]
        for _ in range(length - 1):
            ids.append((7 * ids[-1] + 3) % VOCAB)
        input_ids = torch.tensor(ids)
        loss_mask = torch.rand(length, generator=g) < 0.8
        loss_mask[:2] = False
        data.append({"input_ids": input_ids, "loss_mask": loss_mask, "hidden": embedding[input_ids]})
    return data


def new_heads() -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads(MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=2))


def loss_fn(model, batch):
    return medusa_loss(model, batch["hidden"], batch["input_ids"], batch["loss_mask"])


def mean_loss(model, data) -> float:
    loss_sum, count, _ = loss_fn(model, collate(data))
    return float(loss_sum.detach()) / count


def test_collate_pads_every_key_with_zeros_to_a_multiple():
    data = chain_data(3)
    batch = collate(data, multiple=16)
    longest = max(len(e["input_ids"]) for e in data)
    padded = -(-longest // 16) * 16
    assert padded > longest  # the rounding is exercised
    assert batch["input_ids"].shape == (3, padded) and batch["hidden"].shape == (3, padded, HIDDEN)
    assert collate(data, multiple=1)["input_ids"].shape == (3, longest)
    assert batch["loss_mask"].dtype == torch.bool
    for row, example in enumerate(data):
        length = len(example["input_ids"])
        assert torch.equal(batch["hidden"][row, :length], example["hidden"])
        assert not batch["loss_mask"][row, length:].any() and not batch["input_ids"][row, length:].any()
        assert not batch["hidden"][row, length:].any()


def test_padding_to_a_multiple_leaves_the_medusa_loss_alone():
    data, model = chain_data(6), new_heads()
    with torch.no_grad():
        tight, padded = loss_fn(model, collate(data, multiple=1)), loss_fn(model, collate(data, multiple=128))
    assert torch.allclose(tight[0], padded[0], rtol=1e-5) and tight[1] == padded[1]


def test_global_batches_walk_every_example_once_per_epoch():
    stream = [i for step in range(10) for i in global_batch_indices(40, 8, step, seed=3)]
    assert sorted(stream[:40]) == sorted(stream[40:]) == list(range(40)) and stream[:40] != stream[40:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_goes_down(tmp_path, dtype):
    data = chain_data()
    heads = new_heads()
    before = mean_loss(heads, data)
    autocast_seen = []

    def recording_loss_fn(model, batch):
        autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return loss_fn(model, batch)

    config = replace(CONFIG, steps=60, eval_every=20, save_every=60, log_every=10, train_dtype=dtype)
    result = train(heads, recording_loss_fn, data, config, tmp_path, eval_fn=lambda m: {"loss": mean_loss(m, data)},
                   progress=False)
    assert result.steps == 60 and result.final_metrics["loss"] < 0.5 * before
    assert set(autocast_seen) == {dtype == "bfloat16"}
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    logged = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(10, 61, 10)) and logged[-1]["loss"] < 0.5 * logged[0]["loss"]
    assert logged[0]["tokens"] > 0 and logged[0]["tokens_per_s"] > 0 and "correct_0" in logged[0]["metrics"]
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [20, 40, 60]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000060"]


def test_resume_is_bit_identical(tmp_path):
    data = chain_data()
    whole = new_heads()
    train(whole, loss_fn, data, CONFIG, tmp_path / "whole", progress=False)

    first = new_heads()
    train(first, loss_fn, data, CONFIG, tmp_path / "split", progress=False, stop_after=6)
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    resumed = new_heads()  # a fresh model: everything comes from the checkpoint
    result = train(resumed, loss_fn, data, CONFIG, tmp_path / "split", progress=False)

    assert result.steps == 12
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    saved = [torch.load(tmp_path / run / "checkpoints" / "step-000012" / "trainer.pt", weights_only=True)
             for run in ("whole", "split")]
    for a, b in zip(saved[0]["optimizer"]["state"].values(), saved[1]["optimizer"]["state"].values()):
        assert all(torch.equal(a[key], b[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step-000008", "step-000012"]
    logged = [json.loads(line)["step"] for line in (tmp_path / "split" / "train.jsonl").read_text().splitlines()]
    assert logged == [2, 4, 6, 8, 10, 12]


@pytest.mark.slow  # several processes or minutes of retries: the second tier
def test_two_processes_match_one(tmp_path):
    """2 gloo ranks × 1 micro-batch of 4 against 1 process × 2 micro-batches of 4: the same global batches and
    mean, summed in another order, so parameters agree to float rounding (allclose), not bit for bit."""
    single = new_heads()
    train(single, loss_fn, chain_data(), CONFIG, tmp_path / "single", progress=False)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), __file__, str(tmp_path / "ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]

    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "step-000012" / "model.pt", weights_only=True)
    for name, tensor in single.state_dict().items():
        assert torch.allclose(tensor, ddp[name], atol=1e-6), name
    logged = [json.loads(line)["step"] for line in (tmp_path / "ddp" / "train.jsonl").read_text().splitlines()]
    assert logged == [2, 4, 6, 8, 10, 12]  # written by rank 0 alone


def test_best_checkpoint_follows_select_metric(tmp_path):
    data = chain_data()
    heads = new_heads()
    snapshots = {}

    def eval_fn(model):  # peaks at the third evaluation (step 6)
        step = 2 * (len(snapshots) + 1)
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return {"score": -float((step - 6) ** 2)}

    config = replace(CONFIG, eval_every=2, select_metric="score")
    result = train(heads, loss_fn, data, config, tmp_path, eval_fn=eval_fn, progress=False)
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert result.best_step == best["step"] == 6 and result.best_metrics == best["metrics"] == {"score": 0.0}
    assert result.final_metrics == {"score": -36.0}
    for name, tensor in snapshots[6].items():
        assert torch.equal(best["model"][name], tensor), name
    assert not torch.equal(best["model"]["lm_heads.0.weight"], heads.state_dict()["lm_heads.0.weight"])


def test_refusals(tmp_path):
    data = chain_data()
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        TrainConfig(batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="empty"):
        train(new_heads(), loss_fn, [], CONFIG, tmp_path / "empty", progress=False)
    with pytest.raises(ValueError, match="count_fn"):
        train(new_heads(), loss_fn, data, CONFIG, tmp_path / "count", progress=False,
              count_fn=lambda batch: int(batch["loss_mask"].sum()) + 1)

    train(new_heads(), loss_fn, data, CONFIG, tmp_path / "run", progress=False, stop_after=2)
    with pytest.raises(ValueError, match="lr was 0.03 and is now 0.01"):
        train(new_heads(), loss_fn, data, replace(CONFIG, lr=1e-2), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="steps may be raised, not lowered"):
        train(new_heads(), loss_fn, data, replace(CONFIG, steps=8), tmp_path / "run", progress=False)
    with pytest.raises(FileExistsError, match="resume=True"):
        train(new_heads(), loss_fn, data, CONFIG, tmp_path / "run", progress=False, resume=False)
    result = train(new_heads(), loss_fn, data, replace(CONFIG, steps=20, log_every=5), tmp_path / "run",
                   progress=False, stop_after=3)
    assert result.steps == 3


def test_a_batch_without_labels_skips_the_update(tmp_path):
    data = [{**example, "loss_mask": torch.zeros_like(example["loss_mask"])} for example in chain_data(8)]
    heads = new_heads()
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    with pytest.warns(UserWarning, match="no label token") as caught:
        train(heads, loss_fn, data, replace(CONFIG, steps=3), tmp_path, progress=False)
    assert len([w for w in caught if "no label token" in str(w.message)]) == 1
    assert all(torch.equal(before[k], v) for k, v in heads.state_dict().items())





def tear_last_line(path) -> None:
    """Cut ``path``'s last line in the middle of its record, as a crash during the append would."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])


def test_torn_logs_and_answers_resume_through_the_cli(tiny_llama_dir, tmp_path):
    from conftest import run_train_heads, text_of  # here: torchrun runs this file as a script, without conftest

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


if __name__ == "__main__":  # one rank of test_two_processes_match_one
    torch.set_num_threads(1)
    train(new_heads(), loss_fn, chain_data(), CONFIG, Path(sys.argv[1]), progress=False)
