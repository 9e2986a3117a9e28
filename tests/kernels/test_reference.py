"""The torch oracle (toolkit.kernels.reference): golden words from docs/formats.md §1.1, agreement with
toolkit.formats.gptq, and the cross-layout identities of docs/formats.md §4."""

import pytest
import torch

from toolkit.formats import gptq as gptq_format
from toolkit.kernels import reference as R
from toolkit.quant.primitives import QuantizedWeight, quantize_rtn

SEQUENTIAL_1_TO_8 = -2023406815  # 0x87654321
AWQ_1_TO_8 = -2042464975  # 0x86427531
V1_SYM_ZEROS = 2004318071  # 0x77777777
V2_SYM_ZEROS = -2004318072  # 0x88888888

ONE_TO_EIGHT = torch.arange(1, 9, dtype=torch.uint8)


# ---- golden words (docs/formats.md §1.1 worked example) ---------------------------------------------------------------


def test_nibbles_golden_words():
    assert R.words_from_nibbles(ONE_TO_EIGHT).item() == SEQUENTIAL_1_TO_8
    assert R.nibbles(torch.tensor(SEQUENTIAL_1_TO_8, dtype=torch.int32)).tolist() == list(range(1, 9))
    # bit 31 set: the mask after the arithmetic shift keeps nibble 7 at 8, not −8
    assert R.nibbles(torch.tensor(V2_SYM_ZEROS, dtype=torch.int32)).tolist() == [8] * 8


def test_gptq_golden_words():
    codes = ONE_TO_EIGHT.view(1, 8).repeat(8, 1)  # (N=8, K=8): codes 1..8 along the input dim
    scale, zero8 = torch.ones(8, 1), torch.full((8, 1), 8)
    g_idx = torch.zeros(8, dtype=torch.int32)
    v1 = R.pack_gptq(codes, scale, zero8, g_idx)
    assert v1["qweight"].tolist() == [[SEQUENTIAL_1_TO_8] * 8]
    assert v1["qzeros"].tolist() == [[V1_SYM_ZEROS]]
    assert R.pack_gptq(codes, scale, zero8, g_idx, zero_offset=0)["qzeros"].tolist() == [[V2_SYM_ZEROS]]
    golden = {"qweight": torch.full((1, 8), SEQUENTIAL_1_TO_8, dtype=torch.int32),
              "qzeros": torch.tensor([[V1_SYM_ZEROS]], dtype=torch.int32),
              "scales": torch.ones(1, 8, dtype=torch.float16), "g_idx": g_idx}
    assert R.dequantize_gptq(**golden).tolist() == [[c - 8.0 for c in range(1, 9)]] * 8


def test_awq_golden_words():
    codes = ONE_TO_EIGHT.view(8, 1).repeat(1, 8)  # (N=8, K=8): codes 1..8 along the output dim
    zero = torch.arange(1, 9).view(8, 1)
    packed = R.pack_awq(codes, torch.ones(8, 1), zero)
    assert packed["qweight"].tolist() == [[AWQ_1_TO_8]] * 8
    assert packed["qzeros"].tolist() == [[AWQ_1_TO_8]]  # zeros interleave the same way, stored as is
    golden = {"qweight": torch.full((8, 1), AWQ_1_TO_8, dtype=torch.int32),
              "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16)}
    assert R.dequantize_awq(**golden, group_size=-1).tolist() == [[float(n)] * 8 for n in range(1, 9)]


def test_ct_golden_words():
    codes = ONE_TO_EIGHT.view(1, 8).repeat(8, 1)  # (N=8, K=8): codes q + 8 = 1..8 along the input dim
    zero = torch.arange(1, 9).view(8, 1)  # zp + 8 = 1..8 down the output dim
    packed = R.pack_ct(codes, torch.ones(8, 1), zero)
    assert packed["weight_packed"].tolist() == [[SEQUENTIAL_1_TO_8]] * 8
    assert packed["weight_zero_point"].tolist() == [[SEQUENTIAL_1_TO_8]]
    golden = {"weight_packed": torch.full((8, 1), SEQUENTIAL_1_TO_8, dtype=torch.int32),
              "weight_scale": torch.ones(8, 1, dtype=torch.float16)}
    assert R.dequantize_ct(**golden, group_size=-1).tolist() == [[c - 8.0 for c in range(1, 9)]] * 8  # symmetric: q
    with_zp = dict(golden, weight_zero_point=torch.tensor([[SEQUENTIAL_1_TO_8]], dtype=torch.int32))
    assert R.dequantize_ct(**with_zp, group_size=-1).tolist() == [[float(c - n) for c in range(1, 9)] for n in range(1, 9)]


def test_a_swapped_nibble_pair_changes_the_weight():
    codes = ONE_TO_EIGHT.view(1, 8).repeat(8, 1)
    tensors = R.pack_gptq(codes, torch.ones(8, 1), torch.full((8, 1), 8), torch.zeros(8, dtype=torch.int32))
    swapped = dict(tensors, qweight=R.words_from_nibbles(torch.tensor([1, 2, 3, 4, 5, 6, 8, 7])).view(1, 1).repeat(1, 8))
    assert not torch.equal(R.dequantize_gptq(**swapped), R.dequantize_gptq(**tensors))


# ---- GPTQ: the oracle agrees with toolkit.formats.gptq -----------------------------------------------------------


def _act_order(qweight: QuantizedWeight, seed: int = 0) -> QuantizedWeight:
    """The same codes with an act-order g_idx (groups of a random column order) and fresh per-group scales/zeros."""
    N, K = qweight.codes.shape
    G = qweight.scale.shape[1]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(K, generator=gen)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = torch.arange(K, dtype=torch.int32) // (K // G)
    scale = (0.01 + 0.1 * torch.rand(N, G, generator=gen)).half().float()
    zero = torch.randint(1, 16, (N, G), generator=gen, dtype=torch.int32)
    return QuantizedWeight(qweight.codes, scale, zero, g_idx, 4, qweight.group_size, False)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("variant", ["sym", "asym", "act_order"])
def test_gptq_oracle_matches_formats_gptq(group_size, variant):
    torch.manual_seed(0)
    qweight = quantize_rtn(torch.randn(40, 128), bits=4, group_size=group_size, sym=variant == "sym")
    if variant == "act_order":
        qweight = _act_order(qweight)
    tensors = gptq_format.pack(qweight)
    ours = R.pack_gptq(qweight.codes, qweight.scale, qweight.zero, qweight.g_idx)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(ours[name], tensors[name]), name
    W = R.dequantize_gptq(**tensors)
    assert torch.equal(W, gptq_format.dequantize(tensors, bits=4))
    if bool((qweight.zero > 0).all()):  # v1 cannot store a zero of 0 (docs/formats.md §2); RTN asym may produce one
        torch.testing.assert_close(W, qweight.dequantize(), rtol=1e-3, atol=1e-6)  # scales went through fp16


def test_gptq_v2_zeros_round_trip():
    torch.manual_seed(0)
    qweight = quantize_rtn(torch.randn(16, 64), bits=4, group_size=32, sym=False)
    tensors = R.pack_gptq(qweight.codes, qweight.scale, qweight.zero, qweight.g_idx, zero_offset=0)
    W = R.dequantize_gptq(**tensors, zero_offset=0)
    torch.testing.assert_close(W, qweight.dequantize(), rtol=1e-3, atol=1e-6)  # zeros of 0 survive in v2


# ---- one set of codes, three layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, -1])
def test_all_layouts_dequantize_to_the_same_weight(group_size):
    torch.manual_seed(0)
    qweight = quantize_rtn(torch.randn(24, 64), bits=4, group_size=group_size, sym=False)
    qweight.zero.clamp_(min=1)  # representable in GPTQ v1
    expected = qweight.dequantize()
    gptq = R.dequantize_gptq(**R.pack_gptq(qweight.codes, qweight.scale, qweight.zero, qweight.g_idx))
    awq = R.dequantize_awq(**R.pack_awq(qweight.codes, qweight.scale, qweight.zero), group_size=group_size)
    ct = R.dequantize_ct(**R.pack_ct(qweight.codes, qweight.scale, qweight.zero), group_size=group_size)
    for W in (gptq, awq, ct):
        torch.testing.assert_close(W, expected, rtol=1e-3, atol=1e-6)


def test_symmetric_ct_is_transposed_gptq_bit_for_bit():
    """docs/formats.md §4: symmetric, no act-order, same codes ⇒ weight_packed == qweight.T, weight_scale == scales.T."""
    torch.manual_seed(0)
    qweight = quantize_rtn(torch.randn(32, 128), bits=4, group_size=64, sym=True)
    gptq = gptq_format.pack(qweight)
    ct = R.pack_ct(qweight.codes, qweight.scale, None)
    assert torch.equal(ct["weight_packed"], gptq["qweight"].t())
    assert torch.equal(ct["weight_scale"], gptq["scales"].t())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_reference_accumulates_in_fp32(dtype):
    torch.manual_seed(0)
    x, W = torch.randn(3, 64).to(dtype), torch.randn(8, 64)
    y = R.w4a16_matmul_reference(x, W)
    assert y.dtype == dtype and y.shape == (3, 8)
    assert R.max_relative_error(y, x.double() @ W.double().t()) <= 2.0**-8  # only the final rounding to dtype
