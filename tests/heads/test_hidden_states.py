"""Hidden-state cache: what the target's lm_head reads, written in shards, read back lazily, resumed after a crash."""

import pytest
import torch

from conftest import tiny_model
from toolkit.heads import hidden_states as hs
from toolkit.heads.data import Example


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model("llama")


def _examples(n=7):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        T = int(torch.randint(5, 30, (1,), generator=g))
        ids = torch.randint(0, 49152, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 2:] = True
        out.append(Example(f"ex{i}", ids, mask))
    return out


def test_last_layer_is_what_lm_head_reads(model):
    ids = torch.randint(0, 49152, (2, 12))
    hidden = hs.target_hidden_states(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(model.lm_head(hidden), logits, rtol=1e-5, atol=1e-5)
    several = hs.target_hidden_states(model, ids, layers=(0, 1, -1))
    assert several.shape == (2, 12, 3, 64)
    torch.testing.assert_close(several[:, :, 2], hidden)


def test_cache_round_trip_in_shards(model, tmp_path):
    examples = _examples()
    data = hs.cache_hidden_states(model, examples, tmp_path / "cache", dtype=torch.float32, batch_tokens=64,
                                  shard_bytes=4096, target={"name": "tiny"}, progress=False)
    assert len(data.index["shards"]) > 1, "small shards must split the cache"
    assert not (tmp_path / "cache.partial").exists()
    reread = hs.HiddenStateDataset(tmp_path / "cache")
    assert len(reread) == len(examples) and reread.index["target"] == {"name": "tiny"}
    for i, example in enumerate(examples):
        item = reread[i]
        alone = hs.target_hidden_states(model, example.input_ids[None])[0]
        torch.testing.assert_close(item["hidden"], alone, rtol=1e-5, atol=1e-5)  # padding after it changes nothing
        assert torch.equal(item["input_ids"], example.input_ids) and torch.equal(item["loss_mask"], example.loss_mask)
    assert reread.index["tokens"] == sum(len(e.input_ids) for e in examples)


def test_online_matches_cache(model, tmp_path):
    examples = _examples(3)
    cached = hs.cache_hidden_states(model, examples, tmp_path / "c", dtype=torch.float32, progress=False)
    online = hs.OnlineHiddenStates(model, examples, dtype=torch.float32)
    for i in range(3):
        torch.testing.assert_close(online[i]["hidden"], cached[i]["hidden"], rtol=1e-5, atol=1e-5)


def test_interrupted_run_resumes_after_last_shard(model, tmp_path, monkeypatch):
    examples = _examples()
    reference = hs.cache_hidden_states(model, examples, tmp_path / "ref", dtype=torch.float32, batch_tokens=32,
                                       shard_bytes=1, progress=False)
    real, calls = hs.target_hidden_states, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(hs, "target_hidden_states", crashing)
    with pytest.raises(KeyboardInterrupt):
        hs.cache_hidden_states(model, examples, tmp_path / "run", dtype=torch.float32, batch_tokens=32,
                               shard_bytes=1, progress=False)
    with pytest.raises(hs.HiddenStateError, match="interrupted run"):
        hs.HiddenStateDataset(tmp_path / "run")
    calls.clear()
    monkeypatch.setattr(hs, "target_hidden_states", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = hs.cache_hidden_states(model, examples, tmp_path / "run", dtype=torch.float32, batch_tokens=32,
                                     shard_bytes=1, progress=False)
    assert len(calls) == len(reference.index["shards"]) - 2, "the two finished shards are not recomputed"
    for i in range(len(examples)):
        assert torch.equal(resumed[i]["hidden"], reference[i]["hidden"])


def test_interrupted_run_of_other_examples_is_not_mixed_in(model, tmp_path, monkeypatch):
    examples = _examples()
    real, calls = hs.target_hidden_states, []

    def crash_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(hs, "target_hidden_states", crash_second)
    with pytest.raises(KeyboardInterrupt):
        hs.cache_hidden_states(model, examples, tmp_path / "c", batch_tokens=32, shard_bytes=1, progress=False)
    with pytest.raises(hs.HiddenStateError, match="other examples"):
        hs.cache_hidden_states(model, examples[:3], tmp_path / "c", progress=False)


def test_refuses_existing_cache_and_bad_states(model, tmp_path):
    examples = _examples(2)
    hs.cache_hidden_states(model, examples, tmp_path / "c", progress=False)
    with pytest.raises(FileExistsError, match="already holds"):
        hs.cache_hidden_states(model, examples, tmp_path / "c", progress=False)
    with pytest.raises(hs.HiddenStateError, match="no hidden-state cache"):
        hs.HiddenStateDataset(tmp_path / "nothing")
    broken = tiny_model("llama")
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    with pytest.raises(hs.HiddenStateError, match="non-finite"):
        hs.target_hidden_states(broken, examples[0].input_ids[None])


def test_size_estimate():
    assert hs.cache_bytes(1000, 576) == 1000 * (576 * 2 + 9)
    assert hs.cache_bytes(10, 8, layers=3, dtype=torch.float32) == 10 * (8 * 3 * 4 + 9)


def test_ranks_write_their_shares_and_one_finishes(model, tmp_path):
    """What torchrun ranks do (here one after the other): each writes every world-th batch; the index then covers
    every example, and the cache reads back as the one-process cache."""
    examples = _examples(9)
    settings = dict(layers=(1, -1), dtype=torch.float32, batch_tokens=48, shard_bytes=1, progress=False)
    reference = hs.cache_hidden_states(model, examples, tmp_path / "one", **settings)
    hs.write_hidden_shards(model, examples, tmp_path / "ranks", rank=1, world=3, **settings)
    with pytest.raises(hs.HiddenStateError, match="rerun to finish"):
        hs.finish_hidden_cache(tmp_path / "ranks", examples, (1, -1), 64, dtype=torch.float32)
    for rank in (0, 2):
        hs.write_hidden_shards(model, examples, tmp_path / "ranks", rank=rank, world=3, **settings)
    with pytest.raises(hs.HiddenStateError, match="number of processes"):
        hs.write_hidden_shards(model, examples, tmp_path / "ranks", rank=0, world=2, **settings)
    cache = hs.finish_hidden_cache(tmp_path / "ranks", examples, (1, -1), 64, dtype=torch.float32)
    shards = cache.index["shards"]
    assert {name.split("-")[1] for name in shards} == {"r000", "r001", "r002"}
    assert [e["id"] for e in cache.examples] == [e.id for e in examples]
    for got, want in zip(cache, reference):
        assert all(torch.equal(got[k], want[k]) for k in want)
