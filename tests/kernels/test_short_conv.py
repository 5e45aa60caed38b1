"""KDA's causal short conv with document resets: the reference's analytic backward against torch
autograd, and the Triton kernels against the reference (CPU: Triton interpreter; GPU: the same
tests on CUDA).

Kernel results are compared with the reference evaluated in float64 on the same (fp32 or
bf16-valued) inputs: fp32 outputs to within ``RTOL`` of the sum of their terms' magnitudes, bf16
outputs additionally within the store's rounding of the exact value (GPU: round to nearest, half
an ulp, 2⁻⁸ relative; the interpreter truncates fp32 → bf16, one ulp, 2⁻⁷).
"""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

import k3train.model.kda as model_kda
from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from kernels.short_conv import causal_conv_with_resets
from kernels.short_conv import reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-6
BF16_ROUND = 2.0**-8 if DEV == "cuda" else 2.0**-7


def packed_positions(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    """[B, T] positions of documents 1..6 tokens long packed into rows; odd rows open inside a
    document (first position 1..5), even rows with one (position 0)."""
    rows = []
    for b in range(B):
        pos = []
        start = 0 if b % 2 == 0 else int(torch.randint(1, 6, (), generator=g))
        while len(pos) < T:
            n = int(torch.randint(1, 7, (), generator=g))
            pos += range(start, start + n)
            start = 0
        rows.append(torch.tensor(pos[:T]))
    return torch.stack(rows)


def random_inputs(B: int, T: int, C: int, W: int, seed: int):
    """x, weight, go float64 with no zeros; position_ids from ``packed_positions``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, 1, W, generator=g, dtype=torch.float64)
    go = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    pos = packed_positions(B, T, g)
    assert bool((pos[:, 1:] == 0).any()), "no document starts inside a row"
    return x, weight, pos, go


def _abs_bounds(x, weight, pos, go, silu=False):
    """Elementwise bounds Σ|terms| of out, dx and dweight (the reference on absolute values). With SiLU
    (|SiLU'| ≤ 1.1, |SiLU''| ≤ 0.5): the conv's bounds times 1.1, and the gradients' also for the
    error of the recomputed conv, |g|·0.5·Σ|terms of a|, through the same sums."""
    out = R.causal_conv_forward(x.abs(), weight.abs(), pos)
    dx, dw = R.causal_conv_backward(x.abs(), weight.abs(), pos, go.abs())
    if not silu:
        return out, dx, dw
    dx2, dw2 = R.causal_conv_backward(x.abs(), weight.abs(), pos, go.abs() * 0.5 * out)
    return 1.1 * out, 1.1 * dx + dx2, 1.1 * dw + dw2


def _assert_near(got, want, bound, dtype, what):
    """|got − want| ≤ RTOL·bound (+ BF16_ROUND·|want| for a bf16 result), elementwise."""
    got, want, bound = got.detach().cpu().double(), want.cpu(), bound.cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = RTOL * bound + (BF16_ROUND * want.abs() if dtype == torch.bfloat16 else 0.0)
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max err {float((got - want).abs().max()):.3g}"


# ----------------------------------------------------------------------------------------------
# reference and torch backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("silu", [False, True])
def test_reference_backward_matches_autograd(W, silu):
    x, weight, pos, go = random_inputs(3, 11, 5, W, seed=W)
    xl, wl = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = R.causal_conv_forward(xl, wl, pos, silu)
    out.backward(go)
    dx, dw = R.causal_conv_backward(x, weight, pos, go, silu)
    torch.testing.assert_close(dx, xl.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, wl.grad, rtol=1e-12, atol=1e-12)
    assert out.dtype == torch.float64
    assert R.causal_conv_forward(x.bfloat16(), weight.float(), pos).dtype == torch.bfloat16


def test_reference_reads_nothing_before_a_document_start():
    """Changing x before a document start leaves every output from that start on unchanged."""
    x, weight, pos, _ = random_inputs(2, 16, 8, 4, seed=7)
    b, t = map(int, (pos[:, 1:] == 0).nonzero()[0])
    t += 1
    y = x.clone()
    y[b, :t] = torch.randn_like(y[b, :t])
    ref_x, ref_y = R.causal_conv_forward(x, weight, pos), R.causal_conv_forward(y, weight, pos)
    assert torch.equal(ref_x[b, t:], ref_y[b, t:]) and not torch.equal(ref_x[b, :t], ref_y[b, :t])


def test_torch_backend_is_the_reference():
    x, weight, pos, _ = random_inputs(2, 9, 12, 4, seed=3)
    x, weight = x.float(), weight.float()
    ref = R.causal_conv_forward(x, weight, pos)
    for backend in ("torch", "auto"):
        assert torch.equal(causal_conv_with_resets(x, weight, pos, backend=backend), ref)
    assert model_kda.causal_conv_with_resets is causal_conv_with_resets


def test_errors():
    x, w, pos = torch.randn(2, 5, 8), torch.randn(8, 1, 4), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="unknown short-conv backend"):
        causal_conv_with_resets(x, w, pos, backend="cuda")
    with pytest.raises(ValueError, match="weight"):
        causal_conv_with_resets(x, torch.randn(9, 1, 4), pos)
    with pytest.raises(ValueError, match="position_ids"):
        causal_conv_with_resets(x, w, pos[:, :4])
    with pytest.raises(ValueError, match="Triton short-conv kernels take"):
        causal_conv_with_resets(x.double(), w, pos, backend="triton")
    wide = torch.randn(8, 1, 5)
    with pytest.raises(ValueError, match="up to 4 taps"):
        causal_conv_with_resets(x, wide, pos, backend="triton")
    torch.testing.assert_close(causal_conv_with_resets(x, wide, pos), R.causal_conv_forward(x, wide, pos))


# ----------------------------------------------------------------------------------------------
# Triton kernels against the reference
# ----------------------------------------------------------------------------------------------

@triton_cpu
@pytest.mark.parametrize("B, T, C, W, dtype, silu", [
    (2, 13, 96, 4, torch.float32, False), (2, 19, 200, 4, torch.bfloat16, False),
    (1, 21, 200, 2, torch.float32, False), (2, 9, 96, 1, torch.bfloat16, False), (3, 17, 70, 3, torch.float32, True),
    (2, 13, 96, 4, torch.float32, True), (2, 19, 200, 4, torch.bfloat16, True), (1, 9, 96, 1, torch.float32, True)])
def test_triton_kernels(B, T, C, W, dtype, silu):
    """T off the row block of 8, C off the channel block of 64 (96 = 1.5 blocks, 200 = 3.1); with and
    without the fused SiLU."""
    x, weight, pos, go = random_inputs(B, T, C, W, seed=T + C + W)
    x, go = x.to(dtype).double(), go.to(dtype).double()  # the values the kernel sees
    weight = weight.float().double()
    xl, wl = x.to(dtype).to(DEV).requires_grad_(), weight.float().to(DEV).requires_grad_()
    out = causal_conv_with_resets(xl, wl, pos.to(DEV), silu, backend="triton")
    assert type(out.grad_fn).__name__.startswith("_CausalConvWithResets")
    out.backward(go.to(dtype).to(DEV))
    assert out.dtype == xl.grad.dtype == dtype and wl.grad.dtype == torch.float32
    ref_out = R.causal_conv_forward(x, weight, pos, silu)
    ref_dx, ref_dw = R.causal_conv_backward(x, weight, pos, go, silu)
    b_out, b_dx, b_dw = _abs_bounds(x, weight, pos, go, silu)
    _assert_near(out, ref_out, b_out, dtype, "out")
    _assert_near(xl.grad, ref_dx, b_dx, dtype, "dx")
    _assert_near(wl.grad, ref_dw, b_dw, torch.float32, "dweight")


@triton_cpu
def test_triton_model_equals_reference_path(monkeypatch):
    """k3_tiny (C = 192, packed documents) loss and every gradient: the kernel against the torch
    path."""
    torch.manual_seed(0)
    model = K3Model(ModelConfig()).to(DEV)
    tokens = torch.randint(0, 512, (2, 12), device=DEV)
    labels = torch.randint(0, 512, (2, 12), device=DEV)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]], device=DEV)

    def loss_and_grads():
        model.zero_grad()
        loss = model(tokens, position_ids=pos, labels=labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = loss_and_grads()
    calls = []

    def kernel(x, weight, position_ids, silu=False):
        calls.append((x.shape, silu))
        return causal_conv_with_resets(x, weight, position_ids, silu, backend="triton")

    monkeypatch.setattr(model_kda, "causal_conv_with_resets", kernel)
    got, got_grads = loss_and_grads()
    assert calls and all(c == ((2, 12, 64), True) for c in calls)  # one conv each of q, k, v, its SiLU fused
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    conv_grads = [n for n in want_grads if "conv1d" in n]
    assert len(conv_grads) == len(calls) and len(calls) % 3 == 0
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-9,
                                   msg=lambda m, n=n: f"{n}: {m}")


@triton_cpu
def test_triton_custom_op_registration():
    """k3::short_conv's schema, fake shapes and autograd registration (what torch.compile relies on)
    agree with the kernels."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, 40, generator=g, device="cpu").to(DEV).requires_grad_()
    w = torch.randn(40, 4, generator=g).to(DEV).requires_grad_()
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1]], device=DEV)
    for silu in (False, True):
        torch.library.opcheck(torch.ops.k3.short_conv, (x, w, pos, silu))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)
