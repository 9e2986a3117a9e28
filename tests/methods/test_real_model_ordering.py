"""The claim each method exists for, on the real model: SmolLM2-135M-Instruct at W4 g64, held-out perplexity.

Each method quantizes the float model in process (the engine puts the dequantized weights in place), on 16×256
ShareGPT calibration tokens, and is scored on the same 8×256 held-out windows; the float weights are restored from a
copy between methods (loading the GGUF again costs 14 s). All five use the asymmetric grid, so the ordering measures the method and not the grid; GPTQ and AWQ+GPTQ run
with act_order (static groups, so every format stores them).

Measured when written (CPU, torch 2.13; "1 thread / 2 threads" where the thread count changed the result, because
GPTQ's roundings follow float summation order):
    float 23.79; RTN 30.02; AWQ 27.40; GPTQ 27.17 / 28.14 (calibration seed 1: 28.01); AWQ+GPTQ 26.99 / 26.71;
    SignRound (20 iterations a layer on batches of 2 sequences, 1 thread) 28.40.
Without act_order GPTQ is not distinguishable from RTN here (29.39 / 30.24, seeds 1 and 2: 30.24, 29.45; damp 0.1 or
mse_clip do not help), and with the symmetric grid it loses to RTN (33.88 against 32.36). Only the wide margins are
asserted: AWQ+GPTQ's lead over AWQ and GPTQ alone (0.2 to 1.4) is printed, not asserted.
Cost, single-threaded CPU seconds: load 14 per model, eval 7 each, quantize RTN < 5, GPTQ 42, AWQ 87, AWQ+GPTQ 105
(AWQ's scale search runs the attention and MLP blocks 20 times a layer: ``max_tokens`` 1024 keeps it to a quarter of
the default 4096, which moved AWQ's perplexity from 27.26 to 27.40).
"""

import pytest
from toolkit.calibration import calibration_batch, eval_windows

from toolkit.engine.loop import quantize_layers
from toolkit.evaluate.perplexity import perplexity
from toolkit.methods import driver_for
from toolkit.models import load_model, load_tokenizer
from toolkit.quant.configs import AWQConfig, AWQGPTQConfig, GPTQConfig, RTNConfig, SignRoundConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
COMMON = dict(bits=4, group_size=64, sym=False)
CONFIGS = {
    "rtn": RTNConfig(**COMMON),
    "gptq": GPTQConfig(**COMMON, act_order=True),
    "awq": AWQConfig(**COMMON, max_tokens=1024),
    "awq+gptq": AWQGPTQConfig(**COMMON, act_order=True, max_tokens=1024),
    "signround": SignRoundConfig(**COMMON, iters=20),
}
# Calibration sequences run through a layer at once: the engine's default, except for SignRound, whose iterations
# each take one batch (AutoRound's 8 sequences of 2048 tokens; here 2 of 256, so that 20 iterations a layer fit).
BATCH_SIZES = {"signround": 2}


@pytest.fixture(scope="module")
def scores():
    tokenizer = load_tokenizer(MODEL)
    tokens = calibration_batch(tokenizer, "sharegpt", samples=16, seq_len=256, seed=0)
    windows = eval_windows(tokenizer, "sharegpt", windows=8, seq_len=256)
    model = load_model(MODEL)
    float_weights = {name: t.clone() for name, t in model.state_dict().items()}
    scores = {"float": perplexity(model, windows).perplexity}
    for config in CONFIGS.values():
        model.load_state_dict(float_weights)
        calibration = tokens if config.needs_activations else None
        quantize_layers(model, config, driver_for(config), calibration, sink=lambda *a: None,
                        batch_size=BATCH_SIZES.get(config.method, 8))
        scores[config.method] = perplexity(model, windows).perplexity
    print("\nheld-out perplexity, W4 g64 asymmetric:", {k: round(v, 2) for k, v in scores.items()})  # with -s
    return scores


def test_gptq_beats_rtn(scores):
    """With act_order: 27.2 to 28.1 against 30.02 in every run measured (without it, a coin flip; module docstring)."""
    assert scores["float"] < scores["gptq"] < scores["rtn"], scores


def test_awq_beats_rtn(scores):
    assert scores["float"] < scores["awq"] < scores["rtn"], scores


def test_awq_gptq_beats_rtn(scores):
    assert scores["float"] < scores["awq+gptq"] < scores["rtn"], scores


def test_signround_beats_rtn(scores):
    assert scores["float"] < scores["signround"] < scores["rtn"], scores
