"""EAGLE heads on disk: exact round trips for EAGLE-1 and EAGLE-3 (reduced and full draft vocabulary), the golden
names, shapes and config keys the engines read, the draft-vocabulary maps, both engines' layer numbering, and refusal
of broken heads (export) and broken directories (load), with nothing half-written."""

import json

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file
from torch import nn

from toolkit.formats.checkpoint import MANIFEST, sha256_file
from toolkit.heads import eagle_export
from toolkit.heads.eagle import EagleHead, causal_attention
from toolkit.heads.eagle_draft import TreeShape
from toolkit.heads.eagle_export import expected_eagle_tensors, export_eagle, load_eagle, serving_flags

TARGET = "tiny-llama"
DRAFT_VOCAB = 100
CASES = ["eagle", "eagle3", "eagle3-full"]  # eagle3: reduced draft vocabulary; eagle3-full: V_d = V

# tiny_model("llama", layers=8, vocab=512): H 64, I 128, 4 heads / 2 KV heads of 16; EAGLE-3 aux layers (2, 4, 5).
# vLLM 0.32.0, vllm/model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights maps midlayer. ->
# layers.0., prefixes model. to all but lm_head, d2t -> draft_id_to_target_id, skips t2d; LlamaModel.fc is
# Linear(3 * 64, 64, bias=False); the layer's qkv_proj reads 2H.
EAGLE3_TENSORS = {
    "fc.weight": ((64, 192), "float"),
    "midlayer.self_attn.q_proj.weight": ((64, 128), "float"), "midlayer.self_attn.k_proj.weight": ((32, 128), "float"),
    "midlayer.self_attn.v_proj.weight": ((32, 128), "float"), "midlayer.self_attn.o_proj.weight": ((64, 64), "float"),
    "midlayer.input_layernorm.weight": ((64,), "float"), "midlayer.hidden_norm.weight": ((64,), "float"),
    "midlayer.post_attention_layernorm.weight": ((64,), "float"),
    "midlayer.mlp.gate_proj.weight": ((128, 64), "float"), "midlayer.mlp.up_proj.weight": ((128, 64), "float"),
    "midlayer.mlp.down_proj.weight": ((64, 128), "float"),
    "norm.weight": ((64,), "float"), "lm_head.weight": ((100, 64), "float"),
    "d2t": ((100,), "int64"), "t2d": ((512,), "bool"),
}
# vLLM 0.32.0, vllm/model_executor/models/llama_eagle.py: EagleLlamaForCausalLM prefixes model.; layers.0 has no
# input_layernorm (nn.Identity); fc = Linear(2 * 64, 64, bias=False), fc.bias dropped (AutoWeightsLoader ignores
# unexpected .bias). SGLang's llama_eagle.py allocates the bias, so it is written as zeros.
EAGLE_TENSORS = {
    "fc.weight": ((64, 128), "float"), "fc.bias": ((64,), "float"),
    "layers.0.self_attn.q_proj.weight": ((64, 64), "float"), "layers.0.self_attn.k_proj.weight": ((32, 64), "float"),
    "layers.0.self_attn.v_proj.weight": ((32, 64), "float"), "layers.0.self_attn.o_proj.weight": ((64, 64), "float"),
    "layers.0.post_attention_layernorm.weight": ((64,), "float"),
    "layers.0.mlp.gate_proj.weight": ((128, 64), "float"), "layers.0.mlp.up_proj.weight": ((128, 64), "float"),
    "layers.0.mlp.down_proj.weight": ((64, 128), "float"),
}
LLAMA_CONFIG = {  # one-layer LlamaConfig fields both kinds share
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 512, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
EAGLE3_CONFIG = {  # vllm/model_executor/models/llama_eagle3.py, v1/worker/gpu_model_runner.py; SGLang: eagle_config
    "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 100, "target_hidden_size": 64, "bias": False,
    "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
}
# bias false: vLLM 0.32's LlamaDecoderLayer (models/llama.py) reads config.bias as the attention bias (q/k/v/o)
EAGLE_CONFIG = {"architectures": ["LlamaForCausalLMEagle", "LlamaForCausalLM"], "bias": False}
FILES = ["compound.json", "config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def target(one_thread):
    return tiny_model("llama", layers=8, vocab=512)


def make_head(target, case: str) -> EagleHead:
    """A head with every float parameter random (a swapped tensor cannot hide) and, for eagle3, a scattered draft
    vocabulary."""
    torch.manual_seed(0)
    vocab = torch.randperm(512)[:DRAFT_VOCAB] if case == "eagle3" else None
    head = EagleHead.from_target(target, case.removesuffix("-full"), draft_vocab=vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    return head


@pytest.fixture(params=CASES)
def case(request):
    return request.param


@pytest.fixture
def head(target, case):
    return make_head(target, case)


def export(head, out, **kwargs):
    return export_eagle(head, out, target=TARGET, target_sha256="ab" * 32, **kwargs)


def assert_same_head(loaded, head, target) -> None:
    """``loaded`` has ``head``'s config and every tensor bit for bit, and drafts the same logits on ``target``."""
    assert loaded.config == head.config
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded.attach(target)
    ids = torch.randint(0, 512, (1, 6))
    hidden = head.fuse(torch.randn(1, 6, head.config.feature_size))
    out = head.step(hidden, ids, torch.arange(6), causal_attention)
    assert torch.equal(loaded.logits(loaded.step(hidden, ids, torch.arange(6), causal_attention)), head.logits(out))


def test_fp32_round_trip_is_exact(target, head, tmp_path):
    assert_same_head(load_eagle(export(head, tmp_path / "head", dtype=torch.float32)), head, target)


def test_bf16_round_trip_rounds_each_float_once(head, tmp_path):
    loaded = load_eagle(export(head, tmp_path / "head"))
    written = load_file(tmp_path / "head" / "model.safetensors")
    assert {t.dtype for t in written.values()} - {torch.int64, torch.bool} == {torch.bfloat16}
    for name, tensor in head.state_dict().items():
        expected = tensor.bfloat16().float() if tensor.is_floating_point() else tensor
        assert torch.equal(loaded.state_dict()[name], expected), name


@pytest.mark.parametrize("case, tensors, keys", [("eagle3", EAGLE3_TENSORS, EAGLE3_CONFIG),
                                                 ("eagle", EAGLE_TENSORS, EAGLE_CONFIG)])
def test_layout_has_the_names_shapes_and_config_engines_read(target, tmp_path, case, tensors, keys):
    head = make_head(target, case)
    out = export(head, tmp_path / "head")
    assert expected_eagle_tensors(head.config) == tensors
    written = load_file(out / "model.safetensors")
    kinds = {torch.int64: "int64", torch.bool: "bool", torch.bfloat16: "float"}
    assert {name: (tuple(t.shape), kinds[t.dtype]) for name, t in written.items()} == tensors
    config = json.loads((out / "config.json").read_text())
    assert {key: config[key] for key in LLAMA_CONFIG} == LLAMA_CONFIG
    assert {key: config[key] for key in keys} == keys
    assert sorted(p.name for p in out.iterdir()) == FILES
    if case == "eagle":
        assert torch.equal(written["fc.bias"], torch.zeros(64, dtype=torch.bfloat16))


def test_d2t_and_t2d_are_inverse_on_the_draft_vocabulary(target, tmp_path):
    head = make_head(target, "eagle3")
    written = load_file(export(head, tmp_path / "head") / "model.safetensors")
    d2t, t2d = written["d2t"], written["t2d"]
    target_ids = d2t + torch.arange(DRAFT_VOCAB)
    assert bool(t2d[target_ids].all()) and int(t2d.sum()) == DRAFT_VOCAB
    assert torch.equal(target_ids, head.draft_to_target(torch.arange(DRAFT_VOCAB)))
    assert bool((target_ids[1:] > target_ids[:-1]).all())


def test_full_vocabulary_is_written_without_maps_and_loaded_as_identity(target, tmp_path):
    """vLLM 0.32 builds no draft_id_to_target_id when V_d = V and refuses a d2t tensor then."""
    head = make_head(target, "eagle3-full")
    out = export(head, tmp_path / "head")
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 512
    loaded = load_eagle(out)
    assert not loaded.d2t.any() and loaded.t2d.all()


def test_manifest_records_config_layer_numberings_target_and_hashes(target, tmp_path):
    head = make_head(target, "eagle3")
    out = export(head, tmp_path / "head", extra_manifest={"training": {"steps": 7}})
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["eagle"] == head.config.to_dict() and manifest["kind"] == "eagle3"
    assert manifest["aux_layers"] == {"hf_hidden_states": [2, 4, 5], "vllm": [2, 4, 5], "sglang": [1, 3, 4]}
    assert manifest["target"] == TARGET and manifest["target_sha256"] == "ab" * 32
    assert manifest["dtype"] == "bfloat16" and manifest["training"] == {"steps": 7}
    assert manifest["files"] == {name: sha256_file(out / name) for name in ("config.json", "model.safetensors")}


def test_load_without_manifest_reads_config_json_in_either_numbering(target, tmp_path, case):
    head = make_head(target, case)
    out = export(head, tmp_path / "head", dtype=torch.float32)
    (out / MANIFEST).unlink()
    loaded = load_eagle(out)
    c, got = head.config, loaded.config
    assert (got.kind, got.aux_layers, got.draft_vocab_size, got.hidden_size, got.head_dim) == \
        (c.kind, c.aux_layers, c.draft_vocab_size, c.hidden_size, c.head_dim)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in head.state_dict().items())
    if case == "eagle3":  # an SGLang-only config: nested ids, numbered one lower
        config = json.loads((out / "config.json").read_text())
        del config["eagle_aux_hidden_state_layer_ids"]
        (out / "config.json").write_text(json.dumps(config))
        assert load_eagle(out).config.aux_layers == (2, 4, 5)


BREAKS = {  # how a head is broken: the exporter's complaint
    "missing": ("eagle3", "missing: midlayer.mlp.down_proj.weight"),
    "mis-shaped": ("eagle3", "mis-shaped: lm_head.weight [99, 64] (expected [100, 64])"),
    "unexpected": ("eagle", "unexpected: extra.weight"),
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_exporter_refuses_a_broken_head_and_writes_nothing(target, tmp_path, broken):
    case, message = BREAKS[broken]
    head = make_head(target, case)
    if broken == "missing":
        head.midlayer.mlp.down_proj = nn.Identity()
    elif broken == "mis-shaped":
        head.lm_head = nn.Linear(64, DRAFT_VOCAB - 1, bias=False)
    else:
        head.extra = nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match="silently") as err:
        export(head, tmp_path / "head")
    assert message in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_exporter_refuses_inconsistent_vocabulary_maps(target, tmp_path):
    head = make_head(target, "eagle3")
    head.d2t[1] = head.d2t[0] - 1  # draft ids 0 and 1 now map to the same target id
    with pytest.raises(ValueError, match="one draft vocabulary"):
        export(head, tmp_path / "head")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("midlayer.hidden_norm.weight"), "missing: midlayer.hidden_norm.weight"),
    (lambda t: t.update({"embed_tokens.weight": torch.zeros(512, 64)}), "unexpected: embed_tokens.weight"),
    (lambda t: t.update({"fc.weight": torch.zeros(64, 128)}), "mis-shaped: fc.weight [64, 128] (expected [64, 192])"),
    (lambda t: t.update({"d2t": t["d2t"].int()}), "mis-typed: d2t torch.int32 (expected int64)"),
])
def test_load_refuses_a_broken_directory(target, tmp_path, edit, message):
    out = export(make_head(target, "eagle3"), tmp_path / "head")
    (out / MANIFEST).unlink()  # without a manifest (heads from elsewhere) only the tensor check stands guard
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match="silently") as err:
        load_eagle(out)
    assert message in str(err.value)


def test_load_refuses_a_tampered_file_and_a_nonzero_eagle_bias(target, tmp_path):
    out = export(make_head(target, "eagle"), tmp_path / "head")
    tensors = load_file(out / "model.safetensors")
    tensors["fc.bias"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors no longer match the SHA-256"):
        load_eagle(out)
    (out / MANIFEST).unlink()
    with pytest.raises(ValueError, match="fc.bias is not zero"):
        load_eagle(out)


def test_load_refuses_another_kind_of_export(target, tmp_path):
    out = export(make_head(target, "eagle"), tmp_path / "head")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "format": "medusa"}))
    with pytest.raises(ValueError, match="a 'medusa' export, not an EAGLE head"):
        load_eagle(out)


def test_exporter_refuses_an_existing_directory_unless_overwrite(target, tmp_path):
    out = export(make_head(target, "eagle"), tmp_path / "head")
    with pytest.raises(FileExistsError, match="overwrite"):
        export(make_head(target, "eagle3"), out)
    assert load_eagle(out).config.kind == "eagle"
    export(make_head(target, "eagle3"), out, overwrite=True)
    assert load_eagle(out).config.kind == "eagle3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_a_failed_export_leaves_no_partial_directory_and_keeps_the_old_one(target, tmp_path, monkeypatch):
    old = export(make_head(target, "eagle"), tmp_path / "old")
    old_files = {p.name: p.read_bytes() for p in old.iterdir()}

    def fail_after_weights(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        raise OSError("disk full")

    monkeypatch.setattr(eagle_export, "save_file", fail_after_weights)
    with pytest.raises(OSError, match="disk full"):
        export(make_head(target, "eagle3"), tmp_path / "new")
    with pytest.raises(OSError, match="disk full"):
        export(make_head(target, "eagle3"), old, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no new/, no staging directory
    assert {p.name: p.read_bytes() for p in old.iterdir()} == old_files


def test_serving_flags_for_vllm_and_sglang(target, tmp_path):
    out = export(make_head(target, "eagle3"), tmp_path / "head")
    flags = serving_flags(out, "heads/eagle3", 3)
    assert json.loads(flags["vllm_speculative_config"]) == {"method": "eagle3", "model": "heads/eagle3",
                                                            "num_speculative_tokens": 3}
    assert flags["vllm"] == f"--speculative-config '{flags['vllm_speculative_config']}'"
    assert flags["sglang"] == ("--speculative-algorithm EAGLE3 --speculative-draft-model-path heads/eagle3 "
                               "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    tree = serving_flags(out, "heads/eagle3", 3, TreeShape(3, 2, 4))  # SGLang counts the root: 4 nodes + 1
    assert "sglang_tree" not in flags and tree["sglang"] == flags["sglang"]
    assert tree["sglang_tree"] == ("--speculative-algorithm EAGLE3 --speculative-draft-model-path heads/eagle3 "
                                   "--speculative-num-steps 3 --speculative-eagle-topk 2 "
                                   "--speculative-num-draft-tokens 5")
    eagle = serving_flags(make_head(target, "eagle").config, "d", 5)
    assert json.loads(eagle["vllm_speculative_config"]) == {"method": "eagle", "model": "d",
                                                            "num_speculative_tokens": 5,
                                                            "draft_tensor_parallel_size": 1}
    assert eagle["sglang"].startswith("--speculative-algorithm EAGLE --")
    two_aux = EagleHead.from_target(target, "eagle3", aux_layers=(2, 5)).config  # SGLang's fc reads 3 layers
    assert "sglang" not in serving_flags(two_aux, "d", 3)
