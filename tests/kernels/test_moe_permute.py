"""MoE token permutation (kernels/moe_permute): the torch reference against the model's
LocalTokenDispatcher, and both backends' forwards and gradients against the reference evaluated
in float64 on the same inputs (CPU: Triton interpreter; GPU: the same tests on CUDA).

Tolerances: |out − ref| ≤ round·|ref| + rtol·scale, where scale is the same sum taken over the
magnitudes of its terms (the fp32 accumulation error is relative to it) and round the rounding of
one half-precision store.
"""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from k3train.parallel.token_dispatcher import LocalTokenDispatcher
from kernels.backend import triton_on_cpu
from kernels.moe_permute import combine_rows, dispatch_rows
from kernels.moe_permute import reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL32 = 1e-6
# RNE is within half a bf16 ulp (2^-8 relative); the interpreter truncates fp32 -> bf16 (one ulp).
ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0**-8 if DEV == "cuda" else 2.0**-7}
TINY = 1e-30


def routing(N: int, E: int, k: int, seed: int, device=DEV):
    """experts [N, k] (k distinct of E a token) and its (order, inverse), as the dispatcher sorts."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(N, E, generator=g).argsort(dim=1)[:, :k]
    order = experts.flatten().argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return experts.to(device), order.to(device), inverse.to(device)


def random_input(shape, seed, dtype=torch.float32, device=DEV) -> torch.Tensor:
    """Normals with magnitudes spread over ~e^±3; never zeros (the rare exact 0 of randn among
    the 67M values of the bench-dims test becomes 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.empty(shape).uniform_(-3, 3, generator=g).exp()
    x = x.to(dtype).masked_fill_(x.to(dtype) == 0, 1.0)
    assert bool((x != 0).all())
    return x.to(device)


def _grads(dispatch, combine, z, y, w, dx, du):
    """(x, dz, u, dy, dw) of x = dispatch(z), u = combine(y, w) with upstream gradients dx, du."""
    z, y = z.detach().requires_grad_(), y.detach().requires_grad_()
    w = w.detach().requires_grad_()
    x, u = dispatch(z), combine(y, w)
    x.backward(dx)
    u.backward(du)
    return x, z.grad, u, y.grad, w.grad


def _reference(z, y, w, dx, du, order, inverse, k):
    """float64 reference outputs and gradients, and their scales (the same with |inputs|)."""
    def run(f):
        return _grads(lambda a: R.dispatch_rows(a, order, inverse, k),
                      lambda a, b: R.combine_rows(a, b, order, inverse),
                      *(f(t.double()) for t in (z, y, w, dx, du)))
    return run(lambda t: t), run(torch.abs)


def _assert_matches(outs, refs, scales, dtypes, rtol=RTOL32, what=""):
    names = ("x", "dz", "u", "dy", "dw")
    for name, out, ref, scale, dt in zip(names, outs, refs, scales, dtypes):
        assert out.dtype == dt and out.shape == ref.shape, (what, name, out.dtype, out.shape, ref.shape)
        err = (out.double() - ref).abs()
        bound = ROUND[dt] * ref.abs() + rtol * scale + TINY
        bad = ~(err <= bound)
        assert not bad.any(), (f"{what} {name}: {int(bad.sum())}/{bad.numel()} off, worst err/bound "
                               f"{float((err / bound).max()):.3g}")


def _check_backend(backend, N, E, k, dtype, w_dtype, index_dtype, seed, z=None, y=None, du=None):
    _, order, inverse = routing(N, E, k, seed)
    order, inverse = order.to(index_dtype), inverse.to(index_dtype)
    ell = 37
    z = random_input((N, ell), seed + 1, dtype) if z is None else z
    y = random_input((N * k, ell), seed + 2, dtype) if y is None else y
    w = random_input((N, k), seed + 3, w_dtype)
    dx = random_input((N * k, ell), seed + 4, dtype)
    du = random_input((N, ell), seed + 5, dtype) if du is None else du
    outs = _grads(lambda a: dispatch_rows(a, order, inverse, k, backend=backend),
                  lambda a, b: combine_rows(a, b, order, inverse, backend=backend), z, y, w, dx, du)
    refs, scales = _reference(z, y, w, dx, du, order, inverse, k)
    _assert_matches(outs, refs, scales, (dtype, dtype, dtype, dtype, w_dtype), what=backend)
    return outs


# ----------------------------------------------------------------------------------------------
# reference and torch backend
# ----------------------------------------------------------------------------------------------

def test_reference_matches_token_dispatcher():
    """The torch backend agrees with LocalTokenDispatcher (index_select + bmm) in fp32."""
    N, E, k, ell = 33, 8, 3, 20
    experts, _, _ = routing(N, E, k, seed=1, device="cpu")
    z = random_input((N, ell), 2, device="cpu").requires_grad_()
    w = torch.rand(N, k, dtype=torch.float32).add_(0.1).requires_grad_()
    du = random_input((N, ell), 3, device="cpu")
    xg, _, handle = LocalTokenDispatcher(E).dispatch(z, experts)
    u = LocalTokenDispatcher(E).combine(xg * 2.0, w, handle)
    u.backward(du)
    z2, w2 = z.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    xg2 = dispatch_rows(z2, handle.order, handle.inverse, k, backend="torch")
    u2 = combine_rows(xg2 * 2.0, w2, handle.order, handle.inverse, backend="torch")
    u2.backward(du)
    assert torch.equal(xg2, xg)
    for a, b in ((u2, u), (z2.grad, z.grad), (w2.grad, w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_backend(dtype):
    _check_backend("torch", 29, 8, 3, dtype, torch.float32, torch.int64, seed=5)


def test_errors():
    _, order, inverse = routing(4, 4, 2, seed=0, device="cpu")
    z, y, w = torch.randn(4, 8), torch.randn(8, 8), torch.rand(4, 2)
    with pytest.raises(ValueError, match="unknown MoE permute backend"):
        dispatch_rows(z, order, inverse, 2, backend="cuda")
    with pytest.raises(ValueError, match="int32/int64 \\[12\\]"):
        dispatch_rows(z, order, inverse, 3)
    with pytest.raises(ValueError, match="int32/int64"):
        combine_rows(y, w, order.float(), inverse)
    with pytest.raises(ValueError, match="N·k, ℓ"):
        combine_rows(y[:6], w, order, inverse)
    with pytest.raises(ValueError, match="fp32 or y's dtype"):
        combine_rows(y.bfloat16(), w.half(), order, inverse)
    with pytest.raises(ValueError, match="Triton MoE permute kernels take"):
        dispatch_rows(z.double(), order, inverse, 2, backend="triton")


# ----------------------------------------------------------------------------------------------
# Triton kernels against the reference
# ----------------------------------------------------------------------------------------------

CASES = [  # (N, E, k, dtype, weights dtype, index dtype)
    (45, 8, 3, torch.float32, torch.float32, torch.int64),
    (45, 8, 3, torch.bfloat16, torch.float32, torch.int64),
    (22, 8, 8, torch.bfloat16, torch.bfloat16, torch.int32),
    (19, 4, 1, torch.float32, torch.float32, torch.int32),
]


@triton_cpu
@pytest.mark.parametrize("N,E,k,dtype,w_dtype,index_dtype", CASES,
                         ids=["fp32-k3", "bf16-k3", "bf16-k8-bf16w-i32", "fp32-k1-i32"])
def test_triton_kernels(N, E, k, dtype, w_dtype, index_dtype):
    """Odd N and ℓ = 37 (several token and column blocks, masked edges; k = 3 pads to 4)."""
    outs = _check_backend("triton", N, E, k, dtype, w_dtype, index_dtype, seed=10 * k)
    ref = _check_backend("torch", N, E, k, dtype, w_dtype, index_dtype, seed=10 * k)
    assert torch.equal(outs[0], ref[0])  # dispatch forward is a copy
    assert torch.equal(outs[3], ref[3]) or dtype != torch.float32  # dy = w·du, one rounding


@triton_cpu
def test_triton_strided_rows_and_partial_grads():
    """Row-strided z and y (column slices), an expanded du (row stride 0) and combine with only
    y or only weights needing a gradient."""
    N, E, k, ell = 21, 6, 2, 37
    z = random_input((N, ell + 5), 40)[:, 3:ell + 3]
    y = random_input((N * k, ell + 2), 41)[:, 1:ell + 1]
    du = random_input((1, ell), 42).expand(N, ell)
    _check_backend("triton", N, E, k, torch.float32, torch.float32, torch.int64, seed=43, z=z, y=y, du=du)
    _, order, inverse = routing(N, E, k, seed=44)
    w = random_input((N, k), 45)
    for need_y in (True, False):
        yy, ww = y.detach().clone().requires_grad_(need_y), w.clone().requires_grad_(not need_y)
        combine_rows(yy, ww, order, inverse, backend="triton").backward(du)
        yr, wr = y.detach().clone().requires_grad_(need_y), w.clone().requires_grad_(not need_y)
        combine_rows(yr, wr, order, inverse, backend="torch").backward(du)
        got, want = (yy.grad, yr.grad) if need_y else (ww.grad, wr.grad)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert (yy.grad is None) != need_y and (ww.grad is None) == need_y


@triton_cpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_padded_layout(backend):
    """A grouped layout with P padding rows among its N·k + P (``pad_rows``, what the expert-tiled GEMMs
    need): dispatch writes zeros there, combine never reads them (NaN there changes nothing) and gives them
    zero gradients; the other rows match the unpadded layout's exactly. The Triton kernels zero them in programs
    of their own launch after the tokens' (on CPU 16 rows a program: P = 37 takes three, the last partly)."""
    N, E, k, ell, P = 23, 6, 3, 37, 37
    _, order, inverse = routing(N, E, k, seed=60)
    g = torch.Generator().manual_seed(61)
    shuffled = torch.randperm(N * k + P, generator=g)
    real_rows, pad_rows = shuffled[:N * k].sort().values.to(DEV), shuffled[N * k:].to(DEV)
    inverse_p = real_rows[inverse]
    z, w = random_input((N, ell), 62), random_input((N, k), 63)
    y, dx, du = random_input((N * k, ell), 64), random_input((N * k, ell), 65), random_input((N, ell), 66)
    y_p = torch.full((N * k + P, ell), float("nan"), device=DEV).index_copy_(0, real_rows, y)
    dx_p = random_input((N * k + P, ell), 67).index_copy_(0, real_rows, dx)
    want = _grads(lambda a: dispatch_rows(a, order, inverse, k, backend=backend),
                  lambda a, b: combine_rows(a, b, order, inverse, backend=backend), z, y, w, dx, du)
    x_p, dz, u, dy_p, dw = _grads(
        lambda a: dispatch_rows(a, order, inverse_p, k, backend=backend, pad_rows=pad_rows),
        lambda a, b: combine_rows(a, b, order, inverse_p, backend=backend, pad_rows=pad_rows), z, y_p, w, dx_p, du)
    assert x_p.shape == y_p.shape == dy_p.shape
    assert not x_p[pad_rows].any() and not dy_p[pad_rows].any()
    for got, ref in ((x_p[real_rows], want[0]), (dz, want[1]), (u, want[2]), (dy_p[real_rows], want[3]),
                     (dw, want[4])):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"N·k \+ 37"):
        combine_rows(y, w, order, inverse_p, backend=backend, pad_rows=pad_rows)


@triton_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_padding_rows_only(dtype):
    """No token (N = 0) and P padding rows, unsorted: dispatch's forward and combine's backward launch only their
    padding programs, and every row comes out 0."""
    from kernels.moe_permute.triton_permute import combine_backward, dispatch_forward
    pad = torch.randperm(37, generator=torch.Generator().manual_seed(73)).to(DEV)
    empty = torch.empty(0, dtype=torch.long, device=DEV)
    x, xw = dispatch_forward(random_input((0, 37), 70, dtype), empty, 2, pad, torch.empty(0, 2, device=DEV))
    dy, _ = combine_backward(random_input((0, 37), 71, dtype), None, random_input((0, 2), 72, dtype), empty, 2,
                             dtype, dtype, pad)
    for rows in (x, dy):
        assert rows.shape == (pad.numel(), 37) and rows.dtype == dtype and not rows.any()
    assert xw.shape == (pad.numel(),) and xw.dtype == torch.float32 and not xw.any()


@triton_cpu
def test_triton_empty():
    """N = 0 (nothing launched) and ℓ = 0 (dweights = 0)."""
    for N, ell in ((0, 16), (5, 0)):
        _, order, inverse = routing(N, 4, 2, seed=50)
        z = torch.randn(N, ell, device=DEV, requires_grad=True)
        y = torch.randn(N * 2, ell, device=DEV, requires_grad=True)
        w = torch.rand(N, 2, device=DEV, requires_grad=True)
        x = dispatch_rows(z, order, inverse, 2, backend="triton")
        u = combine_rows(y, w, order, inverse, backend="triton")
        (x.sum() + u.sum()).backward()
        assert x.shape == (N * 2, ell) and u.shape == (N, ell)
        assert z.grad.shape == z.shape and y.grad.shape == y.shape and w.grad.shape == w.shape
        assert not w.grad.any()


@triton_cpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_end_to_end(backend):
    """combine(dispatch(z)) with weights w is z_i·Σ_j w_ij: dz_i = du_i·Σ_j w_ij, dw_ij = <z_i, du_i>."""
    N, E, k, ell = 27, 8, 4, 37
    _, order, inverse = routing(N, E, k, seed=60)
    z = random_input((N, ell), 61).requires_grad_()
    w = random_input((N, k), 62).requires_grad_()
    du = random_input((N, ell), 63)
    u = combine_rows(dispatch_rows(z, order, inverse, k, backend=backend), w, order, inverse,
                     backend=backend)
    u.backward(du)
    z64, w64, du64 = z.detach().double(), w.detach().double(), du.double()
    cases = ((u, z64 * w64.sum(1, keepdim=True), z64.abs() * w64.abs().sum(1, keepdim=True)),
             (z.grad, du64 * w64.sum(1, keepdim=True), du64.abs() * w64.abs().sum(1, keepdim=True)),
             (w.grad, (z64 * du64).sum(1, keepdim=True).expand(N, k),
              (z64 * du64).abs().sum(1, keepdim=True).expand(N, k)))
    for got, want, scale in cases:
        assert bool(((got.double() - want).abs() <= RTOL32 * scale).all()), backend


@triton_cpu
@pytest.mark.parametrize("row_tile", [1, 4])
def test_triton_grouped_weights(row_tile):
    """LocalTokenDispatcher.dispatch given the gate weights, on the Triton kernels: the rows are dispatch_rows'
    exactly; grouped_weights' row inverse[c] holds w[c], padding rows 0; one backward gives z the rows' gradient
    summed (as dispatch_rows' backward) and w the row weights' gathered (against an index_copy in float64)."""
    N, E, k, ell = 23, 6, 3, 8
    experts, _, _ = routing(N, E, k, seed=81)
    dispatcher = LocalTokenDispatcher(E)
    z, w = random_input((N, ell), 80).requires_grad_(), random_input((N, k), 82).requires_grad_()
    with triton_on_cpu():  # the Triton dispatch on CPU tensors too
        x, _, handle = dispatcher.dispatch(z, experts, row_tile, w)
        rows = x.shape[0]
        dx, dr = random_input((rows, ell), 84), random_input((rows,), 83)
        got = dispatcher.grouped_weights(handle)
        torch.autograd.backward((x, got), (dx, dr))
        x_alone = dispatch_rows(z, handle.order, handle.inverse, k, pad_rows=handle.pad_rows)
        dz_alone, = torch.autograd.grad(x_alone, z, dx)
    assert torch.equal(x, x_alone) and torch.equal(z.grad, dz_alone)
    w64 = w.detach().double().requires_grad_()
    want = w64.new_zeros(rows).index_copy(0, handle.inverse, w64.flatten())
    want.backward(dr.double())
    assert got.dtype == w.dtype and torch.equal(got.double(), want) and torch.equal(w.grad.double(), w64.grad)
    assert handle.pad_rows is None or (handle.pad_rows.numel() and not got[handle.pad_rows].any())
    assert LocalTokenDispatcher(E).grouped_weights(LocalTokenDispatcher(E).dispatch(z, experts, row_tile)[2]) is None


@triton_cpu
def test_triton_custom_op_registration():
    """k3::moe_dispatch_rows (with and without the rows' gate weights) and k3::moe_combine_rows: schema, fake
    shapes and autograd registration (what torch.compile relies on) agree with the kernels."""
    g = torch.Generator().manual_seed(8)
    n, k, ell = 7, 3, 24
    order = torch.randperm(n * k, generator=g).to(DEV)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n * k, device=DEV)
    z = torch.randn(n, ell, generator=g).to(DEV).requires_grad_()
    y = torch.randn(n * k, ell, generator=g).to(DEV).requires_grad_()
    w = torch.rand(n, k, generator=g).to(DEV).requires_grad_()
    torch.library.opcheck(torch.ops.k3.moe_dispatch_rows, (z, inverse, k))
    torch.library.opcheck(torch.ops.k3.moe_combine_rows, (y, w, inverse))
    torch.library.opcheck(torch.ops.k3.moe_combine_rows, (y, w.detach(), inverse))  # rows weighted before
    rows = torch.randperm(n * k + 5, generator=g).to(DEV)  # the padded layout: 5 rows hold no copy
    padded_inverse, pad_rows = rows[:n * k].contiguous(), rows[n * k:].contiguous()
    torch.library.opcheck(torch.ops.k3.moe_dispatch_rows, (z, padded_inverse, k, pad_rows))
    torch.library.opcheck(torch.ops.k3.moe_dispatch_rows, (z, inverse, k, None, w))  # with the rows' gate weights
    torch.library.opcheck(torch.ops.k3.moe_dispatch_rows, (z, padded_inverse, k, pad_rows, w))
    y_padded = torch.randn(n * k + 5, ell, generator=g).to(DEV).requires_grad_()
    torch.library.opcheck(torch.ops.k3.moe_combine_rows, (y_padded, w, padded_inverse, pad_rows))
    du = torch.randn(n, ell, generator=g).to(DEV)
    dy, = torch.autograd.grad(torch.ops.k3.moe_combine_rows(y, w.detach(), inverse), (y,), du)
    torch.testing.assert_close(dy, (w.detach()[:, :, None] * du[:, None, :]).reshape(n * k, ell)[order])


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
def test_gpu_bench_dims():
    """Bench dims (N = 16384, k = 8 of 128, ℓ = 512, bf16): auto picks Triton; both backends
    against an fp32 torch reference on the same bf16 inputs."""
    N, E, k, ell, bf16 = 16384, 128, 8, 512, torch.bfloat16
    _, order, inverse = routing(N, E, k, seed=70, device="cuda")
    z, y = random_input((N, ell), 71, bf16, "cuda"), random_input((N * k, ell), 72, bf16, "cuda")
    w = torch.rand(N, k, device="cuda").add_(0.01)
    dx, du = random_input((N * k, ell), 73, bf16, "cuda"), random_input((N, ell), 74, bf16, "cuda")

    def run(backend, f=lambda t: t):
        return _grads(lambda a: dispatch_rows(a, order, inverse, k, backend=backend),
                      lambda a, b: combine_rows(a, b, order, inverse, backend=backend),
                      *(f(t) for t in (z, y, w, dx, du)))

    fp32 = run("torch", lambda t: t.float())
    scales = run("torch", lambda t: t.float().abs())
    auto = run("auto")
    torch_bf16 = run("torch")
    assert type(auto[2].grad_fn).__name__.startswith("_CombineRows")
    assert torch.equal(auto[0], torch_bf16[0])
    for outs, what in ((auto, "triton"), (torch_bf16, "torch")):
        _assert_matches(outs, [r.double() for r in fp32], [s.double() for s in scales],
                        (bf16, bf16, bf16, bf16, torch.float32), rtol=1e-5, what=what)
