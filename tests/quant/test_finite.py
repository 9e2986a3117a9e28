import itertools

import pytest
import torch

from toolkit.quant.finite import all_finite


@pytest.mark.parametrize("dtype, bad", list(itertools.product(
    [torch.float32, torch.bfloat16, torch.float16], [None, "nan", "inf", "-inf", "inf and -inf"])))
def test_all_finite_agrees_with_isfinite(dtype, bad):
    torch.manual_seed(0)
    t = torch.randn(4, 64, 96).to(dtype)
    if bad == "inf and -inf":
        t[1, 2, 3], t[3, 60, 0] = float("inf"), float("-inf")
    elif bad is not None:
        t[2, 10, 50] = float(bad)
    assert all_finite(t) == bool(torch.isfinite(t).all()) == (bad is None)


def test_half_precision_sums_in_float32():
    # 4,096 values of 60,000 sum far past float16's range; the values themselves are finite
    assert all_finite(torch.full((4096,), 60000.0, dtype=torch.float16))


def test_only_false_alarm_is_a_float32_overflowing_sum():
    assert not all_finite(torch.tensor([3e38, 3e38]))
