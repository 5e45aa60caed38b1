"""Precision recipes on CUDA (run with ``pytest -m gpu``):

- fp8_block: ``torch._scaled_mm`` with 1×128 / 128×128 block scales equals the plain-torch
  dequantize-then-matmul reference, for aligned and padded shapes, and through the linear's
  forward and both gradient GEMMs; k3_tiny with precision.recipe=fp8_block trains like bf16;
- mxfp8: the emulation's CUDA path (Triton quantizer, bf16 GEMM) equals the float64 MXFP8 GEMM.
"""

from __future__ import annotations

import pytest
import torch

from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from k3train.precision.recipes import fp8_block_gemm, recipe_linear
from kernels.fp8_block import fp8_block_matmul, fp8_block_matmul_reference, fp8_block_unavailable
from kernels.mx.gemm import mxfp8_matmul, mxfp8_matmul_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _needs_fp8_block():
    reason = fp8_block_unavailable()
    if reason:
        pytest.fail(f"fp8_block unavailable on this GPU: {reason}")


# (M, K, N): aligned; K/128 = 3 (padded to 4 blocks) with M, N off the 16/128 grid; a bench-1B-like shape.
@pytest.mark.parametrize("shape", [(256, 512, 384), (200, 384, 136), (4096, 2048, 5632)])
@pytest.mark.parametrize("b_tiles", [True, False])
def test_scaled_mm_equals_dequantize_then_matmul(shape, b_tiles):
    _needs_fp8_block()
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g) * torch.randn(m, 1, device="cuda", generator=g).exp()
    b = torch.randn(n, k, device="cuda", generator=g) * torch.randn(1, k, device="cuda", generator=g).exp()
    got = fp8_block_matmul(a, b, b_tiles)
    want = fp8_block_matmul_reference(a, b, b_tiles)
    assert got.dtype == torch.bfloat16
    err = _rel(got, want)
    assert err < 4e-3, err  # bf16 output rounding; a wrong scale layout gives O(1)
    assert err < 0.25 * _rel(want, a @ b.t())  # closer to the FP8 reference than to the exact product


def test_fp8_block_linear_forward_and_gradients_match_reference():
    _needs_fp8_block()
    torch.manual_seed(1)
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    w = (torch.randn(768, 1024, device="cuda") * 0.02).requires_grad_()
    dy = torch.randn(4, 512, 768, device="cuda")
    grads = []
    for gemm in (fp8_block_gemm, lambda a, b, weight: fp8_block_matmul_reference(a, b, b_tiles=weight)):
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = recipe_linear(x, w, gemm)
        y.backward(dy.to(y.dtype))
        grads.append((y.detach(), x.grad.clone(), w.grad.clone()))
    for got, want, what in zip(grads[0], grads[1], ("y", "dx", "dW")):
        assert _rel(got, want) < 5e-3, (what, _rel(got, want))


def test_mxfp8_emulation_on_cuda_equals_float64_reference():
    torch.manual_seed(2)
    a = torch.randn(512, 1024, device="cuda") * torch.randn(512, 1, device="cuda").exp()
    b = torch.randn(384, 1024, device="cuda")
    want = mxfp8_matmul_reference(a.cpu(), b.cpu()).cuda()
    got = mxfp8_matmul(a, b, torch.bfloat16).double()
    bound = 2 * 1024 * 2.0 ** -24 * mxfp8_matmul_reference(a.abs().cpu(), b.abs().cpu()).cuda() + 2.0 ** -8 * want.abs()
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_k3_tiny_trains_with_recipe_like_bf16(recipe):
    if recipe == "fp8_block":
        _needs_fp8_block()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (4, 257), generator=g).cuda()
    losses = {}
    for r in ("bf16", recipe):
        torch.manual_seed(0)
        model = K3Model(ModelConfig(), linear_backend="torch", precision_recipe=r).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(10):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[r] = float(loss)
    assert abs(losses[recipe] - losses["bf16"]) < 0.01 * losses["bf16"], losses
