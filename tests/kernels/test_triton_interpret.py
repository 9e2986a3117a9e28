"""The Triton W4A16 kernels under the CPU interpreter, against the torch oracle, for every layout.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels (it decides at decoration time), hence
the assignment above every import. Shapes stay small: the interpreter runs each program in numpy.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_cases import make_case  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from toolkit.kernels import reference as R  # noqa: E402

if not isinstance(tl.cdiv, InterpretedFunction):  # triton's library functions (tl.cdiv, tl.zeros) are @jit too
    pytest.skip("triton.language was imported before TRITON_INTERPRET=1 was set, so neither its @jit library "
                "functions nor the kernels can run in the interpreter; run `pytest tests/kernels` on its own, "
                "or export TRITON_INTERPRET=1", allow_module_level=True)

from toolkit.kernels.w4a16_awq import awq_w4a16  # noqa: E402
from toolkit.kernels.w4a16_ct import ct_w4a16  # noqa: E402
from toolkit.kernels.w4a16_gptq import gptq_w4a16  # noqa: E402

pytestmark = pytest.mark.triton

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def run(case, x, **overrides):
    t = {**case.tensors, **overrides}
    if case.layout == "gptq":
        return gptq_w4a16(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], case.group_size)
    if case.layout == "awq":
        return awq_w4a16(x, t["qweight"], t["qzeros"], t["scales"], case.group_size)
    return ct_w4a16(x, t["weight_packed"], t["weight_scale"], case.group_size,
                    weight_zero_point=t.get("weight_zero_point"), g_idx=t.get("g_idx"))


def error(case, x, W=None, **overrides):
    """Relative error of the kernel against the oracle on W (default: the case's true weight)."""
    y = run(case, x, **overrides)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], case.W.shape[0])
    return R.max_relative_error(y, R.w4a16_matmul_reference(x, case.W if W is None else W))


# ---- agreement with the oracle -----------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["gptq", "awq", "ct"])
def test_matches_reference(layout, dtype, group_size):
    case = make_case(layout, N=40, K=128, group_size=group_size)
    for M in (1, 17):  # split-K (decode) and GEMM variants
        x = torch.randn(M, 128, generator=torch.Generator().manual_seed(M)).to(dtype)
        assert error(case, x) < R.TOLERANCE[dtype], (M, layout, dtype, group_size)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize(("N", "K", "group_size"), [(40, 192, 64), (72, 128, 32), (72, 192, -1)])
@pytest.mark.parametrize("layout", ["gptq", "awq", "ct"])
def test_odd_shapes_are_masked(layout, M, N, K, group_size):
    """N off the 32-wide tile, K off the 64-deep tile (192 = 3 tiles, 2 split-K slices), M off the 16-row tile."""
    case = make_case(layout, N, K, group_size, seed=1)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(0)).half()
    assert error(case, x) < R.TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["gptq", "ct"])
def test_act_order(layout, dtype):
    case = make_case(layout, N=40, K=192, group_size=32, act_order=True, seed=2)
    assert not torch.equal(case.weight.g_idx, torch.arange(192, dtype=torch.int32) // 32)
    for M in (3, 17):
        x = torch.randn(M, 192, generator=torch.Generator().manual_seed(M)).to(dtype)
        assert error(case, x) < R.TOLERANCE[dtype]


def test_symmetric_ct_and_bf16_scales():
    case = make_case("ct", N=40, K=128, group_size=64, sym=True)
    assert "weight_zero_point" not in case.tensors
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert error(case, x) < R.TOLERANCE[torch.bfloat16]
    bf16_scale = case.tensors["weight_scale"].bfloat16()
    W = R.dequantize_ct(case.tensors["weight_packed"], bf16_scale, 64)
    assert error(case, x, W=W, weight_scale=bf16_scale) < R.TOLERANCE[torch.bfloat16]


def test_gptq_v2_zeros():
    case = make_case("gptq", N=40, K=128, group_size=32)
    w = case.weight
    w.zero[0, 0] = 0  # a zero v1 cannot store
    tensors = R.pack_gptq(w.codes, w.scale, w.zero, w.g_idx, zero_offset=0)
    W = R.dequantize_gptq(**tensors, zero_offset=0)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(0))
    y = gptq_w4a16(x, tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], 32,
                   checkpoint_format="gptq_v2")
    assert R.max_relative_error(y, R.w4a16_matmul_reference(x, W)) < R.TOLERANCE[torch.float32]


def test_leading_dims():
    case = make_case("awq", N=40, K=128, group_size=32)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).half()
    assert error(case, x) < R.TOLERANCE[torch.float16]


# ---- the comparison is sharp enough to catch layout bugs ----------------------------------------------------------


def _swap_nibble_pairs(words: torch.Tensor) -> torch.Tensor:
    """Exchange nibbles 2j and 2j+1 of every word: the bug of reading a word in the wrong order."""
    nib = R.nibbles(words)  # (..., 8)
    return R.words_from_nibbles(nib.view(*nib.shape[:-1], 4, 2).flip(-1).reshape(nib.shape))


@pytest.mark.parametrize("layout", ["gptq", "awq", "ct"])
def test_swapped_nibbles_fail(layout):
    case = make_case(layout, N=40, K=128, group_size=32)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(0)).half()
    name = {"gptq": "qweight", "awq": "qweight", "ct": "weight_packed"}[layout]
    assert error(case, x) < R.TOLERANCE[torch.float16]
    assert error(case, x, **{name: _swap_nibble_pairs(case.tensors[name])}) > 10 * R.TOLERANCE[torch.float16]


def test_awq_read_as_sequential_fails():
    """AWQ's interleave matters: the same codes packed sequentially along N must not pass for AWQ."""
    case = make_case("awq", N=40, K=128, group_size=32)
    w = case.weight
    sequential = R.words_from_nibbles(w.codes.t().reshape(128, 5, 8))  # (K, N/8), nibble i = column 8c + i
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).half()
    assert error(case, x, qweight=sequential) > 10 * R.TOLERANCE[torch.float16]


@pytest.mark.parametrize("layout", ["gptq", "ct"])
def test_shifted_g_idx_fails(layout):
    case = make_case(layout, N=40, K=192, group_size=32, act_order=True, seed=3)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(0))
    assert error(case, x) < R.TOLERANCE[torch.float32]
    shifted = (case.weight.g_idx + 1) % 6  # every column one group off
    assert error(case, x, g_idx=shifted) > 10 * R.TOLERANCE[torch.float32]


def test_g_idx_off_by_one_column_fails():
    """Even one column per group read with its neighbour's scale and zero breaks the fp32 tolerance."""
    case = make_case("gptq", N=40, K=128, group_size=32)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    assert error(case, x, g_idx=case.weight.g_idx.roll(1)) > 10 * R.TOLERANCE[torch.float32]


# ---- errors name the problem --------------------------------------------------------------------------------------


def test_wrapper_errors():
    case = make_case("gptq", N=40, K=128, group_size=32)
    t = case.tensors
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="input features"):
        gptq_w4a16(torch.randn(2, 64), t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        gptq_w4a16(x.double(), t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32)
    with pytest.raises(ValueError, match="does not divide"):
        gptq_w4a16(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 48)
    with pytest.raises(ValueError, match="qzeros has shape"):
        gptq_w4a16(x, t["qweight"], t["qzeros"][:2], t["scales"], t["g_idx"], 32)
    with pytest.raises(TypeError, match="qweight must be"):
        gptq_w4a16(x, t["qweight"].float(), t["qzeros"], t["scales"], t["g_idx"], 32)
    with pytest.raises(ValueError, match="checkpoint_format"):
        gptq_w4a16(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32, checkpoint_format="marlin")
    awq = make_case("awq", N=40, K=128, group_size=32).tensors
    with pytest.raises(ValueError, match="scales has shape"):
        awq_w4a16(x, awq["qweight"], awq["qzeros"], awq["scales"].t(), 32)
