"""Medusa heads on disk: exact round trips in both layouts, the golden names and shapes each engine reads, and
refusal of incomplete heads (export) and of tampered or incomplete directories (load)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from toolkit.formats.checkpoint import MANIFEST, sha256_file
from toolkit.heads.medusa import MedusaConfig, MedusaHeads
from toolkit.heads.medusa_export import expected_medusa_tensors, export_medusa, load_medusa

H, V, K, L = 16, 50, 3, 2
CONFIG = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=K, num_layers=L)
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"

# vLLM 0.32.0, vllm/model_executor/models/medusa.py: Medusa.blocks is K ResidualBlock, each with ``layers`` = L
# nn.Linear(H, H, bias=config.medusa_fc_bias); Medusa.lm_heads is K ParallelLMHead(vocab_size, H).
# Medusa.load_weights strips "medusa_heads.", keeps the names in named_parameters() and ignores every other name.
VLLM_TENSORS = {
    "blocks.0.layers.0.weight": (16, 16), "blocks.0.layers.0.bias": (16,),
    "blocks.0.layers.1.weight": (16, 16), "blocks.0.layers.1.bias": (16,),
    "blocks.1.layers.0.weight": (16, 16), "blocks.1.layers.0.bias": (16,),
    "blocks.1.layers.1.weight": (16, 16), "blocks.1.layers.1.bias": (16,),
    "blocks.2.layers.0.weight": (16, 16), "blocks.2.layers.0.bias": (16,),
    "blocks.2.layers.1.weight": (16, 16), "blocks.2.layers.1.bias": (16,),
    "lm_heads.0.weight": (50, 16), "lm_heads.1.weight": (50, 16), "lm_heads.2.weight": (50, 16),
}
# vLLM 0.32.0, vllm/transformers_utils/configs/medusa.py (MedusaConfig) and models/medusa.py (getattr on the config).
VLLM_CONFIG = {
    "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 16, "vocab_size": 50,
    "truncated_vocab_size": 50, "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True,
    "original_lm_head": False,
}
# docs/formats.md §8.1 (FasterDecoding/Medusa: medusa_model_legacy.py): head k = Sequential(L ResBlocks, Linear(H, V)).
MEDUSA_TENSORS = {
    "0.0.linear.weight": (16, 16), "0.0.linear.bias": (16,), "0.1.linear.weight": (16, 16), "0.1.linear.bias": (16,),
    "1.0.linear.weight": (16, 16), "1.0.linear.bias": (16,), "1.1.linear.weight": (16, 16), "1.1.linear.bias": (16,),
    "2.0.linear.weight": (16, 16), "2.0.linear.bias": (16,), "2.1.linear.weight": (16, 16), "2.1.linear.bias": (16,),
    "0.2.weight": (50, 16), "1.2.weight": (50, 16), "2.2.weight": (50, 16),
}
MEDUSA_CONFIG = {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": TARGET}
WEIGHTS = {"vllm": "model.safetensors", "medusa": "medusa_lm_head.safetensors"}


@pytest.fixture
def heads() -> MedusaHeads:
    """Heads with every parameter random (a new head's blocks are zero, which would hide a swapped tensor)."""
    torch.manual_seed(0)
    heads = MedusaHeads(CONFIG)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    return heads


def export(heads, out, layout="vllm", **kwargs):
    return export_medusa(heads, out, layout=layout, target=TARGET, target_sha256="ab" * 32, **kwargs)


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
def test_fp32_round_trip_is_bit_exact(heads, tmp_path, layout):
    loaded = load_medusa(export(heads, tmp_path / "heads", layout, dtype=torch.float32))
    assert loaded.config == CONFIG
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    x = torch.randn(4, H)
    assert torch.equal(loaded(x), heads(x))


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
def test_bf16_round_trip_rounds_each_value_once(heads, tmp_path, layout):
    loaded = load_medusa(export(heads, tmp_path / "heads", layout, dtype=torch.bfloat16))
    for name, tensor in heads.state_dict().items():
        got = loaded.state_dict()[name]
        assert torch.equal(got, tensor.bfloat16().float()), name
        torch.testing.assert_close(got, tensor, rtol=2**-8, atol=0)  # bf16: 8 significant bits


def test_vllm_layout_has_the_names_shapes_and_config_vllm_reads(heads, tmp_path):
    out = export(heads, tmp_path / "heads")
    assert expected_medusa_tensors(CONFIG, "vllm") == VLLM_TENSORS
    written = load_file(out / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in written.items()} == VLLM_TENSORS
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    config = json.loads((out / "config.json").read_text())
    assert {key: config[key] for key in VLLM_CONFIG} == VLLM_CONFIG
    # vLLM's MedusaConfig.from_pretrained renames every key holding "num" and "heads"/"layers"; none other may exist
    assert sorted(key for key in config if "num" in key) == ["num_heads", "num_hidden_layers"]
    assert sorted(p.name for p in out.iterdir()) == ["compound.json", "config.json", "model.safetensors"]


def test_original_layout_has_fasterdecoding_names_and_config(heads, tmp_path):
    out = export(heads, tmp_path / "heads", "medusa")
    assert expected_medusa_tensors(CONFIG, "medusa") == MEDUSA_TENSORS
    written = load_file(out / "medusa_lm_head.safetensors")
    assert {name: tuple(t.shape) for name, t in written.items()} == MEDUSA_TENSORS
    assert json.loads((out / "config.json").read_text()) == MEDUSA_CONFIG
    assert sorted(p.name for p in out.iterdir()) == ["compound.json", "config.json", "medusa_lm_head.safetensors"]


def test_manifest_names_target_config_layout_and_file_hashes(heads, tmp_path):
    out = export(heads, tmp_path / "heads", extra_manifest={"training": {"steps": 7}})
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["target"] == TARGET and manifest["target_sha256"] == "ab" * 32
    assert manifest["layout"] == "vllm" and manifest["dtype"] == "bfloat16"
    assert manifest["medusa"] == CONFIG.to_dict() and manifest["training"] == {"steps": 7}
    assert manifest["files"] == {name: sha256_file(out / name) for name in ("config.json", "model.safetensors")}


def test_converting_layouts_is_load_then_export(heads, tmp_path):
    vllm = export(heads, tmp_path / "vllm", dtype=torch.float32)
    original = export(load_medusa(vllm), tmp_path / "original", "medusa", dtype=torch.float32)
    back = load_medusa(original)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in heads.state_dict().items())


BREAKS = {  # how the heads are broken: the exporter's complaint in each layout
    "missing": {"vllm": "missing: blocks.1.layers.0.bias, blocks.1.layers.0.weight",
                "medusa": "missing: 1.0.linear.bias, 1.0.linear.weight"},
    "mis-shaped": {"vllm": "mis-shaped: lm_heads.2.weight [49, 16] (expected [50, 16])",
                   "medusa": "mis-shaped: 2.2.weight [49, 16] (expected [50, 16])"},
    "unexpected": {"vllm": "unexpected: extra.weight", "medusa": "unexpected: extra.weight"},
}


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
@pytest.mark.parametrize("broken", list(BREAKS))
def test_exporter_refuses_incomplete_heads_and_writes_nothing(heads, tmp_path, layout, broken):
    if broken == "missing":
        heads.blocks[1][0] = nn.Identity()
    elif broken == "mis-shaped":
        heads.lm_heads[2] = nn.Linear(H, V - 1, bias=False)
    else:
        heads.extra = nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match="silently") as err:
        export(heads, tmp_path / "heads", layout)
    assert BREAKS[broken][layout] in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_exporter_refuses_an_existing_directory_unless_overwrite(heads, tmp_path):
    out = export(heads, tmp_path / "heads")
    with pytest.raises(FileExistsError, match="overwrite"):
        export(heads, out)
    export(heads, out, layout="medusa", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["compound.json", "config.json", "medusa_lm_head.safetensors"]


def test_unknown_layout_is_refused(heads, tmp_path):
    with pytest.raises(ValueError, match="unknown Medusa layout 'sglang'"):
        export(heads, tmp_path / "heads", "sglang")


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
def test_load_refuses_a_tampered_file(heads, tmp_path, layout):
    out = export(heads, tmp_path / "heads", layout)
    weights = out / WEIGHTS[layout]
    tensors = load_file(weights)
    first = next(iter(tensors))
    tensors[first] = tensors[first] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{WEIGHTS[layout]} no longer match the SHA-256"):
        load_medusa(out)


@pytest.mark.parametrize("layout, dropped", [("vllm", "lm_heads.1.weight"), ("medusa", "1.2.weight")])
def test_load_refuses_a_missing_tensor(heads, tmp_path, layout, dropped):
    out = export(heads, tmp_path / "heads", layout)
    (out / MANIFEST).unlink()  # without a manifest (heads from elsewhere) only the key check stands guard
    weights = out / WEIGHTS[layout]
    tensors = load_file(weights)
    del tensors[dropped]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing: {dropped}"):
        load_medusa(out)


def test_load_refuses_vllm_heads_without_biases(heads, tmp_path):
    out = export(heads, tmp_path / "heads")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    (out / MANIFEST).unlink()
    with pytest.raises(ValueError, match="medusa_fc_bias false"):
        load_medusa(out)


def test_shared_lm_head_round_trip_in_vllm_layout(tmp_path):
    """Medusa-2's layout: blocks per head and one lm_head, stored as lm_heads.0.weight with original_lm_head true
    (vllm/model_executor/models/medusa.py maps that name to its single ``lm_head`` when the flag is set)."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(16, 50, num_heads=3, num_layers=1, shared_lm_head=True))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    out = export_medusa(heads, tmp_path / "shared", target="t", target_sha256=None, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["original_lm_head"] is True and config["num_heads"] == 3
    names = set(load_file(out / "model.safetensors"))
    assert names == {f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias")} | {"lm_heads.0.weight"}
    back = load_medusa(out)
    assert back.config.shared_lm_head
    hidden = torch.randn(4, 16)
    assert torch.equal(back(hidden), heads(hidden))
    with pytest.raises(ValueError, match="vllm layout"):
        export_medusa(heads, tmp_path / "orig", layout="medusa", target="t", target_sha256=None)
