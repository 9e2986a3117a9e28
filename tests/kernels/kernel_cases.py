"""Test weights for the W4A16 kernels: random codes, scales and zeros packed into each layout by the oracle.

A plain module, not a conftest.py: other test folders ``from conftest import ...`` the top-level one, which a
second conftest on sys.path would shadow.
"""

from types import SimpleNamespace

import torch

from toolkit.kernels import reference as R

LAYOUTS = ("gptq", "awq", "ct")


def random_weight(N: int, K: int, group_size: int, act_order: bool = False, seed: int = 0) -> SimpleNamespace:
    """codes uint8 [N, K], scale [N, G] (fp16-exact, spread 10× so a wrong group shows), zero int32 [N, G] in 1..15
    (GPTQ v1 cannot store a zero of 0), g_idx int32 [K]: k // g, or GPTQ act-order groups of a random column order."""
    gen = torch.Generator().manual_seed(seed)
    G = 1 if group_size == -1 else K // group_size
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scale = (0.01 + 0.1 * torch.rand(N, G, generator=gen)).half().float()
    zero = torch.randint(1, 16, (N, G), generator=gen, dtype=torch.int32)
    size = K if group_size == -1 else group_size
    g_idx = torch.arange(K, dtype=torch.int32) // size
    if act_order:
        perm = torch.randperm(K, generator=gen)
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[perm] = torch.arange(K, dtype=torch.int32) // size  # GPTQ desc_act: g_idx[perm[i]] = i // g
    return SimpleNamespace(codes=codes, scale=scale, zero=zero, g_idx=g_idx, group_size=group_size)


def packed_case(layout: str, w: SimpleNamespace, sym: bool = False) -> SimpleNamespace:
    """The packed tensors of ``w`` in ``layout`` and the oracle's W [N, K]. CT keeps g_idx only under act-order."""
    zero = torch.full_like(w.zero, 8) if sym else w.zero
    trivial = torch.equal(w.g_idx, R._group_index(w.codes.shape[1], w.group_size).to(torch.int32))
    if layout == "gptq":
        tensors = R.pack_gptq(w.codes, w.scale, zero, w.g_idx)
        W = R.dequantize_gptq(**tensors)
    elif layout == "awq":
        assert trivial, "AWQ has no act-order"
        tensors = R.pack_awq(w.codes, w.scale, zero)
        W = R.dequantize_awq(**tensors, group_size=w.group_size)
    else:
        tensors = R.pack_ct(w.codes, w.scale, None if sym else zero)
        if not trivial:
            tensors["g_idx"] = w.g_idx
        W = R.dequantize_ct(**tensors, group_size=w.group_size)
    return SimpleNamespace(layout=layout, tensors=tensors, W=W, group_size=w.group_size, weight=w, zero=zero)


def make_case(layout: str, N: int, K: int, group_size: int, act_order: bool = False, seed: int = 0,
              sym: bool = False) -> SimpleNamespace:
    """Random weight of the given shape packed in ``layout`` (see ``random_weight`` and ``packed_case``)."""
    return packed_case(layout, random_weight(N, K, group_size, act_order, seed), sym)
