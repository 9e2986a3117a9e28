"""Orthogonal rotations folded into weights (QuaRot, arXiv 2404.00456): the math alone, tensors in and out.

A linear ``y = x Wᵀ`` whose input arrives rotated, ``x Q``, computes the same ``y`` with ``W Q``; one whose output
must leave rotated computes ``y Q`` with ``Qᵀ W`` (and ``Qᵀ b`` for its bias). An RMSNorm's ``x / rms(x)`` commutes
with any orthogonal ``Q`` (``rms(x Q) = rms(x)``), its elementwise weight does not: the weight is folded into the
linears that read the norm (``W diag(w)``) before they are rotated. The rotation spreads every input channel over
all of them, so the outlier channels that set a quantization group's range are averaged away.

The rotation is a randomized Hadamard matrix, ``diag(s) · H / √n`` with seeded signs ``s``: every entry has the same
magnitude ``1/√n``, the flattest spread an orthogonal matrix can give (a random orthogonal matrix has entries of
typical size ``1/√n`` but a tail of larger ones). Widths that are not a power of two (576, 640, 2560) are
``n = 2^k · m`` with ``m`` odd; ``H`` is then a Kronecker product of a Paley Hadamard matrix of order ``p = q + 1``
(``q`` a prime ≡ 3 mod 4, ``p = 2^j · m`` dividing ``n``) and a Sylvester one of order ``n / p``, still a true
Hadamard matrix: 576 = 72 ⊗ 8 (q = 71), 640 = 20 ⊗ 32 (q = 19), 2560 = 20 ⊗ 128, 896 = 224 ⊗ 4. Where no such
prime exists below ``n``, the odd factor is a seeded random orthogonal matrix (QR of a Gaussian) in place of the
Paley block: orthogonal all the same, with a less flat spread. Everything is computed in float64; callers fold in
float64 and cast once.
"""

from __future__ import annotations

import torch

DTYPE = torch.float64


def sylvester(n: int) -> torch.Tensor:
    """The ±1 Sylvester Hadamard matrix of order ``n`` (a power of two), float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=DTYPE)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def paley(q: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order ``q + 1`` by Paley's first construction, for a prime ``q`` ≡ 3 (mod 4):
    ``I + [[0, 1ᵀ], [-1, J]]`` with ``J[i, j]`` the Legendre symbol of ``j - i`` mod ``q``."""
    if not _is_prime(q) or q % 4 != 3:
        raise ValueError(f"Paley's first construction needs a prime q ≡ 3 (mod 4), got {q}")
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=DTYPE)
    index = torch.arange(q)
    jacobsthal = chi[(index[None, :] - index[:, None]) % q]
    skew = torch.zeros(q + 1, q + 1, dtype=DTYPE)
    skew[0, 1:], skew[1:, 0], skew[1:, 1:] = 1.0, -1.0, jacobsthal
    return torch.eye(q + 1, dtype=DTYPE) + skew


def paley_order(n: int) -> int | None:
    """The smallest Paley order ``p = 2^j · m`` (``m`` the odd part of ``n``, ``p - 1`` a prime, ``p`` dividing
    ``n``) for ``n`` not a power of two; None when there is none."""
    odd = n
    while odd % 2 == 0:
        odd //= 2
    p = 4 * odd
    while p <= n and n % p == 0:
        if _is_prime(p - 1):
            return p
        p *= 2
    return None


def random_orthogonal(m: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal matrix of order ``m`` (QR of a Gaussian, signs fixed by R's diagonal), float64."""
    q, r = torch.linalg.qr(torch.randn(m, m, dtype=DTYPE, generator=generator))
    return (q * torch.sign(torch.diagonal(r))[None, :]).contiguous()


def describe(n: int) -> str:
    """How ``hadamard(n, ...)`` is built, in a few words: "576 = Paley 72 ⊗ Sylvester 8"."""
    if n & (n - 1) == 0:
        return f"{n} = Sylvester {n}"
    p = paley_order(n)
    if p is not None:
        return f"{n} = Paley {p} ⊗ Sylvester {n // p}"
    odd = n // (n & -n)
    return f"{n} = random orthogonal {odd} ⊗ Sylvester {n // odd}"


def hadamard(n: int, seed: int) -> torch.Tensor:
    """The rotation of order ``n``: ``diag(s) · H / √n``, ``H`` as the module says, ``s`` seeded random signs;
    orthogonal, float64."""
    generator = torch.Generator().manual_seed(seed)
    if n & (n - 1) == 0:
        h = sylvester(n)
    elif (p := paley_order(n)) is not None:
        h = torch.kron(paley(p - 1), sylvester(n // p))
    else:
        odd = n // (n & -n)
        h = torch.kron(random_orthogonal(odd, generator) * odd ** 0.5, sylvester(n // odd))
    signs = torch.randint(0, 2, (n,), generator=generator).to(DTYPE) * 2 - 1
    return signs[:, None] * h / n ** 0.5


def fold_reader(weight: torch.Tensor, norm_scale: torch.Tensor | None, rotation: torch.Tensor) -> torch.Tensor:
    """``W diag(norm_scale) Q`` in float64: a linear reading a norm's output (scaled by ``norm_scale``, None for
    none) from a stream now rotated by ``Q``."""
    w = weight.to(DTYPE)
    if norm_scale is not None:
        w = w * norm_scale.to(DTYPE)[None, :]
    return w @ rotation


def fold_writer(weight: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``Qᵀ W`` in float64: a linear (or a bias, as a vector) whose output is added to a stream rotated by ``Q``."""
    w = weight.to(DTYPE)
    return rotation.T @ w if w.dim() > 1 else w @ rotation


def fold_heads_out(weight: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rows ``[heads · d, ...]`` (or a bias ``[heads · d]``) of a projection whose every head's output is rotated
    by the ``d × d`` ``rotation``: each head's block becomes ``Rᵀ W_h``."""
    d = rotation.shape[0]
    w = weight.to(DTYPE)
    blocks = w.reshape(-1, d, *w.shape[1:])
    return torch.einsum("ij,hi...->hj...", rotation, blocks).reshape(w.shape)


def fold_heads_in(weight: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Columns ``[..., heads · d]`` of a projection reading every head's output rotated by ``rotation``: each
    head's column block becomes ``W_h R``."""
    d = rotation.shape[0]
    w = weight.to(DTYPE)
    return (w.reshape(w.shape[0], -1, d) @ rotation).reshape(w.shape)
