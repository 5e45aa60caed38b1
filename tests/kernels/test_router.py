"""MoE router tail: the Triton kernels against the torch reference (CPU: Triton interpreter; GPU: the
same tests on CUDA), and the reference against float64 autograd of the same math.

Inputs are random normal logits and a random bias, never zeros: with fp32 scores there are no ties,
so the chosen experts must agree exactly. Values agree within a few fp32 ulp of their terms: σ
computed as 1/(1 + e^−z) against torch.sigmoid, sums of k terms in a different order; the gradient's
bound scales with the magnitudes of its terms, ρ/S·(|dw_i| + Σ_j |dw_j| s_j/S)·s_i(1 − s_i), with
an ulp of 1 added to 1 − s_i (cancellation where s saturates).
"""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from k3train.model.router import SigmoidRouter
from kernels.router import reference as R
from kernels.router import route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 4e-6  # fp32: a few ulp of the terms
SHAPES = [(37, 96, 16), (13, 896, 16), (10, 128, 8), (5, 1024, 16), (9, 8, 2), (6, 3, 1)]


def _inputs(n, e, k, seed):
    """logits [n, e] (normal, ×2), bias [e] (uniform ±0.3: it changes the selection), dweights [n, k]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, e, generator=g) * 2
    b = torch.empty(e).uniform_(-0.3, 0.3, generator=g)
    dw = torch.randn(n, k, generator=g)
    for t in (z, b, dw):
        t.masked_fill_(t == 0, 0.25)
    return z, b, dw


def _float64(z, b, k, rho, dw):
    """weights, experts, scores, cutoff and dlogits of the reference math in float64."""
    z64 = z.detach().cpu().double().requires_grad_()
    s = torch.sigmoid(z64)
    vals, idx = (s.detach() + b.cpu().double()).topk(k + 1, dim=-1)
    chosen = s.gather(1, idx[:, :k])
    w = chosen / chosen.sum(-1, keepdim=True) * rho
    w.backward(dw.cpu().double())
    return w.detach(), idx[:, :k], s.detach(), vals[:, k], z64.grad


def _assert_near(got, want, scale, what, rtol=RTOL):
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bound = rtol * scale.cpu().double() + 1e-38
    bad = (got - want).abs() > bound
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {bad.numel()} off, worst {((got - want).abs() - bound).max():.3e}"


def _check(z, b, k, rho, dw, out, dz):
    """One forward (and the logits' gradient) against float64."""
    weights, experts, scores, cutoff = out
    w64, e64, s64, c64, dz64 = _float64(z, b, k, rho, dw)
    assert weights.dtype == scores.dtype == cutoff.dtype == dz.dtype == torch.float32 and experts.dtype == torch.int64
    assert weights.shape == experts.shape == (z.shape[0], k) and cutoff.shape == (z.shape[0],)
    assert torch.equal(experts.cpu(), e64), "experts"
    _assert_near(scores, s64, s64, "scores")
    _assert_near(weights, w64, w64.abs(), "weights")
    _assert_near(cutoff, c64, c64.abs() + b.abs().max().double(), "cutoff")
    chosen = s64.gather(1, e64)
    S = chosen.sum(-1, keepdim=True)
    dw64 = dw.cpu().double().abs()
    term = torch.zeros_like(s64).scatter(1, e64, dw64 + (dw64 * chosen).sum(-1, keepdim=True) / S)
    # σ' = s(1 − s) from the fp32 s is off by an ulp of 1 (times s) where s saturates: slack of 2 ulp
    _assert_near(dz, dz64, abs(rho) / S * term * s64 * (1 - s64 + 2.0**-22 / 2e-5), "dlogits", rtol=2e-5)


def _run(z, b, k, rho, dw, backend):
    zg = z.to(DEV).requires_grad_()
    out = route(zg, b.to(DEV), k, rho, backend=backend)
    out[0].backward(dw.to(DEV))
    return out, zg.grad


@pytest.mark.parametrize("n,e,k", [(37, 96, 16), (9, 8, 2)], ids=str)
def test_reference_matches_float64(n, e, k):
    z, b, dw = _inputs(n, e, k, 0)
    out, dz = _run(z, b, k, 2.5, dw, "torch")
    _check(z, b, k, 2.5, dw, out, dz)
    assert not any(t.requires_grad for t in out[1:])


def test_model_router_is_the_reference_bit_for_bit():
    """SigmoidRouter on CPU: exactly the math it had before the op (sigmoid, + bias, topk(k+1), gather,
    renormalise, scale)."""
    router = SigmoidRouter(16, 8, 2, 1.5, 0.5)
    router.e_score_correction_bias.uniform_(-0.2, 0.2, generator=torch.Generator().manual_seed(1))
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    r = router(x)
    s = torch.sigmoid(x.float() @ router.weight.float().t())
    top_vals, top_idx = (s.detach() + router.e_score_correction_bias).topk(3, dim=-1)
    chosen = s.gather(1, top_idx[:, :2])
    w = chosen / chosen.sum(-1, keepdim=True) * 1.5
    assert torch.equal(r.experts, top_idx[:, :2]) and torch.equal(r.weights, w)
    assert torch.equal(r.scores, s.detach()) and torch.equal(r.cutoff, top_vals[:, 2])
    (gx,) = torch.autograd.grad(r.weights.sum(), x)
    (want,) = torch.autograd.grad(w.sum(), x)
    assert torch.equal(gx, want)


def test_errors():
    z, b = torch.randn(4, 8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"\[N, E\]"):
        route(torch.randn(2, 4, 8), b, 2, 1.0)
    with pytest.raises(ValueError, match="bias"):
        route(z, torch.zeros(7), 2, 1.0)
    with pytest.raises(ValueError, match="float32"):
        route(z.bfloat16(), b, 2, 1.0)
    with pytest.raises(ValueError, match="float32"):
        route(z, b.double(), 2, 1.0)
    for k in (0, 8, 9, -1, 2.0):
        with pytest.raises(ValueError, match="top_k"):
            route(z, b, k, 1.0)
    with pytest.raises(ValueError, match="backend"):
        route(z, b, 2, 1.0, backend="cuda")


@triton_cpu
@pytest.mark.parametrize("n,e,k", SHAPES, ids=str)
def test_triton_matches_reference(n, e, k):
    z, b, dw = _inputs(n, e, k, 10 + e)
    out, dz = _run(z, b, k, 2.5, dw, "triton")
    assert type(out[0].grad_fn).__name__.startswith("_Route")
    assert not any(t.requires_grad for t in out[1:])
    _check(z, b, k, 2.5, dw, out, dz)
    ref, dz_ref = _run(z, b, k, 2.5, dw, "torch")
    assert torch.equal(out[1].cpu(), ref[1].cpu())
    for got, want, what in zip((*out[:1], *out[2:], dz), (*ref[:1], *ref[2:], dz_ref), ("w", "s", "cutoff", "dz")):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2e-5, atol=1e-6, msg=what)


@triton_cpu
def test_triton_noncontiguous_logits_and_dweights():
    """Logits as every other column of a wider tensor and as a transpose, the bias a strided view;
    dweights expanded (stride 0)."""
    z, b, dw = _inputs(21, 96, 6, 30)
    b = torch.stack([b, -b], 1)[:, 0]
    assert not b.is_contiguous()
    wide = torch.randn(21, 192)
    wide[:, ::2] = z
    for zz in (wide[:, ::2], z.t().contiguous().t()):
        assert not zz.is_contiguous()
        zg = zz.to(DEV).requires_grad_()
        out = route(zg, b.to(DEV), 6, 1.0, backend="triton")
        out[0].backward(dw.to(DEV))
        _check(z, b, 6, 1.0, dw, out, zg.grad)
    zg = z.to(DEV).requires_grad_()
    out = route(zg, b.to(DEV), 6, 1.0, backend="triton")
    out[0].sum().backward()  # dweights: ones expanded, strides (0, 0)
    _check(z, b, 6, 1.0, torch.ones(21, 6), out, zg.grad)


@triton_cpu
def test_triton_ties_pick_the_lowest_expert_and_empty():
    """Equal biased scores: the lowest expert ids first, the cutoff is the tied value. No rows: empty outputs."""
    z = torch.zeros(5, 12, device=DEV)
    b = torch.zeros(12, device=DEV)
    b[7] = 0.1
    w, experts, s, cutoff = route(z, b, 3, 1.0, backend="triton")
    assert experts.cpu().tolist() == [[7, 0, 1]] * 5
    assert torch.equal(cutoff.cpu(), torch.full((5,), 0.5)) and torch.equal(w.cpu(), torch.full((5, 3), 1 / 3))
    out = route(torch.empty(0, 12, device=DEV), b, 3, 1.0, backend="triton")
    assert [tuple(t.shape) for t in out] == [(0, 3), (0, 3), (0, 12), (0,)]


@triton_cpu
def test_triton_compiled_is_the_custom_op_and_equals_eager():
    """Under torch.compile route(..., backend="triton") is the ``k3::route`` custom op (one graph, no break):
    the same kernels, so the same outputs and gradient bit for bit."""
    z, b, dw = _inputs(19, 96, 16, 40)

    def fn(zz):
        return route(zz, b.to(DEV), 16, 2.5, backend="triton")

    zg = z.to(DEV).requires_grad_()
    eager = fn(zg)
    eager[0].backward(dw.to(DEV))
    assert type(eager[0].grad_fn).__name__.startswith("_Route")
    torch._dynamo.reset()
    zc = z.to(DEV).requires_grad_()
    gm = []

    def backend(graph, example_inputs):
        gm.append(graph)
        return graph

    torch.compile(fn, backend=backend, fullgraph=True)(zc)
    assert "k3.route" in str(gm[0].graph)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(zc)
    compiled[0].backward(dw.to(DEV))
    for got, want in zip((*compiled, zc.grad), (*eager, zg.grad)):
        assert torch.equal(got, want)


@triton_cpu
def test_triton_route_custom_ops_pass_opcheck():
    z, b, dw = _inputs(11, 40, 5, 41)
    z, b, dw = z.to(DEV), b.to(DEV), dw.to(DEV)
    torch.library.opcheck(torch.ops.k3.route, (z.requires_grad_(), b, 5, 1.5))
    _, experts, scores, _ = route(z.detach(), b, 5, 1.5, backend="triton")
    torch.library.opcheck(torch.ops.k3.route_backward, (dw, experts, scores, 1.5))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton_at_k3_shapes():
    """K3 full size: 2×4096 tokens, E = 896, k = 16; bench-1B's E = 128, k = 8."""
    for n, e, k in ((8192, 896, 16), (8192, 128, 8)):
        z, b, dw = _inputs(n, e, k, 50)
        zg = z.cuda().requires_grad_()
        out = route(zg, b.cuda(), k, 2.5)  # auto -> Triton on CUDA
        assert type(out[0].grad_fn).__name__.startswith("_Route")
        out[0].backward(dw.cuda())
        _check(z, b, k, 2.5, dw, out, zg.grad)
