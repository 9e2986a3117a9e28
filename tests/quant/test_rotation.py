"""The rotation math (``toolkit.quant.rotation``): Hadamard matrices of every width compound meets, and each fold
against the product it stands for."""

import pytest
import torch

from toolkit.quant import rotation

F64 = torch.float64


@pytest.mark.parametrize("order,build", [(8, lambda: rotation.sylvester(8)), (64, lambda: rotation.sylvester(64)),
                                         (12, lambda: rotation.paley(11)), (20, lambda: rotation.paley(19)),
                                         (72, lambda: rotation.paley(71))])
def test_sylvester_and_paley_are_hadamard_matrices(order, build):
    h = build()
    assert h.shape == (order, order) and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, order * torch.eye(order, dtype=F64))


def test_constructions_refuse_orders_they_cannot_build():
    with pytest.raises(ValueError, match="power-of-two order, got 12"):
        rotation.sylvester(12)
    for q in (13, 15):  # 13 ≡ 1 (mod 4); 15 is not prime
        with pytest.raises(ValueError, match=f"prime q ≡ 3 \\(mod 4\\), got {q}"):
            rotation.paley(q)


@pytest.mark.parametrize("n,built", [
    (64, "64 = Sylvester 64"), (576, "576 = Paley 72 ⊗ Sylvester 8"), (640, "640 = Paley 20 ⊗ Sylvester 32"),
    (2560, "2560 = Paley 20 ⊗ Sylvester 128"), (896, "896 = Paley 224 ⊗ Sylvester 4"),
    (18, "18 = random orthogonal 9 ⊗ Sylvester 2"),
])
def test_every_width_gets_an_orthogonal_rotation_flat_where_a_hadamard_matrix_exists(n, built):
    q = rotation.hadamard(n, seed=0)
    assert rotation.describe(n) == built
    assert q.dtype == F64
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=F64), atol=1e-12)
    if "random" in built:  # orthogonal, but not every entry of magnitude 1/√n
        assert not torch.allclose(q.abs(), torch.full_like(q, n ** -0.5))
    else:
        assert torch.allclose(q.abs(), torch.full_like(q, n ** -0.5), atol=1e-15)


def test_the_seed_draws_the_signs():
    assert torch.equal(rotation.hadamard(576, 3), rotation.hadamard(576, 3))
    assert not torch.equal(rotation.hadamard(576, 3), rotation.hadamard(576, 4))
    assert torch.equal(rotation.hadamard(576, 3).abs(), rotation.hadamard(576, 4).abs())


def test_folds_equal_the_products_they_stand_for():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(5, 40, generator=g, dtype=F64), torch.randn(24, 40, generator=g, dtype=F64),
               torch.randn(40, generator=g, dtype=F64))
    scale, q = torch.rand(40, generator=g, dtype=F64) + 0.5, rotation.hadamard(40, 1)
    # a reader of a norm's output, from the rotated stream
    assert torch.allclose((x @ q) @ rotation.fold_reader(w, scale, q).T, (x * scale) @ w.T)
    # a writer into the rotated stream: (z Wᵀ + b) Q
    z, w_out = torch.randn(5, 24, generator=g, dtype=F64), torch.randn(40, 24, generator=g, dtype=F64)
    assert torch.allclose(z @ rotation.fold_writer(w_out, q).T + rotation.fold_writer(b, q), (z @ w_out.T + b) @ q)


def test_head_folds_rotate_each_head_and_undo_it():
    g = torch.Generator().manual_seed(1)
    heads, d = 3, 16
    x, w_v, b_v = (torch.randn(4, 32, generator=g, dtype=F64), torch.randn(heads * d, 32, generator=g, dtype=F64),
                   torch.randn(heads * d, generator=g, dtype=F64))
    w_o, r = torch.randn(32, heads * d, generator=g, dtype=F64), rotation.hadamard(d, 2)
    values = (x @ w_v.T + b_v).reshape(4, heads, d)
    rotated = (x @ rotation.fold_heads_out(w_v, r).T + rotation.fold_heads_out(b_v, r)).reshape(4, heads, d)
    assert torch.allclose(rotated, values @ r)  # each head's values rotated by the same R
    assert torch.allclose(rotated.reshape(4, -1) @ rotation.fold_heads_in(w_o, r).T, values.reshape(4, -1) @ w_o.T)
