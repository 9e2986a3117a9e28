"""EAGLE-3 heads for the targets beyond Llama that vLLM drafts for (its Qwen3 and Qwen3-MoE EAGLE-3 support), and for
Gemma 3: train-heads on a tiny Qwen3 (with a head width other than hidden / heads, as real Qwen3 has), a tiny Qwen3-MoE
and a tiny Gemma 3 through the CLI, then the export's names, shapes and config (the draft is a one-layer Llama over the
target's features, the layout vLLM's ``LlamaForCausalLMEagle3`` reads whatever the target), and validate --heads
decoding losslessly in every shape."""

import json

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_model
from toolkit.cli import app
from toolkit.heads.eagle_export import expected_eagle_tensors, load_eagle

# Gemma 3: sliding and global layers with RoPE schemes of their own (the head takes the global one), a scaled embedding
TARGETS = {"qwen3": dict(head_dim=32), "qwen3_moe": dict(layers=4),
           "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"] * 2)}


@pytest.mark.parametrize("model_type", list(TARGETS))
def test_train_heads_eagle3_on_a_qwen_target_exports_and_decodes_losslessly(model_type, smol_tokenizer, tmp_path,
                                                                             one_thread):
    target = tmp_path / model_type
    tiny_model(model_type, **{"layers": 4, **TARGETS[model_type]}).save_pretrained(target)
    smol_tokenizer.save_pretrained(target)
    out = tmp_path / "heads"
    result = CliRunner().invoke(app, [
        "train-heads", "--model", str(target), "-o", str(out), "--head", "eagle3", "--samples", "4", "--max-len", "96",
        "--distill-tokens", "6", "--target-dtype", "float32", "--steps", "2", "--batch-size", "2",
        "--micro-batch-size", "1", "--eval-every", "2", "--save-every", "2", "--eval-prompts", "1", "--eval-tokens",
        "4", "--depth", "3", "--top-k", "2", "--draft-tokens", "4", "--ttt-steps", "2", "--draft-vocab", "300"])
    assert result.exit_code == 0, result.output

    head = load_eagle(out)
    written = load_file(out / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in written.items()} == {
        name: shape for name, (shape, _) in expected_eagle_tensors(head.config).items()}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["head_dim"] == TARGETS[model_type].get("head_dim", 16)
    assert written["midlayer.self_attn.q_proj.weight"].shape[0] == 4 * config["head_dim"]

    checked = CliRunner().invoke(app, ["validate", "--model", str(target), "--heads", str(out), "--prompts", "1",
                                       "--max-new-tokens", "6", "--json", str(tmp_path / "v.json")])
    assert checked.exit_code == 0, checked.output
    reports = json.loads((tmp_path / "v.json").read_text())
    assert reports and all(r["lossless"] for r in reports)
