"""SiTU-GLU: the reference against torch autograd of ``k3train.model.mlp.situ_glu``, and the
Triton kernels against the reference (CPU: Triton interpreter; GPU: the same tests on CUDA).

Gradient tolerances scale with the sum of the magnitudes of the terms (∂/∂a has a zero near
a ≈ −1.2 where its two terms cancel), and against autograd also with an ulp of 1 in each
factor: autograd forms sech² as 1 − tanh² and σ' as σ(1 − σ), which lose their relative
accuracy where tanh and σ saturate.
"""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from k3train.model.mlp import situ_glu as mlp_situ_glu
from kernels.situ import reference as R
from kernels.situ import situ_glu, situ_glu_interleaved
from kernels.situ.triton_situ import HALF_RTOL

BETA, LIN = 4.0, 25.0
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 agreement with the reference. GPU exp/div are approximate (a few ulp each; not measured).
RTOL32 = 1e-5 if DEV == "cuda" else 1e-6
# Half-precision outputs: the kernels' shorter tanh keeps HALF_RTOL of each term before the store rounds.
RTOL = {torch.float32: RTOL32, torch.bfloat16: HALF_RTOL, torch.float16: HALF_RTOL}
# Rounding of a half-precision store, relative: RNE is within half an ulp (2^-8 bf16, 2^-11
# fp16); the interpreter truncates fp32 -> bf16 (within one ulp).
ROUND = {torch.float32: 0.0, torch.float16: 2.0**-11,
         torch.bfloat16: 2.0**-8 if DEV == "cuda" else 2.0**-7}
TINY = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 2.0**-24}  # underflow
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_input(shape, seed, dtype=torch.float32) -> torch.Tensor:
    """Normal values with magnitudes spread over ~e^±7 and one in seven at ±60 (saturation);
    never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.empty(shape).uniform_(-7, 4, generator=g).exp()
    flat = x.view(-1)
    flat[::7], flat[3::7] = 60.0, -60.0
    assert bool((x != 0).all())
    return x.to(dtype)


def _scales(a, c, go):
    """float64 magnitudes of |SiTU|, of the terms of dgate and dup (for the tolerances), and
    the same for the autograd comparison (an ulp of 1 in sech² and σ')."""
    a, c, go = a.double(), c.double(), go.double()
    ta, tc, sa, sna = torch.tanh(a / BETA), torch.tanh(c / LIN), torch.sigmoid(a), torch.sigmoid(-a)
    g, h = (BETA * ta * sa).abs(), (LIN * tc).abs()
    dgate = go.abs() * h * sa * (torch.cosh(a / BETA) ** -2 + BETA * ta.abs() * sna)
    dup = go.abs() * g * torch.cosh(c / LIN) ** -2
    autograd = (go.abs() * h * sa * (1 + BETA * ta.abs()), go.abs() * g)
    return g * h, dgate, dup, autograd


def _assert_near(x, ref, scale, round_rel=0.0, rtol=1e-6, tiny=1e-30, what=""):
    """|x − ref| ≤ round_rel·|ref| + rtol·scale + tiny, elementwise."""
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    assert x.shape == ref.shape, (what, x.shape, ref.shape)
    err = (x - ref).abs()
    bound = round_rel * ref.abs() + rtol * scale.cpu() + tiny
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{bad.numel()} off, worst err/bound "
                           f"{float((err / bound).max()):.3g}")


def _inputs(M, I, seed, dtype):
    gate_up = random_input((M, 2 * I), seed, dtype)
    go = random_input((M, I), seed + 1, dtype)
    return gate_up, go


def _interleave(gate, up):
    """[..., I] and [..., I] → [..., 2I] with columns (gate_0, up_0, gate_1, up_1, ...)."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _check_against_reference(gate, up, go, out, dgate, dup):
    """Kernel results (in the inputs' dtype) against the fp32 reference on the same inputs."""
    dt = gate.dtype
    assert out.dtype == dgate.dtype == dup.dtype == dt
    s_out, s_dg, s_du, _ = _scales(gate, up, go)
    ref_dg, ref_du = R.situ_backward(gate.cpu(), up.cpu(), go.cpu(), BETA, LIN)
    ref_out = R.situ_forward(gate.float().cpu(), up.float().cpu(), BETA, LIN)
    kw = dict(round_rel=ROUND[dt], rtol=RTOL[dt], tiny=TINY[dt])
    _assert_near(out, ref_out, s_out, what="out", **kw)
    _assert_near(dgate, ref_dg, s_dg, what="dgate", **kw)
    _assert_near(dup, ref_du, s_du, what="dup", **kw)


# ----------------------------------------------------------------------------------------------
# reference and torch backend
# ----------------------------------------------------------------------------------------------

def test_reference_matches_mlp_autograd():
    gate_up, go = _inputs(64, 96, seed=1, dtype=torch.float32)
    a = gate_up[:, :96].clone().requires_grad_()
    c = gate_up[:, 96:].clone().requires_grad_()
    y = mlp_situ_glu(a, c, BETA, LIN)
    y.backward(go)
    assert torch.equal(R.situ_forward(a, c, BETA, LIN), y)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(R.situ_forward(a.to(dt), c.to(dt)), mlp_situ_glu(a.to(dt), c.to(dt)))
    dg, du = R.situ_backward(a, c, go, BETA, LIN)
    _, _, _, (s_dg, s_du) = _scales(a, c, go)
    _assert_near(dg, a.grad, s_dg, what="dgate")
    _assert_near(du, c.grad, s_du, what="dup")


def test_torch_backend_is_the_reference():
    """situ_glu_interleaved pairs column 2j (gate) with 2j + 1 (up); its gradient keeps that layout."""
    gate_up, go = _inputs(5, 24, seed=2, dtype=torch.bfloat16)
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    ref = mlp_situ_glu(gate, up)
    assert not torch.equal(ref, mlp_situ_glu(gate_up[:, :24], gate_up[:, 24:]))  # the layout matters
    for backend in ("torch", "auto"):
        assert torch.equal(situ_glu(gate, up, backend=backend), ref)
        pairs = situ_glu_interleaved(gate_up.view(5, 1, 48), backend=backend)
        assert torch.equal(pairs, ref.view(5, 1, 24))
    leaf = gate_up.float().requires_grad_()
    situ_glu_interleaved(leaf, backend="torch").backward(go.float())
    a, c = gate.float().requires_grad_(), up.float().requires_grad_()
    mlp_situ_glu(a, c).backward(go.float())
    assert leaf.grad.shape == (5, 48) and bool(leaf.grad.abs().sum() > 0)
    _, _, _, (s_dg, s_du) = _scales(gate, up, go)  # strided and contiguous CPU loops differ in the last ulp
    _assert_near(leaf.grad, _interleave(a.grad, c.grad), _interleave(s_dg, s_du), what="d gate_up")


def test_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown SiTU backend"):
        situ_glu(x, x, backend="cuda")
    with pytest.raises(ValueError, match="one shape and dtype"):
        situ_glu(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="one shape and dtype"):
        situ_glu(x, x.bfloat16())
    with pytest.raises(ValueError, match="even last dim"):
        situ_glu_interleaved(torch.randn(4, 7))
    with pytest.raises(ValueError, match="Triton SiTU kernels take"):
        situ_glu(x.double(), x.double(), backend="triton")


# ----------------------------------------------------------------------------------------------
# Triton kernels against the reference
# ----------------------------------------------------------------------------------------------

@triton_cpu
@pytest.mark.parametrize("layout", ["contiguous", "halves", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_triton_kernels(dtype, layout):
    """Odd M and I (several row and column blocks, masked edges); gate/up contiguous, the halves of a
    [M, 2I] tensor (row stride 2I) or its columns 0::2 and 1::2 (column stride 2), the gradients
    written in the same layout (separate tensors or one [M, 2I] buffer)."""
    from kernels.situ import triton_situ as T
    M, I = 37, 77
    gate_up, go = _inputs(M, I, seed=10, dtype=dtype)
    gate_up, go = gate_up.to(DEV), go.to(DEV)
    d = torch.full_like(gate_up, float("nan"))  # every element must be written
    if layout == "interleaved":
        (gate, up), (dgate, dup) = (gate_up[:, 0::2], gate_up[:, 1::2]), (d[:, 0::2], d[:, 1::2])
    else:
        (gate, up), (dgate, dup) = (gate_up[:, :I], gate_up[:, I:]), (d[:, :I], d[:, I:])
    if layout == "contiguous":
        gate, up = gate.contiguous(), up.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    out = T.situ_forward(gate, up, BETA, LIN)
    T.situ_backward(gate, up, go, dgate, dup, BETA, LIN)
    assert out.shape == (M, I) and out.is_contiguous()
    _check_against_reference(gate, up, go, out, dgate, dup)


@triton_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_autograd(dtype):
    """situ_glu on [B, T, I] and situ_glu_interleaved on [B, T, 2I] (the same gate and up, interleaved):
    same values and gradients, against the reference and (fp32) against autograd of the model's torch
    definition."""
    B, Tn, I = 2, 19, 45
    gate_up, go = _inputs(B * Tn, I, seed=20, dtype=dtype)
    gate_up, go = gate_up.view(B, Tn, 2 * I).to(DEV), go.view(B, Tn, I).to(DEV)
    a = gate_up[..., :I].clone().requires_grad_()
    c = gate_up[..., I:].clone().requires_grad_()
    gu = _interleave(a.detach(), c.detach()).requires_grad_()
    y = situ_glu(a, c, BETA, LIN, backend="triton")
    yp = situ_glu_interleaved(gu, BETA, LIN, backend="triton")
    y.backward(go)
    yp.backward(go)
    assert y.shape == yp.shape == (B, Tn, I) and gu.grad.shape == (B, Tn, 2 * I)
    assert torch.equal(y, yp)
    assert torch.equal(gu.grad, _interleave(a.grad, c.grad))
    _check_against_reference(a.detach(), c.detach(), go, y, a.grad, c.grad)
    if dtype == torch.float32:
        a2, c2 = a.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
        y2 = mlp_situ_glu(a2, c2, BETA, LIN)
        y2.backward(go)
        s_out, _, _, (s_dg, s_du) = _scales(a2, c2, go)
        _assert_near(y, y2, s_out, rtol=RTOL32, what="out vs mlp")
        _assert_near(a.grad, a2.grad, s_dg, rtol=RTOL32, what="dgate vs autograd")
        _assert_near(c.grad, c2.grad, s_du, rtol=RTOL32, what="dup vs autograd")


@triton_cpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_row_scale(backend, dtype):
    """situ_glu_interleaved(gate_up, row_scale=s) = s · SiTU row by row: the output and gate_up's gradient are the
    reference's with grad_out scaled by s, and ds = Σ_I grad_out · SiTU (I = 45: several column blocks on the
    interpreter, so ds sums partials), each within the tolerances above scaled by |s|."""
    R_, I = 23, 45
    gate_up, go = _inputs(R_, I, seed=40, dtype=dtype)
    gate_up, go = gate_up.view(R_, 2 * I).to(DEV).requires_grad_(), go.view(R_, I).to(DEV)
    scale = random_input((R_,), seed=41).to(DEV).requires_grad_()
    y = situ_glu_interleaved(gate_up, BETA, LIN, backend=backend, row_scale=scale)
    y.backward(go)
    a, c, s = gate_up.detach()[:, 0::2], gate_up.detach()[:, 1::2], scale.detach()[:, None].double()
    kw = dict(round_rel=ROUND[dtype], rtol=RTOL[dtype], tiny=TINY[dtype])
    s_out, _, _, _ = _scales(a, c, go)
    situ = R.situ_forward(a.double().cpu(), c.double().cpu(), BETA, LIN)
    _assert_near(y, s.cpu() * situ, s.abs().cpu() * s_out.cpu(), what="out", **kw)
    go_s = (go.double() * s).float()  # the kernel scales grad_out in fp32
    _, s_dg, s_du, by_autograd = _scales(a, c, go_s)
    if backend == "torch":  # autograd's own formula: an ulp of 1 in sech² and σ' (as in the tests above)
        s_dg, s_du = by_autograd
    ref_dg, ref_du = R.situ_backward(a.cpu(), c.cpu(), go_s.cpu(), BETA, LIN)
    _assert_near(gate_up.grad[:, 0::2], ref_dg, s_dg, what="dgate", **kw)
    _assert_near(gate_up.grad[:, 1::2], ref_du, s_du, what="dup", **kw)
    ds = (go.double().cpu() * situ).sum(1)
    _assert_near(scale.grad, ds, (go.double().abs().cpu() * s_out.cpu()).sum(1), rtol=RTOL[dtype], what="ds")
    assert scale.grad.dtype == scale.dtype and scale.grad.abs().max() > 0
    with pytest.raises(ValueError, match="row_scale must be"):
        situ_glu_interleaved(gate_up, backend=backend, row_scale=scale[:-1])


@triton_cpu
def test_triton_empty_and_noncontiguous():
    for shape in [(0, 16), (2, 0, 16), (3, 0)]:
        x = torch.randn(*shape[:-1], 2 * shape[-1], device=DEV, requires_grad=True)
        y = situ_glu_interleaved(x, backend="triton")
        y.sum().backward()
        assert y.shape == shape and x.grad.shape == x.shape
    # transposed inputs (last dim strided: copied) and an expanded grad_out (row stride 0)
    gate_up, _ = _inputs(40, 24, seed=30, dtype=torch.float32)
    a = gate_up[:, :24].t().to(DEV).requires_grad_()
    c = gate_up[:, 24:].t().to(DEV).requires_grad_()
    go = random_input((1, 40), seed=31).to(DEV).expand(24, 40)
    y = situ_glu(a, c, backend="triton")
    y.backward(go)
    _check_against_reference(a.detach(), c.detach(), go, y, a.grad, c.grad)
    gu = _interleave(a.detach(), c.detach()).t().contiguous().t().requires_grad_()  # [24, 80], column stride 24
    yi = situ_glu_interleaved(gu, backend="triton")
    yi.backward(go)
    assert torch.equal(yi, y) and torch.equal(gu.grad, _interleave(a.grad, c.grad))


@triton_cpu
def test_triton_kernels_refuse_other_layouts():
    """The kernels read two views with contiguous last dims or interleaved pairs, nothing else."""
    from kernels.situ import triton_situ as T
    x, go = (t.to(DEV) for t in _inputs(6, 8, seed=60, dtype=torch.float32))
    d = torch.empty_like(x)
    with pytest.raises(ValueError, match="columns 0::2 and 1::2"):
        T.situ_forward(x[:, 0::2], x[:, 0::2], BETA, LIN)  # strided, but not one tensor's pairs
    with pytest.raises(ValueError, match="laid out as gate, up"):
        T.situ_backward(x[:, 0::2], x[:, 1::2], go, d[:, :8], d[:, 8:], BETA, LIN)


@triton_cpu
def test_triton_interleaved_reads_and_writes_in_place(monkeypatch):
    """The interleaved op hands the kernels column-strided views of gate_up and of its gradient's buffer
    (column stride 2), never copies of the two column sets."""
    from kernels.situ import triton_situ as T
    seen = []

    def spy(kernel):
        def call(*args, **kw):
            seen.append([(t.data_ptr(), t.stride()) for t in args if torch.is_tensor(t) and t.ndim == 2])
            return kernel(*args, **kw)
        return call

    monkeypatch.setattr(T, "situ_forward", spy(T.situ_forward))
    monkeypatch.setattr(T, "situ_backward", spy(T.situ_backward))
    M, I = 9, 20
    gate_up, go = _inputs(M, I, seed=50, dtype=torch.float32)
    gate_up = gate_up.to(DEV).requires_grad_()
    situ_glu_interleaved(gate_up, backend="triton").backward(go.to(DEV))
    forward, backward = seen
    ptr, size = gate_up.data_ptr(), gate_up.element_size()
    assert forward == [(ptr, (2 * I, 2)), (ptr + size, (2 * I, 2))]
    (g, u, _, (dg_ptr, dg_stride), (du_ptr, du_stride)) = backward
    assert (g, u) == tuple(forward) and dg_stride == du_stride == (2 * I, 2) and du_ptr == dg_ptr + size


@triton_cpu
def test_triton_custom_op_registration():
    """k3::situ_glu and k3::situ_glu_interleaved: schema, fake shapes and autograd registration (what
    torch.compile relies on) agree with the kernels."""
    gate, up = (random_input((3, 5, 24), seed=s).to(DEV).requires_grad_() for s in (6, 7))
    torch.library.opcheck(torch.ops.k3.situ_glu, (gate, up, BETA, LIN))
    gate_up = _interleave(gate, up).detach().requires_grad_()
    torch.library.opcheck(torch.ops.k3.situ_glu_interleaved, (gate_up, BETA, LIN))
    torch.library.opcheck(torch.ops.k3.situ_glu_interleaved, (gate_up, BETA, LIN, random_input((3, 5), seed=8)
                                                              .to(DEV).requires_grad_()))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton():
    gate_up, go = _inputs(4096, 1536, seed=40, dtype=torch.bfloat16)
    gu = gate_up.cuda().requires_grad_()
    y = situ_glu_interleaved(gu)  # auto -> Triton on CUDA
    assert type(y.grad_fn).__name__.startswith("_SiTUGLUInterleaved")
    y.backward(go.cuda())
    _check_against_reference(gu[:, 0::2].detach(), gu[:, 1::2].detach(), go.cuda(), y,
                             gu.grad[:, 0::2], gu.grad[:, 1::2])
