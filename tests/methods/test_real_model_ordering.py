"""The claim each method exists for, on the real model: SmolLM2-135M-Instruct at W4 g64, held-out perplexity and KL
divergence from the float model; and the claim ``--rotate hadamard`` exists for, that GPTQ quantizes the rotated
weights closer to the float model than the original ones.

Each method quantizes the float model in process (the engine puts the dequantized weights in place), on 16×256
ShareGPT calibration tokens, and is scored against the float model on the same 8×256 held-out windows; the float
weights are restored from the float model between methods (loading the GGUF again costs 14 s); rotation + GPTQ runs
last, on the restored weights rotated in place. All use the asymmetric grid, so the ordering measures the method and
not the grid; GPTQ and AWQ+GPTQ run with act_order (static groups, so every format stores them).

Measured when written (CPU, torch 2.13; "1 thread / 2 threads" where the thread count changed the result, because
GPTQ's roundings follow float summation order):
    float 23.79; RTN 30.02; AWQ 27.40; GPTQ 27.17 / 28.14 (calibration seed 1: 28.01); AWQ+GPTQ 26.99 / 26.71;
    SignRound (20 iterations a layer on batches of 2 sequences, 1 thread) 28.40 (10 iterations: 31.74, worse than
    RTN: its step size is 1 / iterations), measured while it learned towards the float layer on the quantized inputs
    (it now learns towards the float model's outputs, in bfloat16; these assertions hold for it);
    GPTQ KL 0.187, top-1 74.9 %; rotation + GPTQ KL 0.149, top-1 78.1 %, perplexity 26.51.
Without act_order GPTQ is not distinguishable from RTN here (29.39 / 30.24, seeds 1 and 2: 30.24, 29.45; damp 0.1 or
an unweighted range search did not help), and with the symmetric grid it loses to RTN (33.88 against 32.36). Only the wide margins are
asserted: AWQ+GPTQ's lead over AWQ and GPTQ alone (0.2 to 1.4) is printed, not asserted.
Cost, single-threaded CPU seconds: load 14, quantize RTN < 5, GPTQ 42, AWQ 87, AWQ+GPTQ 105 (AWQ's scale search runs
the attention and MLP blocks 20 times a layer: ``max_tokens`` 1024 keeps it to a quarter of the default 4096, which
moved AWQ's perplexity from 27.26 to 27.40); the whole fixture 550 s on one thread beside another one-thread process
(SignRound 28.40, KL 0.226 when measured there).
"""

import copy

import pytest

from toolkit.calibration import calibration_batch, eval_windows
from toolkit.engine.loop import quantize_layers
from toolkit.evaluate.divergence import divergence
from toolkit.methods import driver_for
from toolkit.models import load_model, load_tokenizer
from toolkit.quant.configs import AWQConfig, AWQGPTQConfig, GPTQConfig, RTNConfig, SignRoundConfig
from toolkit.rotate import rotate_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
COMMON = dict(bits=4, group_size=64, sym=False)
CONFIGS = {
    "rtn": RTNConfig(**COMMON),
    "gptq": GPTQConfig(**COMMON, act_order=True),
    "awq": AWQConfig(**COMMON, max_tokens=1024),
    "awq+gptq": AWQGPTQConfig(**COMMON, act_order=True, max_tokens=1024),
    "signround": SignRoundConfig(**COMMON, iters=20),
    "rotation+gptq": GPTQConfig(**COMMON, act_order=True),
}
# Calibration sequences run through a layer at once: the engine's default, except for SignRound, whose iterations
# each take one batch (AutoRound's 8 sequences of 2048 tokens; here 2 of 256, so that 20 iterations a layer fit).
BATCH_SIZES = {"signround": 2}


@pytest.fixture(scope="module")
def scores():
    """{"float" | CONFIGS key: Divergence from the float model on the held-out windows}."""
    tokenizer = load_tokenizer(MODEL)
    tokens = calibration_batch(tokenizer, "sharegpt", samples=16, seq_len=256, seed=0)
    windows = eval_windows(tokenizer, "sharegpt", windows=8, seq_len=256)
    base = load_model(MODEL)
    model = copy.deepcopy(base)
    scores = {}
    for name, config in CONFIGS.items():
        model.load_state_dict(base.state_dict())
        if name == "rotation+gptq":
            rotate_model(model, config.seed)
        calibration = tokens if config.needs_activations else None
        quantize_layers(model, config, driver_for(config), calibration, sink=lambda *a: None,
                        batch_size=BATCH_SIZES.get(name, 8))
        scores[name] = divergence(model, base, windows)
    print(f"\nW4 g64 asymmetric on SmolLM2, against float (perplexity {scores['rtn'].base_perplexity:.2f}):",
          {name: f"perplexity {d.perplexity:.2f}, KL {d.kl:.4f}, top-1 {d.top1_agreement:.3f}"
           for name, d in scores.items()})  # with -s
    return scores


@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq", "signround"])
def test_method_beats_rtn(method, scores):
    """GPTQ with act_order: 27.2 to 28.1 against 30.02 in every run measured (without it, a coin flip; docstring)."""
    ours, rtn = scores[method], scores["rtn"]
    assert ours.base_perplexity < ours.perplexity < rtn.perplexity, scores


def test_rotation_plus_gptq_beats_gptq(scores):
    plain, rotated = scores["gptq"], scores["rotation+gptq"]
    assert rotated.kl < plain.kl and rotated.perplexity < plain.perplexity, scores
