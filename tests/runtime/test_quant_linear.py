"""QuantLinear's backends against its reference path (dequantize-then-matmul), on tiny checkpoints of every layout.

cpu-int4 computes in bf16, so it is checked weight by weight: x = I_K makes the op return the weight it holds, and
every element must lie within a quarter of its own quantization step (scale) of the reference. bf16 costs at most
~0.12 step there (the scale, the zero offset and the output each rounded to 8 significant bits, |code − zero| ≤ 15);
a wrong nibble or zero costs ≥ 1 step, a wrong group a different scale — the last test shows one flipped bit fails.

TRITON_INTERPRET is set before anything imports Triton (it decides at decoration time), as in
tests/kernels/test_triton_interpret.py; the Triton tests skip if Triton was already imported compiled.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from toolkit.kernels import reference as R  # noqa: E402

from toolkit.quant.configs import RTNConfig  # noqa: E402
from toolkit.quantize import QuantizeSettings, quantize  # noqa: E402
from toolkit.runtime.load import CheckpointError, load_quantized  # noqa: E402
from toolkit.runtime.quant_linear import CPU_INT4_MAX_ROWS, QuantLinear, SharedInputLinears, set_backend  # noqa: E402

FORMATS = {  # format → whether its weights are symmetric (each layout's own zero handling gets exercised)
    "gptq": True,
    "awq": False,
    "compressed-tensors": False,
    "compressed-tensors-sym": True,
}


def _interpreting() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


needs_interpreter = pytest.mark.skipif(
    not _interpreting(), reason="triton.language was imported before TRITON_INTERPRET=1 was set; run this file alone")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("backends")
    return {name: quantize(str(tiny_llama_dir), RTNConfig(bits=4, group_size=32, sym=sym), root / name,
                           settings=QuantizeSettings(format=name.removesuffix("-sym"))).output
            for name, sym in FORMATS.items()}


def _linears(model) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def _step(m: QuantLinear) -> torch.Tensor:
    """The quantization step (scale) of every weight, [N, K]."""
    w = m.layout.unpack(m.packed(), m.bits, m.group_size)
    return w.scale[:, w.g_idx.long()]  # (N, G) → (N, K)


def _int4_weight(m: QuantLinear) -> torch.Tensor:
    """W [N, K] as the cpu-int4 path computes it: its output for x = I_K."""
    eye = torch.eye(m.in_features)
    assert m.path(eye) == "cpu-int4"
    return m(eye).t()


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_int4_holds_every_weight_within_a_quarter_step(checkpoints, fmt):
    model, _ = load_quantized(checkpoints[fmt], backend="cpu-int4")
    linears = _linears(model)
    assert len(linears) == 14
    for name, m in linears.items():
        error = (_int4_weight(m) - m.dequantized_weight()).abs() / _step(m)
        assert error.max() < 0.25, (name, error.max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_int4_model_matches_the_reference(checkpoints, fmt):
    model, _ = load_quantized(checkpoints[fmt], backend="reference")
    tokens = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens).logits
        set_backend(model, "cpu-int4")
        got = model(tokens).logits
    assert R.max_relative_error(got, expected) < R.TOLERANCE[torch.bfloat16]


@needs_interpreter
@pytest.mark.triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_matches_the_reference(checkpoints, fmt):
    model, _ = load_quantized(checkpoints[fmt], backend="reference")
    for name, m in _linears(model).items():
        for M in (1, 20):  # split-K (decode) and GEMM variants of the kernel
            x = torch.randn(M, m.in_features, generator=torch.Generator().manual_seed(M))
            expected = m(x)
            m.backend = "triton"
            assert m.path(x) == "triton"
            assert R.max_relative_error(m(x), expected) < R.TOLERANCE[torch.float32], (name, M)
            m.backend = "reference"
    tokens = torch.randint(0, 49152, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
        set_backend(model, "triton")
        got = model(tokens).logits
    assert R.max_relative_error(got, expected) < R.TOLERANCE[torch.float32]


def test_auto_runs_int4_for_small_inputs_and_the_reference_for_large(checkpoints):
    model, _ = load_quantized(checkpoints["gptq"])
    m = _linears(model)["model.layers.0.mlp.down_proj"]
    assert m.backend == "auto"
    assert m.path(torch.zeros(1, m.in_features)) == "cpu-int4"
    assert m.path(torch.zeros(2, CPU_INT4_MAX_ROWS // 2, m.in_features)) == "cpu-int4"
    assert m.path(torch.zeros(CPU_INT4_MAX_ROWS + 1, m.in_features)) == "reference"
    m.backend = "reference"
    assert m.path(torch.zeros(1, m.in_features)) == "reference"


def test_backends_that_cannot_run_a_checkpoint_are_refused(tmp_path, tiny_llama_dir, checkpoints):
    out = quantize(str(tiny_llama_dir), RTNConfig(bits=8, group_size=32), tmp_path / "w8").output
    model, _ = load_quantized(out)  # auto: 8-bit runs the reference
    assert {m.path(torch.zeros(1, m.in_features)) for m in _linears(model).values()} == {"reference"}
    for backend in ("cpu-int4", "triton"):
        with pytest.raises(CheckpointError, match="4-bit weights only"):
            load_quantized(out, backend=backend)
    with pytest.raises(CheckpointError, match="unknown backend 'cuda'"):
        load_quantized(checkpoints["gptq"], backend="cuda")
    with pytest.raises(ValueError, match="4-bit weights only"):
        set_backend(model, "cpu-int4")


def test_one_flipped_bit_breaks_the_quarter_step_check(checkpoints):
    """The negative control: the tolerance above is tight enough to see a single code off by one."""
    model, _ = load_quantized(checkpoints["gptq"], backend="cpu-int4")
    m = _linears(model)["model.layers.0.self_attn.q_proj"]
    expected, step = m.dequantized_weight(), _step(m)
    m.qweight[0, 0] ^= 1  # code of input row 0, output column 0 changes by ±1
    error = (_int4_weight(m) - expected).abs() / step
    assert error[0, 0] > 0.9 and error.max() > 0.25


def _shared_input(model, names):
    linears = _linears(model)
    return [linears[f"model.layers.0.{n}"] for n in names]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("names", [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                   ("mlp.gate_proj", "mlp.up_proj")])
def test_shared_input_linears_fuse_into_one_int4_matmul_with_the_same_outputs(checkpoints, fmt, names):
    model, _ = load_quantized(checkpoints[fmt], backend="cpu-int4")
    linears = _shared_input(model, names)
    for m in linears:  # biases (Qwen2's q/k/v) are concatenated too
        m.bias = torch.randn(m.out_features, generator=torch.Generator().manual_seed(m.out_features))
    fused = SharedInputLinears(linears)
    x = torch.randn(3, linears[0].in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    got = fused(x)
    assert fused._int4 is not None and all(m._int4 is None for m in linears)  # one packed weight, not one each
    for y, m in zip(got, linears):
        assert y.shape == (3, m.out_features)
        assert R.max_relative_error(y.float(), m(x).float()) < 1e-2  # the same bf16 op, rows in another order


def test_shared_input_linears_run_one_call_each_off_the_int4_path(checkpoints):
    model, _ = load_quantized(checkpoints["gptq"], backend="reference")
    linears = _shared_input(model, ("mlp.gate_proj", "mlp.up_proj"))
    fused = SharedInputLinears(linears)
    x = torch.randn(2, linears[0].in_features)
    assert all(torch.equal(y, m(x)) for y, m in zip(fused(x), linears)) and fused._int4 is None
    linears[1].g_idx = linears[1].g_idx.flip(0)  # act-order with another column order: no shared packing
    set_backend(model, "cpu-int4")
    assert all(torch.equal(y, m(x)) for y, m in zip(fused(x), linears)) and fused._int4 is None
