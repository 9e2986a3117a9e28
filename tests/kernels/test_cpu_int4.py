"""toolkit.runtime.cpu_int4: torch's CPU int4 mm fed GPTQ/AWQ/CT weights, against the torch oracle.

The conversion W = scale·(q − z) = (q − 8)·scale + (8 − z)·scale is proved by multiplying the identity: with
x = I (fp32), the op returns W.T itself, so every weight the op reconstructs is compared, not a projection of it.
"""

import pytest
import torch
from kernel_cases import make_case

from toolkit.formats import gptq as gptq_format
from toolkit.kernels import reference as R
from toolkit.quant.primitives import quantize_rtn
from toolkit.runtime import cpu_int4
from toolkit.runtime.cpu_int4 import int4_mm_cpu, prepare_int4_cpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def prepare(case):
    """Codes, scale and integer zero as every layout defines them, from the weight behind a case."""
    w = case.weight
    g_idx = w.g_idx if case.layout != "awq" else None
    return prepare_int4_cpu(w.codes, w.scale, case.zero, case.group_size, g_idx=g_idx)


def reconstructed_weight(handle) -> torch.Tensor:
    """W [N, K] as torch's op sees it: I_K @ W.T, computed in fp32."""
    return int4_mm_cpu(torch.eye(handle.K), handle, compute_dtype=torch.float32).t()


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize(("layout", "sym", "act_order"),
                         [("gptq", False, False), ("gptq", True, True), ("awq", False, False), ("ct", True, False),
                          ("ct", False, True)])
def test_identity_reconstructs_the_weight(layout, sym, act_order, group_size):
    """N = 40 is padded to 48; group sizes 32..128 run natively, per-channel as 4 sub-groups of 32."""
    case = make_case(layout, N=40, K=128, group_size=group_size, act_order=act_order and group_size != -1, sym=sym)
    torch.testing.assert_close(reconstructed_weight(prepare(case)), case.W, rtol=1e-6, atol=1e-6)


def test_conversion_formula():
    scale, zero = torch.tensor([[0.5, 0.25]]), torch.tensor([[3, 8]])
    torch_scale, torch_zero = cpu_int4._torch_scale_and_zero(scale, zero)
    assert torch.equal(torch_scale, scale)
    assert torch_zero.tolist() == [[2.5, 0.0]]  # (8 − z)·scale; symmetric (z = 8) has no offset
    q = torch.arange(16.0).view(16, 1, 1)
    torch.testing.assert_close((q - 8) * torch_scale + torch_zero, scale * (q - zero), rtol=0, atol=1e-7)


@pytest.mark.parametrize("wrong", [lambda s, z: (s, z * s), lambda s, z: (s, -z * s), lambda s, z: (s, (8 - z).float())])
def test_a_wrong_conversion_fails(monkeypatch, wrong):
    """z·s, −z·s, or the zero left in code units: each misses the −8 of torch's convention, and the check sees it."""
    case = make_case("gptq", N=48, K=128, group_size=32)
    monkeypatch.setattr(cpu_int4, "_torch_scale_and_zero", lambda s, z: tuple(t.float() for t in wrong(s.double(), z.double())))
    assert R.max_relative_error(reconstructed_weight(prepare(case)), case.W) > 0.05


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["gptq", "awq", "ct"])
def test_matches_reference(layout, dtype, M):
    """Default bf16 compute within bf16's tolerance; compute in x's own dtype within that dtype's."""
    case = make_case(layout, N=72, K=192, group_size=64, seed=M)
    handle = prepare(case)
    x = torch.randn(M, 192, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = R.w4a16_matmul_reference(x, case.W)
    y = int4_mm_cpu(x, handle)
    assert y.dtype == dtype and y.shape == (M, 72)
    assert R.max_relative_error(y, ref) < R.TOLERANCE[torch.bfloat16]
    assert R.max_relative_error(int4_mm_cpu(x, handle, compute_dtype=None), ref) < R.TOLERANCE[dtype]


def test_act_order_permutes_x():
    case = make_case("gptq", N=40, K=192, group_size=32, act_order=True, seed=4)
    handle = prepare(case)
    assert handle.perm is not None
    x = torch.randn(2, 5, 192, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = int4_mm_cpu(x, handle)
    assert y.shape == (2, 5, 40)
    assert R.max_relative_error(y, R.w4a16_matmul_reference(x, case.W)) < R.TOLERANCE[torch.bfloat16]


def test_shifted_g_idx_fails():
    case = make_case("gptq", N=48, K=192, group_size=32, act_order=True, seed=5)
    w = case.weight
    wrong = prepare_int4_cpu(w.codes, w.scale, w.zero, 32, g_idx=(w.g_idx + 1) % 6)
    assert R.max_relative_error(reconstructed_weight(wrong), case.W) > 0.1
    rolled = make_case("gptq", N=48, K=128, group_size=32)
    w = rolled.weight
    off_by_one = prepare_int4_cpu(w.codes, w.scale, w.zero, 32, g_idx=w.g_idx.roll(1))
    assert R.max_relative_error(reconstructed_weight(off_by_one), rolled.W) > 10 * R.TOLERANCE[torch.float32]


def test_from_a_gptq_checkpoint():
    """The path QuantLinear will take: packed GPTQ tensors → formats.gptq.unpack → prepare → int4 mm."""
    torch.manual_seed(0)
    tensors = gptq_format.pack(quantize_rtn(torch.randn(192, 576), bits=4, group_size=64, sym=True))
    qweight = gptq_format.unpack(tensors, bits=4, group_size=64)
    handle = prepare_int4_cpu(qweight.codes, qweight.scale, qweight.zero, 64, qweight.g_idx)
    x = torch.randn(4, 576).bfloat16()
    ref = R.w4a16_matmul_reference(x, R.dequantize_gptq(**tensors))
    assert R.max_relative_error(int4_mm_cpu(x, handle), ref) < R.TOLERANCE[torch.bfloat16]


def test_group_sizes_torch_lacks():
    """96 = 3 sub-groups of 32 works; 48 (not a multiple of 32) and unequal act-order groups are refused."""
    case = make_case("awq", N=16, K=192, group_size=96)
    torch.testing.assert_close(reconstructed_weight(prepare(case)), case.W, rtol=1e-6, atol=1e-6)
    w = make_case("gptq", N=16, K=96, group_size=48).weight
    with pytest.raises(ValueError, match="multiple of 32"):
        prepare_int4_cpu(w.codes, w.scale, w.zero, 48)
    w = make_case("gptq", N=16, K=64, group_size=32).weight
    uneven = torch.cat([torch.zeros(40), torch.ones(24)]).int()
    with pytest.raises(ValueError, match="exactly 32 columns"):
        prepare_int4_cpu(w.codes, w.scale, w.zero, 32, g_idx=uneven)


def test_input_errors():
    handle = prepare(make_case("gptq", N=16, K=64, group_size=32))
    with pytest.raises(ValueError, match="K = 64"):
        int4_mm_cpu(torch.randn(2, 32), handle)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        int4_mm_cpu(torch.randn(2, 64).double(), handle)
    with pytest.raises(ValueError, match="0..15"):
        prepare_int4_cpu(torch.full((16, 64), 16, dtype=torch.uint8), torch.ones(16, 2), torch.ones(16, 2), 32)
