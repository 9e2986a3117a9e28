import pytest
import torch

from toolkit.decode import SamplingConfig
from toolkit.decode.sampling import probs


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="pass sampling=None"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingConfig(top_p=0)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert probs(logits, SamplingConfig(top_p=0.7)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert probs(logits, SamplingConfig(top_p=0.85)).tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert probs(logits, SamplingConfig(top_p=0.1)).tolist() == pytest.approx([1, 0, 0, 0])
    assert probs(logits, SamplingConfig(temperature=2.0)).tolist() == pytest.approx(
        torch.softmax(logits / 2, -1).tolist())
