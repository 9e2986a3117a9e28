import pytest
import torch

from toolkit.decode.kv_cache import KVCache, dequantize_int8, quantize_int8


def test_int8_per_token_per_head_round_trip():
    x = torch.randn(1, 3, 20, 16, generator=torch.Generator().manual_seed(0))
    x[0, 1, 5] *= 50  # an outlier token spoils only its own scale
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (1, 3, 20, 1)
    error = dequantize_int8(q, scale, torch.float32) - x
    assert (error.abs() <= scale / 2 + 1e-7).all()
    sqnr = 10 * torch.log10(x.pow(2).sum() / error.pow(2).sum())
    assert sqnr > 35


def test_given_scale_is_used_and_clipped():
    q, scale = quantize_int8(torch.tensor([[0.5, -3.0, 100.0]]), 0.1)
    assert q.tolist() == [[5, -30, 127]] and scale.tolist() == [[pytest.approx(0.1)]]


def test_kv_scales_shape_and_dtype_are_checked():
    with pytest.raises(ValueError, match=r"\[layers, 2\] = \[2, 2\]"):
        KVCache(2, 1, 8, 4, torch.float32, torch.int8, kv_scales=torch.ones(2))
    with pytest.raises(ValueError, match="only apply to an INT8 cache"):
        KVCache(2, 1, 8, 4, torch.float32, None, kv_scales=torch.ones(2, 2))


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_keep_moves_the_accepted_slots_next_to_the_prefix(kv_dtype):
    cache = KVCache(1, 1, 10, 2, torch.float32, kv_dtype)
    values = torch.arange(1.0, 11.0)[None, None, :, None].expand(1, 1, 10, 2)  # slot i holds i + 1
    cache.write(0, 0, values, -values)
    cache.keep(3, [0, 2, 3, 6])
    k, v = cache.read(0, 7)
    assert k[0, 0, :, 0].tolist() == pytest.approx([1, 2, 3, 4, 6, 7, 10], rel=1e-2)
    assert v[0, 0, :, 0].tolist() == pytest.approx([-1, -2, -3, -4, -6, -7, -10], rel=1e-2)
