"""SignRound through ``quantize`` on a tiny Llama: its learned codes written by every format (and ``--gguf``) and read
back as they were learned, and a killed run resumed from its per-layer checkpoints (toolkit/engine/resume.py) into
the checkpoint an uninterrupted run writes."""

import dataclasses
import json

import gguf
import pytest
import torch
from safetensors.torch import load_file

import toolkit.quantize as verb
from toolkit.quant.configs import make_config
from toolkit.quant.primitives import quantize_rtn
from toolkit.quantize import CalibrationSpec, QuantizeSettings, layers_directory, quantize
from toolkit.runtime.load import load_quantized
from toolkit.runtime.quant_linear import QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")
CALIBRATION = CalibrationSpec(samples=4, seq_len=32)


class Killed(BaseException):
    """What a Ctrl-C looks like to the run: not an ``Exception``, so the finished layers stay for a rerun."""


def _quantize(source, output, sym=False, fmt="auto", gguf=False, iters=20):
    config = make_config("signround", bits=4, group_size=32, sym=sym, gguf=gguf, iters=iters)
    return quantize(str(source), config, output, CALIBRATION, QuantizeSettings(format=fmt), overwrite=True).output


@pytest.fixture
def drivers(monkeypatch):
    """Wraps the driver ``quantize`` runs: records the layers it ran (``calls``), the weights it returned and
    round-to-nearest's of the same float weights (full names), and raises ``Killed`` at layer ``kill_at``."""

    class Spy:
        calls, learned, nearest, kill_at = [], {}, {}, None

    real = verb.driver_for

    def spying(config):
        driver = real(config)

        def run(session):
            Spy.calls.append(session.index)
            if session.index == Spy.kill_at:
                raise Killed
            prefix = f"model.layers.{session.index}."
            for name, linear in session.linears.items():
                Spy.nearest[prefix + name] = quantize_rtn(linear.weight.data, config.bits, config.group_size,
                                                          config.sym, rule=config.scale_rule)
            results = driver(session)
            Spy.learned.update({prefix + name: q for name, q in results.items()})
            return results

        return run

    monkeypatch.setattr(verb, "driver_for", spying)
    return Spy


# One GGUF run (about 50 s: transformers' GGUF reader), on signround's default asymmetric grid; GGUF's symmetric rule
# is held to round-to-nearest's codes in test_signround.py, and every method's Q4_0 file in test_gguf_export.py.
@pytest.mark.parametrize("sym,fmt,block", [
    (True, "gptq", None), (False, "awq", None), (False, "compressed-tensors", None), (False, "awq", "Q4_1"),
])
def test_every_format_holds_the_learned_codes(tmp_path, tiny_llama_dir, drivers, sym, fmt, block):
    out = _quantize(tiny_llama_dir, tmp_path / "ckpt", sym=sym, fmt=fmt, gguf=block is not None)
    manifest = json.loads((out / "compound.json").read_text())
    assert (manifest["format"], manifest["quantization"]["method"]) == (fmt, "signround")
    ours, _ = load_quantized(out, backend="reference")
    linears = {name: m for name, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert linears.keys() == drivers.learned.keys() and len(linears) == 2 * 7
    changed = 0
    for name, module in linears.items():
        q = drivers.learned[name]
        stored = dataclasses.replace(q, scale=q.scale.half().float())  # fp16 scales, as every format stores them here
        assert torch.equal(module.dequantized_weight(), stored.dequantize()), name
        changed += int((drivers.learned[name].codes != drivers.nearest[name].codes).sum())
    assert changed > 0  # the codes written are learned ones, not round-to-nearest's
    if block is None:
        return
    from transformers import AutoModelForCausalLM

    path = out / f"ckpt-{block}.gguf"
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} >= {block}
    theirs = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
    for name, module in linears.items():
        W, got = module.dequantized_weight(), theirs.get_submodule(name).weight.detach()
        # Q4_1 stores the minimum −scale·zero in fp16: half an fp16 ulp of it at most
        assert (got - W).abs().max() <= 2.0**-11 * W.abs().max() * 8, name


def test_a_killed_run_resumes_into_the_checkpoint_of_an_uninterrupted_one(tmp_path, tiny_llama_dir, drivers):
    whole = _quantize(tiny_llama_dir, tmp_path / "whole")
    assert drivers.calls == [0, 1] and not layers_directory(whole).exists()

    out, drivers.calls, drivers.kill_at = tmp_path / "resumed", [], 1
    with pytest.raises(Killed):
        _quantize(tiny_llama_dir, out)
    assert not out.exists()
    assert sorted(p.name for p in layers_directory(out).iterdir()) == ["key", "layer-0.pt"]

    drivers.calls, drivers.kill_at = [], None
    _quantize(tiny_llama_dir, out)
    assert drivers.calls == [1]  # layer 0 was loaded, not quantized again
    assert not layers_directory(out).exists()
    expected, got = load_file(whole / "model.safetensors"), load_file(out / "model.safetensors")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    manifests = [json.loads((d / "compound.json").read_text()) for d in (whole, out)]
    assert manifests[0]["layer_errors"] == manifests[1]["layer_errors"]


def test_saved_layers_of_other_settings_are_not_reused_and_a_failed_run_leaves_none(tmp_path, tiny_llama_dir,
                                                                                   drivers):
    out, drivers.kill_at = tmp_path / "q", 1
    with pytest.raises(Killed):
        _quantize(tiny_llama_dir, out, iters=20)
    assert (layers_directory(out) / "layer-0.pt").is_file()

    drivers.calls, drivers.kill_at = [], None
    _quantize(tiny_llama_dir, out, iters=21)  # another config: another key, so every layer runs again
    assert drivers.calls == [0, 1] and not layers_directory(out).exists()

    def failing(session):
        raise RuntimeError("a driver's own error")

    drivers.calls, drivers.kill_at = [], 1
    with pytest.raises(Killed):
        _quantize(tiny_llama_dir, tmp_path / "r")
    verb_driver = verb.driver_for
    try:
        verb.driver_for = lambda config: failing
        with pytest.raises(RuntimeError, match="a driver's own error"):
            _quantize(tiny_llama_dir, tmp_path / "r")
    finally:
        verb.driver_for = verb_driver
    # the rerun loaded layer 0, failed on layer 1 and removed what it had saved: a rerun would fail the same way
    assert not layers_directory(tmp_path / "r").exists() and not (tmp_path / "r").exists()
