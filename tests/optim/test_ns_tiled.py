"""The tiled Triton Newton–Schulz (blocks of more than 128 rows) equals the torch iteration: fp32 compute
against ``newton_schulz`` in fp32, bf16 compute (GPU only) within bf16 rounding of it, and the optimizer
with ``muon_ns_backend="tiled"`` equals the torch backend. CPU: Triton interpreter, small tiles."""

from __future__ import annotations

import pytest
import torch
from triton_cpu import triton_cpu

from kernels.newton_schulz import newton_schulz, newton_schulz_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Shapes cover several tiles per side on CPU (32-wide interpreter tiles) and on GPU (128-wide), ragged edges,
# tall blocks (read through a transposed view) and a 2-D input.
CASES = [((3, 40, 70), 1.0, 5), ((2, 70, 40), 1.7, 5), ((2, 33, 33), 1.0, 1), ((50, 90), 2.0, 2),
         ((1, 100, 75), 1.3, 3)]
if DEV == "cuda":  # several 128-wide tiles per side (the interpreter takes minutes on these)
    CASES += [((2, 200, 300), 1.0, 5), ((1, 260, 130), 1.3, 3)]


@triton_cpu
@pytest.mark.parametrize("shape,scale,steps", CASES)
def test_fp32_equals_torch(shape, scale, steps):
    from kernels.newton_schulz.triton_tiled_ns import newton_schulz_tiled, tiled_supports

    G = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEV)
    assert tiled_supports(G)
    got = newton_schulz_tiled(G, steps=steps, scale=scale, dtype=torch.float32)
    want = newton_schulz(G, steps=steps, scale=scale, dtype=torch.float32)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = float((got - want).norm() / want.norm())
    assert err < 2e-5, err
    mats = G.double().cpu().reshape(-1, *G.shape[-2:])
    ref = scale * torch.stack([newton_schulz_reference(m, steps=steps) for m in mats]).reshape(G.shape)
    assert float((got.double().cpu() - ref).norm() / ref.norm()) < 1e-4  # both near float64


@triton_cpu
def test_zero_block_stays_zero():
    from kernels.newton_schulz.triton_tiled_ns import newton_schulz_tiled

    G = torch.randn(3, 40, 70, device=DEV)
    G[1] = 0
    got = newton_schulz_tiled(G, dtype=torch.float32)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and got[0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core dots: GPU only")
@pytest.mark.parametrize("shape", [(64, 256, 512), (16, 512, 256), (8, 384, 1024)])
def test_bf16_close_to_torch_bf16(shape):
    from kernels.newton_schulz.triton_tiled_ns import newton_schulz_tiled

    G = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    got = newton_schulz_tiled(G, scale=1.5)
    want = newton_schulz(G, scale=1.5)
    exact = newton_schulz(G.float(), scale=1.5, dtype=torch.float32)
    # bf16 compute: both paths round differently; each stays within bf16 noise of the fp32 iteration
    err_got = float((got.float() - exact).norm() / exact.norm())
    err_want = float((want.float() - exact).norm() / exact.norm())
    assert got.dtype == torch.bfloat16 and err_got < max(2 * err_want, 1e-2), (err_got, err_want)


@triton_cpu
def test_optimizer_tiled_backend_equals_torch():
    from standins import StandInModel

    from k3train.optim.muon import build_muon, ns_backend

    G = torch.randn(2, 140, 150, device=DEV)  # > 128 rows: the tiled kernel
    torch.testing.assert_close(ns_backend("tiled")(G, dtype=torch.float32), newton_schulz(G, dtype=torch.float32),
                               rtol=1e-4, atol=1e-5)
    a, b = StandInModel(seed=1), StandInModel(seed=1)
    oa = build_muon(a.named_parameters(), {"lr": 0.02, "muon_ns_backend": "torch"})
    ob = build_muon(b.named_parameters(), {"lr": 0.02, "muon_ns_backend": "tiled"})
    a.set_grads(1)
    b.set_grads(1)
    oa.step()
    ob.step()
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
