"""Precision recipes (k3train/precision/recipes.py) against float64 and plain-torch references.

- MXFP8: the emulated GEMM equals the float64 MXFP8 GEMM up to fp32 accumulation order, in the
  forward and in both gradient GEMMs (operands quantized along the dims TE's MXFP8 recipe uses);
- FP8 block: the 1×128 / 128×128 quantizers (the GEMM itself is tests/gpu/test_fp8_block_gpu.py);
- TPSpec builds recipe linears everywhere but the LM head, and refuses fp8_block without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from k3train.parallel.tensor_parallel import TPSpec
from k3train.precision.recipes import RecipeLinear, mxfp8_gemm, recipe_linear
from kernels.fp8_block import (E4M3_MAX, dequantize_1x128, dequantize_128x128, fp8_block_unavailable,
                               quantize_1x128, quantize_128x128)
from kernels.mx.gemm import mxfp8_matmul, mxfp8_matmul_reference

EPS32 = 2.0 ** -24


def _spread(*shape: int, seed: int) -> torch.Tensor:
    """Random values whose magnitude varies by ~e^±2 between rows and between elements."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.randn(*shape, generator=g).exp() \
        * torch.randn(*shape[:-1], 1, generator=g).mul(2).exp()


def _assert_fp32_sum_of(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """got equals the float64 MXFP8 GEMM a·bᵀ within the fp32 summation bound K·eps·(|Q(a)|·|Q(b)|ᵀ)."""
    want = mxfp8_matmul_reference(a, b)
    bound = 2 * a.shape[-1] * EPS32 * mxfp8_matmul_reference(a.abs(), b.abs())
    err = (got.double() - want).abs()
    assert bool((err <= bound + 1e-30).all()), f"max err/bound {float((err / (bound + 1e-30)).max()):.2f}"
    # The quantization is real: the unquantized product is far outside that bound.
    assert float(((a.double() @ b.double().t()) - want).abs().max()) > 100 * float(bound.max())


@pytest.mark.parametrize("k", [96, 80])  # 80: the last block is zero-padded
def test_mxfp8_matmul_equals_float64_reference(k):
    a, b = _spread(64, k, seed=1), _spread(48, k, seed=2)
    _assert_fp32_sum_of(mxfp8_matmul(a, b), a, b)


def test_mxfp8_linear_forward_and_gradients_are_te_style_mxfp8_gemms():
    """y = Q(x)Q(W)ᵀ; dx = Q(dy)·Q_N(W) (W quantized along N); dW = Q_M(dy)ᵀ·Q_M(x) (along tokens)."""
    x = _spread(3, 40, 64, seed=3).requires_grad_()  # M = 120 tokens: not a multiple of 32
    w = _spread(48, 64, seed=4).requires_grad_()
    dy = _spread(3, 40, 48, seed=5)
    y = recipe_linear(x, w, mxfp8_gemm)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 64), dy.reshape(-1, 48)
    _assert_fp32_sum_of(y.detach().reshape(-1, 48), x2, w.detach())
    _assert_fp32_sum_of(x.grad.reshape(-1, 64), dy2, w.detach().t())
    _assert_fp32_sum_of(w.grad, dy2.t(), x2.t())


def test_mxfp8_linear_under_bf16_autocast_returns_autocast_dtype_and_input_dtype_grads():
    x = _spread(32, 64, seed=6).requires_grad_()
    w = _spread(16, 64, seed=7).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = recipe_linear(x, w, mxfp8_gemm)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), mxfp8_matmul(x.detach(), w.detach()), rtol=2 ** -8, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32


def _check_blocks(x: torch.Tensor, q: torch.Tensor, s_full: torch.Tensor, amax_full: torch.Tensor) -> None:
    """Per element: its block's scale is amax/448, and the decoded value is within E4M3 rounding."""
    torch.testing.assert_close(s_full, amax_full / E4M3_MAX, rtol=0, atol=0)
    dq = q.float() * s_full
    # E4M3: 3 mantissa bits (half-ulp 2^-4 relative); subnormal spacing 2^-9 (half: 2^-10) times the scale.
    assert bool(((dq - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * s_full).all())
    assert bool((dq.abs() <= amax_full * (1 + 1e-6)).all())


def test_fp8_1x128_quantizer():
    x = _spread(40, 300, seed=8)  # 300 = 2 full blocks + a 44-wide tail
    x[5, 128:256] = 0.0  # an all-zero block
    q, s = quantize_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (40, 3)
    amax = torch.stack([x[:, j:j + 128].abs().amax(1) for j in (0, 128, 256)], 1)
    assert float(s[5, 1]) == 1.0 and not q[5, 128:256].float().any()
    amax[5, 1] = E4M3_MAX  # the zero block's scale is 1
    _check_blocks(x, q, s.repeat_interleave(128, 1)[:, :300], amax.repeat_interleave(128, 1)[:, :300])
    nonzero = [(i, j) for i in range(40) for j in range(3) if (i, j) != (5, 1)]
    assert all(float(q[i, 128 * j:128 * (j + 1)].float().abs().max()) == E4M3_MAX for i, j in nonzero)
    torch.testing.assert_close(dequantize_1x128(q, s), q.float() * s.repeat_interleave(128, 1)[:, :300])


def test_fp8_128x128_quantizer():
    w = _spread(200, 300, seed=9)
    q, s = quantize_128x128(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (2, 3)
    amax = torch.tensor([[float(w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].abs().max()) for j in range(3)]
                         for i in range(2)])
    full = lambda t: t.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]  # noqa: E731
    _check_blocks(w, q, full(s), full(amax))
    torch.testing.assert_close(dequantize_128x128(q, s), q.float() * full(s))
    # A tile of wᵀ is the transpose of a tile of w: the dgrad GEMM's weight is w's quantization transposed.
    qt, st = quantize_128x128(w.t())
    assert torch.equal(qt.float(), q.float().t()) and torch.equal(st, s.t())


def test_tpspec_applies_the_recipe_to_every_linear_but_the_lm_head():
    model = K3Model(ModelConfig(), linear_backend="torch", precision_recipe="mxfp8")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert not isinstance(linears.pop("lm_head"), RecipeLinear)
    assert linears and all(isinstance(m, RecipeLinear) for m in linears.values()), \
        [n for n, m in linears.items() if not isinstance(m, RecipeLinear)]


@pytest.mark.skipif(fp8_block_unavailable() is None, reason="this machine runs fp8_block")
def test_fp8_block_without_its_gpu_path_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"precision\.recipe=fp8_block"):
        TPSpec(None, 0.02, recipe="fp8_block")
