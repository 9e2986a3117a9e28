"""SignRound (toolkit/quant/signround.py, toolkit/methods/signround.py) on tiny random Llamas: round-to-nearest's codes
bit for bit at 0 iterations, a lower layer-output error than round-to-nearest's with iterations, the learned state in
its ranges, bad options refused naming the flag."""

import copy

import pytest
import torch
from conftest import tiny_model
from typer.testing import CliRunner

from conftest import refused
from toolkit.architectures import supporting
from toolkit.cli import app
from toolkit.engine.loop import quantize_layers
from toolkit.engine.session import LayerSession, capture_layer_inputs
from toolkit.methods import driver_for, signround
from toolkit.models import decoder_layers, layer_linears
from toolkit.quant.configs import ConfigError, RTNConfig, SignRoundConfig, make_config
from toolkit.quant.primitives import GGUF_RULE, quantize_rtn
from toolkit.quant.signround import CLIP_RANGE, OFFSET_BOUND, Rounding

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128


def tokens(seed=0, samples=16, seq_len=32):
    return torch.randint(0, VOCAB, (samples, seq_len), generator=torch.Generator().manual_seed(seed))


def run(config, model, calibration=None):
    """Quantize a copy of ``model`` with ``config``: (the quantized copy, full name → QuantizedWeight, errors)."""
    model, sunk = copy.deepcopy(model), {}
    errors = quantize_layers(model, config, driver_for(config), calibration, sunk.__setitem__, batch_size=4)
    return model, sunk, errors


def test_options_and_defaults():
    config = make_config("signround", iters=50)
    assert driver_for(config) is signround.quantize_layer
    assert (config.sym, config.iters, config.rounding_lr, config.clipping_lr) == (False, 50, 1 / 50, 1 / 50)
    assert make_config("signround").rounding_lr == 1 / 200  # AutoRound's default: lr = 1/iters at 200 iterations
    assert make_config("signround", lr=0.01, minmax_lr=0.002).clipping_lr == 0.002
    assert make_config("signround", lr=0.01).clipping_lr == 0.01


@pytest.mark.parametrize("options,message", [
    (dict(iters=-1), "--iters must be 0 or more"),
    (dict(lr=0.0), "--lr must be positive, got 0.0"),
    (dict(lr=-0.1), "--lr must be positive"),
    (dict(minmax_lr=float("nan")), "--minmax-lr must be positive"),
])
def test_bad_options_name_the_flag(options, message):
    with pytest.raises(ConfigError, match=message):
        make_config("signround", **options)


def test_bad_options_exit_2_on_the_command_line(tmp_path, tiny_llama_dir):
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama_dir), "--method", "signround",
                                      "--iters", "-3", "-o", str(tmp_path / "q")])
    refused(result, "--iters must be 0 or more")
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama_dir), "--method", "rtn", "--lr", "0.1",
                                      "-o", str(tmp_path / "q")])
    refused(result, "method 'rtn' takes no option(s) lr")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("sym,group_size,gguf", [
    (True, 32, False), (False, 32, False), (False, 64, False), (True, -1, False), (True, 32, True), (False, 32, True),
])
def test_zero_iterations_give_round_to_nearests_codes_bit_for_bit(sym, group_size, gguf):
    model = tiny_model("llama", vocab=VOCAB)
    common = dict(bits=4, group_size=group_size, sym=sym, gguf=gguf)
    _, rtn, _ = run(RTNConfig(**common), model)
    _, learned, errors = run(SignRoundConfig(**common, iters=0), model, tokens())
    assert rtn.keys() == learned.keys() and len(rtn) == 2 * 7
    for name, q in rtn.items():
        for field in ("codes", "scale", "zero", "g_idx"):
            assert torch.equal(getattr(learned[name], field), getattr(q, field)), (name, field)
        assert (learned[name].bits, learned[name].group_size, learned[name].sym) == (4, group_size, sym)
    assert set(errors.values()) == {1.0}


def test_rounding_per_channel_with_different_widths_is_round_to_nearest_at_start():
    """Per channel, down_proj's groups are twice as wide as the others': two buckets, each round-to-nearest's."""
    generator = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(8, 64, generator=generator), "b": torch.randn(4, 128, generator=generator)}
    rounding = Rounding(weights, 3, -1, False, GGUF_RULE)
    assert len(rounding.buckets) == 2
    for name, q in rounding.quantized().items():
        expected = quantize_rtn(weights[name], 3, -1, False, rule=GGUF_RULE)
        assert torch.equal(q.codes, expected.codes) and torch.equal(q.scale, expected.scale)
        assert torch.allclose(rounding.weights()[name], expected.dequantize())


def test_steps_keep_offsets_and_clipping_in_their_ranges():
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    rounding = Rounding({"w": W}, 4, 32, True)
    for _ in range(40):
        grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(2)) for t in rounding.learned]
        rounding.step(grads, 0.1, 0.1)
    bucket = rounding.buckets[0]
    assert bucket.offset.abs().max() == OFFSET_BOUND
    for clip in (bucket.low, bucket.high):
        assert clip.min() == CLIP_RANGE[0] and clip.max() == CLIP_RANGE[1]
    q = rounding.quantized()["w"]
    # clipped ranges: every group's scale is at most round-to-nearest's
    assert bool((q.scale <= quantize_rtn(W, 4, 32, True).scale + 1e-7).all())


@torch.no_grad()
def layer_output_errors(model, reference, calibration):
    """Squared error of every decoder layer's output, quantized model against the float one."""
    ours = model.model(calibration, output_hidden_states=True).hidden_states[1:]
    theirs = reference.model(calibration, output_hidden_states=True).hidden_states[1:]
    return [float((a - b).square().sum()) for a, b in zip(ours, theirs)]


@pytest.mark.parametrize("sym", [False, True])
def test_iterations_lower_the_layer_output_error_below_round_to_nearests(sym):
    reference = tiny_model("llama", vocab=VOCAB)
    calibration = tokens()
    rtn_model, _, _ = run(RTNConfig(group_size=32, sym=sym), reference)
    learned_model, sunk, errors = run(SignRoundConfig(group_size=32, sym=sym, iters=40), reference, calibration)
    rtn_errors = layer_output_errors(rtn_model, reference, calibration)
    learned_errors = layer_output_errors(learned_model, reference, calibration)
    # Measured: the learned layers' squared output errors are 0.36 to 0.44 of round-to-nearest's (both grids)
    for rtn_error, learned_error in zip(rtn_errors, learned_errors):
        assert learned_error < 0.8 * rtn_error, (rtn_errors, learned_errors)
    assert all(e < 0.8 for e in errors.values()), errors  # each layer's own measure: output error relative to RTN's
    for name, q in sunk.items():
        assert torch.equal(learned_model.get_submodule(name).weight, q.dequantize())
        assert q.sym == sym and int(q.codes.max()) <= 15


def test_the_loss_goes_down_and_the_best_iterate_is_kept():
    model = tiny_model("llama", vocab=VOCAB)
    config = SignRoundConfig(group_size=32, iters=60)
    inputs = capture_layer_inputs(model, tokens(), 4)
    layer = decoder_layers(model)[0]
    session = LayerSession(0, layer, inputs, config, dict(layer_linears(layer)))
    with torch.no_grad():
        fit = signround.fit_layer(session)
    losses = fit.history.losses
    assert len(losses) == 60 and 0 <= fit.history.best < 60
    assert losses[fit.history.best] == min(losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4  # each of the 4 batches once
    assert last < 0.6 * first, losses
    assert 0 < fit.error < 0.6 * fit.rtn_error
    # the float layer is untouched: the fake-quantized weights were only passed in
    assert all(torch.equal(m.weight, decoder_layers(tiny_model("llama", vocab=VOCAB))[0].get_submodule(n).weight)
               for n, m in layer_linears(layer).items())


@pytest.mark.parametrize("model_type", supporting())
def test_every_family_learns_without_losing_to_round_to_nearest(model_type):
    """One calibration batch, so the best iterate's loss is the whole batch's: never above round-to-nearest's."""
    model = tiny_model(model_type, vocab=VOCAB)
    config = SignRoundConfig(group_size=32, iters=8, moe_min_tokens=1)
    _, sunk, errors = run(config, model, tokens(samples=4))
    assert len(sunk) == sum(len(layer_linears(layer)) for layer in decoder_layers(model))
    assert max(errors.values()) <= 1 + 1e-5 and min(errors.values()) < 1, errors
