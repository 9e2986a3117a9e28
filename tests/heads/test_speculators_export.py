"""EAGLE-3 heads in the speculators layout: exact round trips (reduced and full draft vocabulary), the golden config
keys and tensor names vLLM and speculators read, the same tensors as the EAGLE layout, the verifier train-heads
names, and refusal of broken heads, directories and configs."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eagle_export import (  # noqa: F401
    DRAFT_VOCAB, EAGLE3_TENSORS, LLAMA_CONFIG, TARGET, assert_same_head, make_head, target)
from torch import nn
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.formats.checkpoint import MANIFEST, sha256_file
from toolkit.heads.eagle_export import export_eagle
from toolkit.heads.load import load_head
from toolkit.heads.speculators_export import (
    expected_speculators_tensors,
    export_speculators,
    load_speculators,
    vllm_verifier,
)

VERIFIER = "/models/tiny-llama"
CASES = ["eagle3", "eagle3-full"]  # reduced draft vocabulary (100 of 512), full vocabulary

# vLLM 0.32.0 (transformers_utils/config.py, configs/speculators/base.py and algos.py; llama_eagle3.py) and speculators
# (config.py, proposals/greedy.py, models/eagle3/config.py and core.py): see toolkit.heads.speculators_export.
SPECULATORS_CONFIG = {
    "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
    "speculators_config": {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": VERIFIER, "architectures": ["LlamaForCausalLM"]},
    },
    "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": 64, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,  # vLLM: True
}
LAYER_CONFIG = LLAMA_CONFIG | {"dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
                               "num_aux_hidden_states": 3}  # vLLM's fc width: 3 unless this or an eagle_config says
SPECULATORS_TENSORS = {name.replace("midlayer.", "layers.0."): spec for name, spec in EAGLE3_TENSORS.items()}
FILES = ["compound.json", "config.json", "model.safetensors"]


@pytest.fixture(params=CASES)
def head(target, request):
    return make_head(target, request.param)


def export(head, out, **kwargs):
    return export_speculators(head, out, verifier=VERIFIER, verifier_architectures=["LlamaForCausalLM"],
                              speculative_tokens=3, target=TARGET, target_sha256="ab" * 32, **kwargs)


def test_fp32_round_trip_is_exact(target, head, tmp_path):
    out = export(head, tmp_path / "head", dtype=torch.float32)
    for loaded in (load_speculators(out), load_head(out).module):  # load_head tells the layouts apart
        assert_same_head(loaded, head, target)


def test_config_and_tensors_are_the_ones_vllm_and_speculators_read(target, tmp_path):
    head = make_head(target, "eagle3")
    out = export(head, tmp_path / "head")
    config = json.loads((out / "config.json").read_text())
    assert {key: config[key] for key in SPECULATORS_CONFIG} == SPECULATORS_CONFIG
    assert {key: config["transformer_layer_config"][key] for key in LAYER_CONFIG} == LAYER_CONFIG
    assert "model_type" not in config  # vLLM tells a speculators config by speculators_config without model_type
    assert expected_speculators_tensors(head.config) == SPECULATORS_TENSORS
    written = load_file(out / "model.safetensors")
    kinds = {torch.int64: "int64", torch.bool: "bool", torch.bfloat16: "float"}
    assert {name: (tuple(t.shape), kinds[t.dtype]) for name, t in written.items()} == SPECULATORS_TENSORS
    assert sorted(p.name for p in out.iterdir()) == FILES
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["format"], manifest["layout"], manifest["verifier"]) == ("eagle", "speculators", VERIFIER)
    assert manifest["eagle"] == head.config.to_dict() and manifest["target_sha256"] == "ab" * 32
    assert manifest["files"] == {name: sha256_file(out / name) for name in ("config.json", "model.safetensors")}


def test_full_vocabulary_has_no_maps(target, tmp_path):
    """vLLM 0.32 builds no draft_id_to_target_id when V_d = V (a d2t is refused), speculators no d2t/t2d buffers."""
    out = export(make_head(target, "eagle3-full"), tmp_path / "head")
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 512


def test_tensors_are_the_eagle_layouts_renamed(head, tmp_path):
    eagle = load_file(export_eagle(head, tmp_path / "eagle", target=TARGET, target_sha256=None) / "model.safetensors")
    speculators = load_file(export(head, tmp_path / "speculators") / "model.safetensors")
    assert {name.replace("midlayer.", "layers.0."): t for name, t in eagle.items()}.keys() == speculators.keys()
    assert all(torch.equal(t, speculators[name.replace("midlayer.", "layers.0.")]) for name, t in eagle.items())


def test_config_json_alone_rebuilds_the_head(head, tmp_path):
    out = export(head, tmp_path / "head", dtype=torch.float32)
    (out / MANIFEST).unlink()
    loaded = load_head(out).module
    c, got = head.config, loaded.config
    assert (got.kind, got.aux_layers, got.draft_vocab_size, got.vocab_size, got.hidden_size, got.head_dim) == \
        (c.kind, c.aux_layers, c.draft_vocab_size, c.vocab_size, c.hidden_size, c.head_dim)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in head.state_dict().items())


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("norm_before_residual"), "norm_before_residual false"),  # absent: vLLM normalises first
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc true"),
    (lambda c: c["transformer_layer_config"].update(attention_bias=True), "attention_bias true"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "'qwen3' layer"),
    (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), "no eagle_aux_hidden_state_layer_ids"),
])
def test_load_refuses_a_config_compound_does_not_compute(target, tmp_path, edit, message):
    out = export(make_head(target, "eagle3"), tmp_path / "head")
    (out / MANIFEST).unlink()
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_head(out).module


@pytest.mark.parametrize("case, edit, message", [
    ("eagle3", lambda t: t.update({"midlayer.hidden_norm.weight": t.pop("layers.0.hidden_norm.weight")}),
     "missing: layers.0.hidden_norm.weight; unexpected: midlayer.hidden_norm.weight"),  # the EAGLE layout's name
    ("eagle3", lambda t: t.update({"fc.weight": torch.zeros(64, 128)}),
     "mis-shaped: fc.weight [64, 128] (expected [64, 192])"),
    ("eagle3-full", lambda t: t.update({"d2t": torch.zeros(512, dtype=torch.long)}), "unexpected: d2t"),
])
def test_load_refuses_a_mismatched_tensor(target, tmp_path, case, edit, message):
    out = export(make_head(target, case), tmp_path / "head")
    (out / MANIFEST).unlink()  # without a manifest only the tensor check stands guard
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match="do not match the speculators layout") as err:
        load_speculators(out)
    assert message in str(err.value)


def test_load_refuses_a_changed_file(target, tmp_path):
    out = export(make_head(target, "eagle3"), tmp_path / "head")
    config = json.loads((out / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "elsewhere"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json no longer match the SHA-256"):
        load_head(out).module


def test_exporter_refuses_eagle1_and_broken_heads_writing_nothing(target, tmp_path):
    with pytest.raises(ValueError, match="holds EAGLE-3 heads"):
        export(make_head(target, "eagle"), tmp_path / "head")
    broken = make_head(target, "eagle3")
    broken.midlayer.mlp.down_proj = nn.Identity()
    with pytest.raises(ValueError, match="missing: layers.0.mlp.down_proj.weight"):
        export(broken, tmp_path / "head")
    with pytest.raises(ValueError, match="speculative_tokens must be at least 1"):
        export_speculators(make_head(target, "eagle3"), tmp_path / "head", verifier=VERIFIER,
                           verifier_architectures=[], speculative_tokens=0, target=TARGET, target_sha256=None)
    assert list(tmp_path.iterdir()) == []


def test_verifier_is_what_vllm_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    assert vllm_verifier("target") == str(tmp_path / "target")  # a local directory: absolute
    assert vllm_verifier("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for gguf in ("smollm2-135m", "model.gguf"):  # vLLM 0.32 has no GGUF loader
        with pytest.raises(ValueError, match="cannot load"):
            vllm_verifier(gguf)


def test_train_heads_writes_the_speculators_layout_beside_and_prints_its_serve_line(tiny_llama_dir, tmp_path,
                                                                                    one_thread):
    out = tmp_path / "eagle3"
    result = CliRunner().invoke(app, [
        "train-heads", "--model", str(tiny_llama_dir), "-o", str(out), "--head", "eagle3", "--samples", "4",
        "--max-len", "96", "--distill-tokens", "6", "--target-dtype", "float32", "--steps", "2",
        "--batch-size", "2", "--micro-batch-size", "1", "--eval-every", "2", "--save-every", "2", "--eval-prompts", "1",
        "--eval-tokens", "4", "--depth", "3", "--top-k", "2", "--draft-tokens", "4", "--ttt-steps", "2",
        "--draft-vocab", "300"])
    assert result.exit_code == 0, result.output
    eagle, speculators = load_head(out).module, load_head(out / "speculators").module
    assert speculators.config == eagle.config
    assert all(torch.equal(speculators.state_dict()[n], t) for n, t in eagle.state_dict().items())
    config = json.loads((out / "speculators" / "config.json").read_text())["speculators_config"]
    assert config["verifier"] == {"name_or_path": str(tiny_llama_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert config["proposal_methods"][0]["speculative_tokens"] == 3  # --depth: vLLM's chain
    assert "".join(f"vllm serve {out / 'speculators'}".split()) in "".join(result.output.split())
