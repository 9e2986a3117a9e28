"""GGUF block bytes: compound's packing, its torch reader, and llama.cpp's own Python reader (gguf-py)."""

import dataclasses

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from toolkit.formats.gguf_blocks import BLOCK_BYTES, dequantize, pack
from toolkit.formats.scheme import FormatError
from toolkit.quant.primitives import quantize_rtn

CASES = [(4, True, "Q4_0"), (4, False, "Q4_1"), (8, True, "Q8_0")]


def _qweight(bits, sym, group_size=32, seed=0):
    """RTN on a random [8, 128] weight, scales rounded to fp16 as the GGUF target does (codes unchanged)."""
    W = torch.randn(8, 128, generator=torch.Generator().manual_seed(seed)) * 0.05
    qweight = quantize_rtn(W, bits, group_size, sym)
    return dataclasses.replace(qweight, scale=qweight.scale.half().float())


def _fp16_ulp(x):
    """Spacing of fp16 numbers at |x| (subnormal spacing 2^-24 below the normal range)."""
    _, exponent = torch.frexp(x.abs())
    return torch.clamp(torch.ldexp(torch.ones_like(x), exponent - 11), min=2.0**-24)


@pytest.mark.parametrize("bits,sym,name", CASES)
def test_round_trip_matches_compound_dequantize(bits, sym, name):
    qweight = _qweight(bits, sym)
    type_name, data = pack(qweight)
    assert type_name == name
    assert data.dtype == torch.uint8 and data.shape == (8, 128 // 32 * BLOCK_BYTES[name])
    got, want = dequantize(type_name, data, (8, 128)), qweight.dequantize()
    if name == "Q4_1":
        m = -(qweight.scale * qweight.zero.float())  # (N, G)
        bound = (0.5 * _fp16_ulp(m)).repeat_interleave(32, dim=1)  # (N, K)
        assert bool(((got - want).abs() <= bound).all())
        assert not torch.equal(got, want)  # the bound is exercised, not vacuous
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("bits,sym,name", CASES)
def test_llama_cpp_reader_agrees_exactly(bits, sym, name):
    type_name, data = pack(_qweight(bits, sym, seed=1))
    theirs = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[type_name])
    assert theirs.shape == (8, 128)
    np.testing.assert_array_equal(theirs.astype(np.float32), dequantize(type_name, data, (8, 128)).numpy())


@pytest.mark.parametrize("bits,sym,name", [(4, True, "Q4_0"), (4, False, "Q4_1")])
def test_one_flipped_nibble_changes_one_weight(bits, sym, name):
    type_name, data = pack(_qweight(bits, sym, seed=2))
    before = dequantize(type_name, data, (8, 128))
    altered = data.clone()
    qs_start = BLOCK_BYTES[name] - 16
    altered[3, BLOCK_BYTES[name] + qs_start + 5] ^= 0x10  # row 3, block 1, high nibble of byte 5: column 32+5+16
    changed = (dequantize(type_name, altered, (8, 128)) != before).nonzero().tolist()
    assert changed == [[3, 32 + 5 + 16]]


def _permuted(qweight):
    g_idx = qweight.g_idx[torch.randperm(qweight.g_idx.numel(), generator=torch.Generator().manual_seed(0))]
    return dataclasses.replace(qweight, g_idx=g_idx)


@pytest.mark.parametrize("make,reason", [
    (lambda: _qweight(4, True, group_size=64), "group_size 64"),
    (lambda: _permuted(_qweight(4, True)), "dynamic act-order permutes them"),
    (lambda: _qweight(3, True), "not 3-bit"),
    (lambda: _qweight(8, False), "no asymmetric 8-bit"),
    (lambda: quantize_rtn(torch.randn(8, 128), 4, 32, True), "not fp16 values"),
])
def test_refusals_name_the_reason(make, reason):
    with pytest.raises(FormatError, match=reason):
        pack(make())
