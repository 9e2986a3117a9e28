"""EAGLE-3 heads in the shared training loop: the loss goes down, resume is bit-identical, and 2 gloo ranks match one
process. The data are a tiny random Llama's own hidden states (aux layers and final) over token chains.

Run as a script (``python -m torch.distributed.run --nproc_per_node 2 test_eagle_train.py OUT_DIR``), this file is
the 2-process side of ``test_two_processes_match_one``.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest's tiny_model, also when run by torchrun
from conftest import tiny_model  # noqa: E402

from toolkit.heads.eagle import EagleHead, eagle3_loss  # noqa: E402
from toolkit.heads.hidden_states import target_hidden_states  # noqa: E402
from toolkit.heads.train import TrainConfig, collate, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128
CONFIG = TrainConfig(lr=1e-2, warmup_steps=2, steps=8, batch_size=4, micro_batch_size=2, train_dtype="float32",
                     eval_every=4, save_every=4, log_every=2)


def setup():
    """(target, data, loss_fn, count_fn): chains ``ids[t + 1] = (5 ids[t] + 1) % VOCAB`` under a tiny Llama."""
    target = tiny_model("llama", layers=8, vocab=VOCAB)
    g = torch.Generator().manual_seed(0)
    data = []
    layers = [2, 4, 5, -1]
    for _ in range(16):
        length = int(torch.randint(6, 16, (1,), generator=g))
        ids = [int(torch.randint(VOCAB, (1,), generator=g))]
        for _ in range(length - 1):
            ids.append((5 * ids[-1] + 1) % VOCAB)
        input_ids = torch.tensor(ids)
        mask = torch.ones(length, dtype=torch.bool)
        mask[:3] = False
        data.append({"input_ids": input_ids, "loss_mask": mask,
                     "hidden": target_hidden_states(target, input_ids[None], layers)[0]})

    def loss_fn(model, batch):
        return eagle3_loss(model, batch["hidden"], batch["input_ids"], batch["loss_mask"], target.lm_head.weight,
                           steps=3)

    def count_fn(batch):
        return int(batch["loss_mask"][:, 2:].sum())  # the draft vocabulary is the whole vocabulary here

    return target, data, loss_fn, count_fn


def new_head(target) -> EagleHead:
    torch.manual_seed(0)
    return EagleHead.from_target(target, "eagle3", aux_layers=(2, 4, 5))


def test_loss_goes_down(tmp_path):
    target, data, loss_fn, count_fn = setup()
    head = new_head(target)
    batch = collate(data)
    with torch.no_grad():
        before = loss_fn(head, batch)
    train(head, loss_fn, data, CONFIG, tmp_path, count_fn=count_fn, progress=False)
    with torch.no_grad():
        after = loss_fn(head, batch)
    # the random target's distributions are near uniform, so the cross-entropy is mostly their entropy and moves
    # little; agreement with the target's argmax is what training buys
    assert float(after[0]) < float(before[0])
    assert after[2]["correct_0"] >= before[2]["correct_0"] + 8


def test_padding_to_a_multiple_leaves_the_loss_alone():
    """collate rounds batch lengths up (for the allocator); the padded tail is masked and after every sequence."""
    target, data, loss_fn, count_fn = setup()
    head = new_head(target)
    with torch.no_grad():
        tight, padded = loss_fn(head, collate(data[:4], multiple=1)), loss_fn(head, collate(data[:4], multiple=128))
    assert torch.allclose(tight[0], padded[0], rtol=1e-5)
    assert count_fn(collate(data[:4], multiple=1)) == count_fn(collate(data[:4], multiple=128))


def test_resume_is_bit_identical(tmp_path):
    target, data, loss_fn, count_fn = setup()
    whole = new_head(target)
    train(whole, loss_fn, data, CONFIG, tmp_path / "whole", count_fn=count_fn, progress=False)
    first = new_head(target)
    train(first, loss_fn, data, CONFIG, tmp_path / "split", count_fn=count_fn, progress=False, stop_after=4)
    resumed = new_head(target)
    train(resumed, loss_fn, data, CONFIG, tmp_path / "split", count_fn=count_fn, progress=False)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # several processes or minutes of retries: the second tier
def test_two_processes_match_one(tmp_path):
    """2 gloo ranks × 1 micro-batch of 2 against 1 process × 2 micro-batches: equal to float rounding."""
    target, data, loss_fn, count_fn = setup()
    single = new_head(target)
    train(single, loss_fn, data, CONFIG, tmp_path / "single", count_fn=count_fn, progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), __file__, str(tmp_path / "ddp")]
    run = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "step-000008" / "model.pt", weights_only=True)
    for name, tensor in single.state_dict().items():
        assert torch.allclose(tensor, ddp[name], atol=1e-5), name


if __name__ == "__main__":  # one rank of test_two_processes_match_one
    torch.set_num_threads(1)
    target, data, loss_fn, count_fn = setup()
    train(new_head(target), loss_fn, data, CONFIG, Path(sys.argv[1]), count_fn=count_fn, progress=False)
