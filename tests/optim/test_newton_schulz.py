import pytest
import torch

from k3train.optim.newton_schulz import NS_COEFFS, muon_update_scale, newton_schulz, newton_schulz_reference


def ns_input(shape) -> torch.Tensor:
    """A random Gaussian input; square ones get singular values in [1, 4] instead (a square Gaussian
    has singular values near 0 that 5 steps cannot lift)."""
    torch.manual_seed(torch.seed() % 2**31)
    G = torch.randn(shape)
    if shape[-1] == shape[-2]:
        U, _, Vh = torch.linalg.svd(G)
        G = U @ torch.diag_embed(torch.rand(G.shape[:-1]) * 3 + 1) @ Vh
    return G


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (48, 48), (5, 40, 96), (7, 96, 40)])
def test_singular_values_in_band(shape):
    G = ns_input(shape)
    X = newton_schulz(G)
    assert X.shape == G.shape and X.dtype == torch.float32
    s = torch.linalg.svdvals(X)
    # the quintic with (3.4445, -4.775, 2.0315) oscillates in about [0.68, 1.14]
    assert s.min() > 0.6 and s.max() < 1.25, (s.min(), s.max())


def test_matches_float64_reference_and_scale():
    G = torch.randn(3, 24, 80)
    X = newton_schulz(G, scale=2.5)
    for i in range(3):
        ref = newton_schulz_reference(G[i]) * 2.5
        assert ((X[i].double() - ref).norm() / ref.norm()) < 1e-5


def test_batched_equals_one_at_a_time():
    G = torch.randn(9, 16, 40) * torch.rand(9, 1, 1) * 10
    X = newton_schulz(G)
    for i in range(9):
        torch.testing.assert_close(X[i], newton_schulz(G[i]), rtol=1e-5, atol=1e-6)


def test_noncontiguous_and_zero_inputs():
    G = torch.randn(4, 40, 16).mT  # wide view of a tall tensor
    torch.testing.assert_close(newton_schulz(G), newton_schulz(G.contiguous()))
    Z = newton_schulz(torch.zeros(2, 8, 8))
    assert torch.equal(Z, torch.zeros(2, 8, 8))


def test_bf16_compute_dtype_close():
    G = torch.randn(4, 32, 64)
    X = newton_schulz(G, dtype=torch.bfloat16)
    assert X.dtype == torch.bfloat16
    ref = newton_schulz(G)
    # Only the final iterate is compared; bf16 GEMMs carry ~1e-2 relative error.
    assert ((X.float() - ref).norm() / ref.norm()) < 3e-2


def test_constants():
    assert NS_COEFFS == (3.4445, -4.7750, 2.0315)
    assert muon_update_scale(128, 1024) == pytest.approx(0.2 * 32)
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(2, 2, 2, 2))


@pytest.mark.parametrize("shape", [(4, 24, 80), (3, 80, 24), (2, 48, 48)])
def test_folded_normalization_is_scale_free(shape):
    # The Frobenius normalization runs through tr(G G^T) inside the first step: inputs from 1e-3 to
    # 1e4 give the float64 reference's result (fp32), and the update scale is applied once.
    G = ns_input(shape)
    ref = torch.stack([newton_schulz_reference(g) for g in G])
    for c in (1e-3, 1.0, 1e4):  # fp32 rounding: worst 1.06e-5 over 150 seeds (square), 5.4e-6 otherwise
        X = newton_schulz(G * c, scale=0.5)
        assert ((X.double() - 0.5 * ref).norm() / (0.5 * ref).norm()) < 3e-5, c
    X1 = newton_schulz(G[:1], steps=1, scale=2.0)  # one step: normalization and scale in the same step
    assert ((X1.double() - 2.0 * newton_schulz_reference(G[0], steps=1)).norm() / X1.norm()) < 1e-5


@pytest.mark.parametrize("shape", [(6, 32, 96), (4, 96, 32)])
def test_bf16_stack_input_close_to_reference(shape):
    # Muon hands NS its stack already in bf16 and unnormalized: same error as bf16 GEMMs anywhere.
    G = torch.randn(shape) * 1e-3
    X = newton_schulz(G.to(torch.bfloat16), dtype=torch.bfloat16)
    ref = torch.stack([newton_schulz_reference(g) for g in G.to(torch.bfloat16)])
    assert X.dtype == torch.bfloat16 and X.shape == G.shape
    assert ((X.double() - ref).norm() / ref.norm()) < 2e-2
    with pytest.raises(ValueError, match="fp16"):
        newton_schulz(G, dtype=torch.float16)
