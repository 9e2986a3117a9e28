"""``--stream-target``: hidden states of a target read one decoder layer at a time from its shards are the in-memory
model's, bit for bit, through the whole cache; and the target is never whole in memory."""

import pytest
import torch

from conftest import tiny_model
from toolkit.heads import hidden_states as hs
from toolkit.heads.data import Example
from toolkit.heads.streamed_target import StreamedTarget
from toolkit.models import ModelError, load_model, resolve_model

LAYERS = 4


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory, smol_tokenizer):
    """A tiny 4-layer Llama saved in bfloat16 across several shards (untied LM head), with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("sharded-target") / "llama"
    tiny_model("llama", layers=LAYERS).to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    smol_tokenizer.save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) >= 4
    return path


def _examples(n=6):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        T = int(torch.randint(4, 40, (1,), generator=g))
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 3:] = True
        out.append(Example(f"ex{i}", torch.randint(0, 49152, (T,), generator=g), mask))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layers", [(-1,), (0, 2, 3, -1), (1, LAYERS)])
def test_states_are_the_in_memory_models(sharded_llama, one_thread, dtype, layers):
    in_memory = load_model(str(sharded_llama), dtype)
    streamed = StreamedTarget(resolve_model(str(sharded_llama)), dtype)
    ids = torch.randint(0, 49152, (3, 17))
    expected = hs.target_hidden_states(in_memory, ids, layers)
    got = hs.target_hidden_states(streamed, ids, layers)
    assert got.dtype == dtype and torch.equal(got, expected)


def test_streamed_target_holds_no_layer_between_forwards(sharded_llama, one_thread):
    streamed = StreamedTarget(resolve_model(str(sharded_llama)))
    hs.target_hidden_states(streamed, torch.randint(0, 49152, (1, 9)))
    layer_params = [p for name, p in streamed.model.named_parameters() if ".layers." in name]
    assert layer_params and all(p.is_meta for p in layer_params)
    assert streamed.model.lm_head.weight.is_meta  # the LM head is never read
    assert not streamed.model.get_input_embeddings().weight.is_meta


def test_cache_written_from_a_streamed_target_is_the_in_memory_cache(sharded_llama, tmp_path, one_thread):
    examples = _examples()
    layers = (1, 3, -1)
    expected = hs.cache_hidden_states(load_model(str(sharded_llama), torch.bfloat16), examples, tmp_path / "memory",
                                      layers=layers, batch_tokens=64, progress=False)
    got = hs.cache_hidden_states(StreamedTarget(resolve_model(str(sharded_llama))), examples, tmp_path / "streamed",
                                 layers=layers, batch_tokens=64, progress=False)
    assert len(got) == len(expected) == len(examples)
    for a, b in zip(got, expected):
        assert all(torch.equal(a[key], b[key]) for key in ("hidden", "input_ids", "loss_mask"))


def test_refuses_what_cannot_stream(tmp_path, tiny_llama_dir):
    tiny_model("llama").config.save_pretrained(tmp_path / "config-only")  # a model that resolves, but no shards
    with pytest.raises(ModelError, match="safetensors model directory"):
        StreamedTarget(resolve_model(str(tmp_path / "config-only")))
