import itertools

import pytest
import torch

from toolkit.formats.packing import pack, unpack


def test_golden_words_from_the_format_reference():
    # docs/formats.md §1.1: codes 1..8 along the packed dimension → 0x87654321
    codes = torch.arange(1, 9).view(8, 1)
    assert pack(codes, 4, dim=0).item() == -2023406815
    assert pack(torch.full((1, 8), 7), 4, dim=1).item() == 0x77777777


def test_three_bit_layout_straddles_words_like_autogptq():
    # 32 codes of 3 bits fill exactly 3 words; code 10 spans word 0 (2 low bits) and word 1 (1 high bit)
    codes = torch.zeros(32, 1, dtype=torch.int64)
    codes[10] = 0b111
    words = pack(codes, 3, dim=0).view(-1).tolist()
    assert words[0] & 0xFFFFFFFF == 0b11 << 30
    assert words[1] == 0b1
    assert words[2] == 0


@pytest.mark.parametrize("bits,dim", list(itertools.product(range(2, 9), (0, 1))))
def test_round_trip_every_width(bits, dim):
    torch.manual_seed(bits)
    shape = (96, 5) if dim == 0 else (5, 96)
    codes = torch.randint(0, 2**bits, shape)
    words = pack(codes, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == 96 * bits // 32
    assert torch.equal(unpack(words, bits, dim).long(), codes)


def test_length_must_fill_words():
    with pytest.raises(ValueError, match="whole 32-bit words"):
        pack(torch.zeros(12, 1, dtype=torch.int64), 3, dim=0)
