"""The upcycled MoE of ``benchmarks/moe_upcycle.py`` (SmolLM2-135M copied into a 4-expert top-2 Mixtral): saved with
transformers' per-expert Hub names, read back by ``toolkit.models.load_model``, its logits equal SmolLM2's on real
ShareGPT windows, and its random routers spread the tokens over every expert. The benchmark's quality claims about MoE
calibration (``benchmarks/moe.py``) stand on these two facts."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parent.parent


def _builder():
    spec = importlib.util.spec_from_file_location("moe_upcycle", ROOT / "benchmarks" / "moe_upcycle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def test_upcycled_mixtral_equals_smollm2_and_routes_to_every_expert(tmp_path):
    from toolkit.calibration import eval_windows
    from toolkit.experts import ExpertLinears
    from toolkit.models import load_model, load_tokenizer

    directory = _builder().build(tmp_path / "upcycled")
    model = load_model(str(directory))  # the saved checkpoint, experts unfused by compound's loader
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4
    blocks = [m for m in model.modules() if isinstance(m, ExpertLinears)]
    assert len(blocks) == model.config.num_hidden_layers

    dense = load_model("smollm2-135m")
    windows = eval_windows(load_tokenizer("smollm2-135m"), "sharegpt", 4, 256)  # held-out ShareGPT text
    routed = []  # per layer: [T, 2] expert indices
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[2]))
             for layer in model.model.layers]
    for row in windows:
        expected = dense(row[None]).logits
        got = model(row[None]).logits
        assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    for h in hooks:
        h.remove()

    experts = model.config.num_local_experts
    for layer in range(model.config.num_hidden_layers):
        picks = torch.cat(routed[layer::model.config.num_hidden_layers]).flatten()
        # each expert's share of the layer's (token, slot) assignments: 25 % when balanced, at most 50 % (top-2)
        share = torch.bincount(picks, minlength=experts).float() / picks.numel()
        assert ((share >= 0.05) & (share <= 0.45)).all(), f"layer {layer}: share of routed tokens {share.tolist()}"
