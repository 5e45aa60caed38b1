"""RMSNorm: the Triton kernels against the torch reference (CPU: Triton interpreter; GPU: the same
tests on CUDA), and the reference against float64.

Tolerances: fp32 outputs agree to a few fp32 ulp of the terms (different summation order of
mean(x²) and of the row sums); half-precision outputs to one rounding of the store (the
interpreter truncates fp32 → bf16 where GPUs round to nearest even). The weight gradient sums
over rows: its bound scales with the sum of the magnitudes of its terms.
"""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from k3train.model.norm import RMSNorm
from kernels.rms_norm import reference as R
from kernels.rms_norm import rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
# one rounding of a store, relative: RNE on GPUs (half an ulp), truncation in the interpreter (one ulp)
ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0**-8 if DEV == "cuda" else 2.0**-7,
         torch.float16: 2.0**-11 if DEV == "cuda" else 2.0**-10}
TINY = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 2.0**-24}  # fp16 subnormal spacing


def random_input(shape, seed, dtype=torch.float32) -> torch.Tensor:
    """Normal values, rows scaled over e^±3 (RMS far from 1), never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.empty(*shape[:-1], 1).uniform_(-3, 3, generator=g).exp()
    x = torch.where(x == 0, torch.full_like(x, 0.5), x)
    return x.to(dtype)


def _float64_grads(x, w, dy, g=None):
    """y, dx, dw (and dg) of the reference math in float64."""
    x, w = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    if g is not None:
        g = g.detach().double().requires_grad_()
        y = y * torch.sigmoid(g)
    y.backward(dy.double())
    return y.detach(), x.grad, w.grad, None if g is None else g.grad


def _assert_near(got, want, scale, rtol, what):
    dtype = got.dtype
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bound = ROUND[dtype] * want.abs() + rtol * scale.cpu() + TINY[dtype]
    bad = (got - want).abs() > bound
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {bad.numel()} off, worst {((got - want).abs() - bound).max():.3e}"


def _check(x, w, dy, y, dx, dw, rtol=2e-6, g=None, dg=None):
    """Outputs of one forward/backward against float64, with the bounds of the module docstring
    (gated: dy enters the norm's backward as dy·σ(g))."""
    y64, dx64, dw64, dg64 = _float64_grads(x.cpu(), w.cpu(), dy.cpu(), None if g is None else g.cpu())
    xs, ws, dys = x.detach().cpu().double(), w.detach().cpu().double(), dy.detach().cpu().double()
    r = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + EPS)
    # fp32 errors are relative to the terms' magnitudes: |x̂|·|w| for y, r·(|w dy| + |x̂|·mean|x̂ w dy|) for dx
    xhat = (xs * r).abs()
    if g is not None:
        sg = torch.sigmoid(g.detach().cpu().double())
        # σ' = σ(1 − σ) in fp32 is off by an ulp of 1 (times σ) where σ saturates: 4 ulp of slack
        ulp_slack = 4 * 2.0**-23 / rtol
        _assert_near(dg, dg64, (dys * xhat * ws).abs() * sg * (1 - sg + ulp_slack), rtol, "dgate")
        dys = dys * sg
        _assert_near(y, y64, xhat * ws.abs() * sg, rtol, "y")
    else:
        _assert_near(y, y64, xhat * ws.abs(), rtol, "y")
    dx_scale = r * ((ws * dys).abs() + xhat * (xhat * (ws * dys).abs()).mean(-1, keepdim=True))
    _assert_near(dx, dx64, dx_scale, rtol, "dx")
    dw_scale = (dys.abs() * xhat).reshape(-1, xs.shape[-1]).sum(0)
    _assert_near(dw, dw64, dw_scale, rtol, "dw")


def test_reference_matches_float64():
    x, w, dy = random_input((3, 7, 40), 0), random_input((40,), 1), random_input((3, 7, 40), 2)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = R.rms_norm(xg, wg, EPS)
    y.backward(dy)
    _check(x, w, dy, y, xg.grad, wg.grad)


def test_model_norm_is_the_op():
    """k3train's RMSNorm module runs kernels.rms_norm (the reference on CPU)."""
    m = RMSNorm(40, EPS)
    with torch.no_grad():
        m.weight.copy_(random_input((40,), 3))
    x = random_input((2, 5, 40), 4)
    torch.testing.assert_close(m(x), R.rms_norm(x, m.weight, EPS), rtol=0, atol=0)


def test_model_norm_autocast_output():
    """autocast_output=True: under autocast y is the fp32 result rounded once to the autocast dtype;
    without autocast, or with the option off, y keeps x's dtype."""
    on, off = RMSNorm(40, EPS, autocast_output=True), RMSNorm(40, EPS)
    with torch.no_grad():
        on.weight.copy_(random_input((40,), 3))
        off.weight.copy_(on.weight)
    x = random_input((2, 5, 40), 4).requires_grad_()
    want = R.rms_norm(x, on.weight, EPS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_off = on(x), off(x)
    assert y.dtype == torch.bfloat16 and y_off.dtype == torch.float32
    torch.testing.assert_close(y, want.to(torch.bfloat16), rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert on(x).dtype == torch.float32


def test_errors():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="gate"):
        rms_norm(torch.randn(2, 8), torch.ones(8), EPS, gate=torch.randn(2, 4))
    with pytest.raises(ValueError, match="backend"):
        rms_norm(torch.randn(2, 8), torch.ones(8), EPS, backend="cuda")


@triton_cpu
@pytest.mark.parametrize("shape", [(37, 96), (2, 9, 128), (5, 1024), (3, 384)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
def test_triton_kernels(shape, dtype, wdtype):
    x = random_input(shape, 10, dtype)
    w = random_input(shape[-1:], 11, wdtype)
    dy = random_input(shape, 12, dtype)
    xg, wg = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    y = rms_norm(xg, wg, EPS, backend="triton")
    assert type(y.grad_fn).__name__.startswith("_RMSNorm") and y.dtype == dtype
    y.backward(dy.to(DEV))
    assert xg.grad.dtype == dtype and wg.grad.dtype == wdtype
    _check(x, w, dy, y, xg.grad, wg.grad)


def test_reference_gated_matches_float64():
    x, w, g, dy = (random_input(s, i) for i, s in enumerate([(3, 7, 40), (40,), (3, 7, 40), (3, 7, 40)]))
    xg, wg, gg = x.clone().requires_grad_(), w.clone().requires_grad_(), g.clone().requires_grad_()
    y = R.rms_norm(xg, wg, EPS, gate=gg)
    y.backward(dy)
    _check(x, w, dy, y, xg.grad, wg.grad, g=g, dg=gg.grad)


@triton_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_gated(dtype):
    """KDA's output: x and the gate logits bf16 (or fp32) [B, T, H, h], the fp32 o_norm gain, y in x.dtype."""
    shape = (2, 9, 3, 128)
    x, g, dy = (random_input(shape, s, dtype) for s in (60, 61, 62))
    w = random_input((128,), 63)
    xg, wg, gg = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_(), g.to(DEV).requires_grad_()
    y = rms_norm(xg, wg, EPS, gate=gg, backend="triton")
    assert type(y.grad_fn).__name__.startswith("_RMSNorm") and y.dtype == dtype
    y.backward(dy.to(DEV))
    assert gg.grad.dtype == dtype
    _check(x, w, dy, y, xg.grad, wg.grad, g=g, dg=gg.grad)


@triton_cpu
def test_triton_out_dtype():
    """fp32 x, bf16 y: y is the fp32 result stored in bf16; dy comes in bf16; dx and dw in fp32."""
    x, w = random_input((33, 96), 50), random_input((96,), 51)
    dy = random_input((33, 96), 52, torch.bfloat16)
    xg, wg = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    y = rms_norm(xg, wg, EPS, torch.bfloat16, backend="triton")
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(DEV))
    assert xg.grad.dtype == torch.float32 and wg.grad.dtype == torch.float32
    _check(x, w, dy.float(), y, xg.grad, wg.grad)


@triton_cpu
def test_triton_noncontiguous_and_empty():
    """A strided input (rows of a wider tensor, last dim contiguous) and a transposed one give the
    reference's values; an empty input gives an empty output and gradient."""
    wide = random_input((20, 2, 64), 20)
    w = random_input((64,), 21)
    for x in (wide[:, 1], wide.transpose(0, 1)):
        xg, wg = x.to(DEV).requires_grad_(), w.clone().to(DEV).requires_grad_()
        dy = random_input(x.shape, 22)
        y = rms_norm(xg, wg, EPS, backend="triton")
        y.backward(dy.to(DEV))
        _check(x, w, dy, y, xg.grad, wg.grad)
    e = torch.empty(0, 64, device=DEV, requires_grad=True)
    y = rms_norm(e, w.to(DEV), EPS, backend="triton")
    y.sum().backward()
    assert y.shape == (0, 64) and e.grad.shape == (0, 64)


@triton_cpu
def test_triton_custom_op_registration():
    """k3::rms_norm: schema, fake shapes and autograd registration (what torch.compile relies on)."""
    x = random_input((3, 5, 24), 30).to(DEV).requires_grad_()
    w = random_input((24,), 31).to(DEV).requires_grad_()
    g = random_input((3, 5, 24), 32).to(DEV).requires_grad_()
    torch.library.opcheck(torch.ops.k3.rms_norm, (x, w, None, EPS, torch.float32))
    torch.library.opcheck(torch.ops.k3.rms_norm, (x, w, None, EPS, torch.bfloat16))
    torch.library.opcheck(torch.ops.k3.rms_norm, (x, w, g, EPS, torch.float32))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton_at_bench_shapes():
    """bench-1B shapes: 2×4096 tokens × 1024 (layer norms) and × 8 heads × 128 (KDA o_norm), bf16."""
    for shape in ((2, 4096, 1024), (2, 4096, 8, 128)):
        x, dy = random_input(shape, 40, torch.bfloat16), random_input(shape, 41, torch.bfloat16)
        w = random_input(shape[-1:], 42)
        xg, wg = x.cuda().requires_grad_(), w.cuda().requires_grad_()
        y = rms_norm(xg, wg, EPS)  # auto -> Triton on CUDA
        assert type(y.grad_fn).__name__.startswith("_RMSNorm")
        y.backward(dy.cuda())
        _check(x, w, dy, y, xg.grad, wg.grad, rtol=1e-5)
