"""Block AttnRes aggregation: the reference's analytic backward against torch autograd, and the
Triton kernels against the reference (CPU: Triton interpreter; GPU: the same tests on CUDA).

Kernel results (fp32) are compared with the reference evaluated in float64 on the same inputs,
each tensor to within ``RTOL`` of its largest magnitude (dw, dγ: of the largest term of the
token sum), which is tens of fp32 ulps.
"""

from __future__ import annotations

import functools

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

import k3train.model.attn_res as model_attn_res
from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from kernels.attn_res import MAX_SOURCES, attn_res_aggregate, attn_res_rms_norm, attn_res_site
from kernels.attn_res import reference as R
from kernels.rms_norm import reference as rms_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 4e-6 if DEV == "cuda" else 2e-6  # GPU exp/rsqrt/div are approximate (a few ulp each)


def random_inputs(S: int, shape: tuple[int, ...], seed: int, dtype=torch.float64):
    """S sources with per-token scales spread over e^±2, w with logits of order 1..3 and
    γ in [0.5, 1.5): no zeros anywhere (the model's w starts at 0; this tests non-zero)."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    scale = lambda: torch.empty(*shape[:-1], 1).uniform_(-2, 2, generator=g).exp()  # noqa: E731
    sources = [torch.randn(shape, generator=g) * scale() for _ in range(S)]
    w = torch.randn(1, d, generator=g) * (3.0 / d**0.5)
    gain = torch.rand(d, generator=g) + 0.5
    go = torch.randn(shape, generator=g)
    assert all(bool((t != 0).all()) for t in [*sources, w, gain])
    return [t.to(dtype) for t in sources], w.to(dtype), gain.to(dtype), go.to(dtype)


def _leaves(ts, device=DEV, dtype=None):
    return [t.detach().to(device=device, dtype=dtype or t.dtype).requires_grad_() for t in ts]


def _fwd_bwd(fn, sources, w, gain, go):
    """out and the gradients of every source, w and γ of ``fn`` (fresh leaves)."""
    leaves = _leaves([*sources, w, gain])
    out = fn(leaves[:-2], leaves[-2], leaves[-1])
    out.backward(go.to(out))
    return out, [t.grad for t in leaves]


def _assert_near(x, ref, scale, what):
    """|x − ref| ≤ RTOL·scale elementwise (scale 0: exactly equal)."""
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    assert x.shape == ref.shape, (what, x.shape, ref.shape)
    err = float((x - ref).abs().max())
    assert err <= RTOL * scale, f"{what}: max err {err:.3g} > {RTOL:g}·{scale:.3g}"


def _check_against_reference(sources, w, gain, go, out, grads):
    """Kernel out and gradients (fp32) against the float64 reference."""
    S = len(sources)
    ref_dv, ref_dw, ref_dg = R.attn_res_backward(sources, w, gain, go)
    ref_out = R.attn_res_forward(sources, w, gain)
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    _assert_near(out, ref_out, float(ref_out.abs().max()), "out")
    for i in range(S):
        _assert_near(grads[i], ref_dv[i], float(ref_dv[i].abs().max()), f"dv[{i}]")
    # dq̃'s terms dl_i r_i v_i, summed over tokens: bound by the sum of their magnitudes
    V = torch.stack(sources)
    r = torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + R.RMS_EPS)
    qt = (w.view(-1) * gain)
    a = torch.softmax(r * (V * qt).sum(-1, keepdim=True), 0)
    c = (V * go).sum(-1, keepdim=True)
    dl = a * (c - (a * c).sum(0, keepdim=True))
    terms = (dl * r * V).abs().reshape(-1, V.shape[-1]).sum(0)
    _assert_near(grads[S], ref_dw, float((terms * gain).max()), "dw")
    _assert_near(grads[S + 1], ref_dg, float((terms * w.view(-1).abs()).max()), "dgain")
    if S == 1:  # one source: a = 1, the query gets no gradient
        assert not grads[S].any() and not grads[S + 1].any()


# ----------------------------------------------------------------------------------------------
# reference and torch backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("S", [1, 3, 9])
def test_reference_backward_matches_autograd(S):
    sources, w, gain, go = random_inputs(S, (2, 5, 24), seed=S)
    out, grads = _fwd_bwd(R.attn_res_forward, sources, w, gain, go)
    dv, dw, dg = R.attn_res_backward(sources, w, gain, go)
    for got, want in zip([*dv, dw, dg], grads):
        torch.testing.assert_close(got, want.cpu(), rtol=1e-12, atol=1e-12)
    assert out.dtype == torch.float64
    half = R.attn_res_forward([v.bfloat16() for v in sources], w.float(), gain.float())
    assert half.dtype == torch.bfloat16


def test_torch_backend_is_the_reference():
    sources, w, gain, _ = random_inputs(4, (3, 7, 16), seed=4, dtype=torch.float32)
    ref = R.attn_res_forward(sources, w, gain)
    nw = torch.rand(16) + 0.5
    for backend in ("torch", "auto"):
        assert torch.equal(attn_res_aggregate(sources, w, gain, backend=backend), ref)
        normed = attn_res_rms_norm(sources, w, gain, nw, 1e-6, torch.bfloat16, backend=backend)
        assert torch.equal(normed, rms_reference.rms_norm(ref, nw, 1e-6, torch.bfloat16))


def test_errors():
    x = torch.randn(2, 8)
    w, gain = torch.randn(1, 8), torch.rand(8)
    with pytest.raises(ValueError, match="unknown AttnRes backend"):
        attn_res_aggregate([x, x], w, gain, backend="cuda")
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        attn_res_aggregate([x, torch.randn(2, 9)], w, gain)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        attn_res_aggregate([x, x.double()], w, gain)
    with pytest.raises(ValueError, match="Triton AttnRes kernels take"):
        attn_res_aggregate([x.double()], w, gain, backend="triton")
    with pytest.raises(ValueError, match=f"at most {MAX_SOURCES} sources"):
        attn_res_aggregate([x] * (MAX_SOURCES + 1), w, gain, backend="triton")
    with pytest.raises(ValueError, match=r"norm weight \(9,\) must be \[8\]"):
        attn_res_rms_norm([x, x], w, gain, torch.ones(9), 1e-6)


# ----------------------------------------------------------------------------------------------
# Triton kernels against the reference
# ----------------------------------------------------------------------------------------------

@triton_cpu
@pytest.mark.parametrize("S, shape", [(1, (1, 7, 96)), (2, (2, 3, 1000)), (5, (13, 96)),
                                      (8, (1, 9, 96))])
def test_triton_kernels(S, shape):
    """Token counts off the row block of 4, d off the d chunk of 64 (96 = 1.5 chunks, 1000 =
    15.6)."""
    sources, w, gain, go = random_inputs(S, shape, seed=10 + S)
    kernel = functools.partial(attn_res_aggregate, backend="triton")
    out, grads = _fwd_bwd(kernel, _leaves(sources, dtype=torch.float32), w.float(), gain.float(), go)
    assert type(out.grad_fn).__name__.startswith("_AttnRes")
    assert out.shape == shape
    _check_against_reference(sources, w, gain, go, out, grads)


@triton_cpu
@pytest.mark.parametrize("S, shape, out_dtype", [(1, (1, 7, 96), torch.float32), (3, (2, 3, 1000), torch.bfloat16),
                                                 (8, (13, 96), torch.float32)])
def test_triton_kernels_with_the_norm(S, shape, out_dtype):
    """The site with its RMSNorm fused (y = RMSNorm(Agg)·w_n, Agg never stored) against the float64
    composition of the two references: y and the gradients of every source, w, γ and w_n."""
    _check_site_with_norm(S, shape, out_dtype, seed=20 + S)


@pytest.mark.skipif(DEV != "cuda", reason="on CPU the interpreter's split by d already runs the chunked kernels")
def test_chunked_kernels_on_gpu(monkeypatch):
    """On a GPU every bench width takes the row kernels; a 3-element tile forces the chunked ones (d = 1000 in
    64-wide chunks, 5 sources), which wider models (full K3, d = 7168) run: with the norm and without."""
    from kernels.attn_res import triton_attn_res as T
    monkeypatch.setattr(T, "GPU_TILE_OVERRIDE", (2, 4, 64))
    S, shape = 5, (2, 3, 1000)
    assert not T._launch(6, 1000, S, torch.empty(1, device="cuda"), backward=True)[2]
    sources, w, gain, go = random_inputs(S, shape, seed=30)
    kernel = functools.partial(attn_res_aggregate, backend="triton")
    out, grads = _fwd_bwd(kernel, _leaves(sources, dtype=torch.float32), w.float(), gain.float(), go)
    _check_against_reference(sources, w, gain, go, out, grads)
    _check_site_with_norm(S, shape, torch.float32, seed=31)


def _check_site_with_norm(S: int, shape: tuple[int, ...], out_dtype: torch.dtype, seed: int) -> None:
    """attn_res_rms_norm on the Triton path (fp32 sources, y in ``out_dtype``) against the torch path in float64."""
    sources, w, gain, go = random_inputs(S, shape, seed=seed)
    nw = torch.rand(shape[-1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    go = go.to(out_dtype).double()  # the kernel gets ∂L/∂y in y's dtype

    def site(sources_and_nw, w, gain, backend, out_dtype):
        return attn_res_rms_norm(sources_and_nw[:-1], w, gain, sources_and_nw[-1], 1e-6, out_dtype, backend=backend)

    want = _fwd_bwd(functools.partial(site, backend="torch", out_dtype=None), [*sources, nw], w, gain, go)
    got = _fwd_bwd(functools.partial(site, backend="triton", out_dtype=out_dtype),
                   _leaves([*sources, nw], dtype=torch.float32), w.float(), gain.float(), go)
    assert type(got[0].grad_fn).__name__.startswith("_AttnRes")
    assert got[0].dtype == out_dtype and all(g.dtype == torch.float32 for g in got[1])
    y_tol = 2.0**-7 if out_dtype == torch.bfloat16 else 4 * RTOL  # one bf16 rounding of y (the interpreter truncates)
    names = [f"dv[{i}]" for i in range(S)] + ["dw_n", "dw", "dgain"]
    for name, x, ref in zip(["y", *names], [got[0], *got[1]], [want[0], *want[1]]):
        scale = float(ref.abs().max())
        if name in ("dw", "dgain") and S == 1:  # one source: a = 1, the query gets no gradient
            assert not x.any(), name
            continue
        err = float((x.detach().cpu().double() - ref.detach().cpu()).abs().max())
        assert err <= (y_tol if name == "y" else 10 * RTOL) * scale, f"{name}: max err {err:.3g} of {scale:.3g}"


@triton_cpu
def test_triton_shapes_above_cover_both_kernel_families():
    """Under the interpreter d = 96 takes the row kernels and d = 1000 the chunked ones, so the kernel tests
    above run both (with and without the norm)."""
    from kernels.attn_res import triton_attn_res as T
    if DEV == "cuda":
        pytest.skip("the interpreter's split; on a GPU both shapes take the row kernels")
    x = torch.empty(1, 1)
    assert T._launch(7, 96, 2, x, backward=False)[2] and T._launch(7, 96, 2, x, backward=True)[2]
    assert not T._launch(7, 1000, 2, x, backward=False)[2] and not T._launch(7, 1000, 2, x, backward=True)[2]


@triton_cpu
def test_triton_model_equals_reference_path(monkeypatch):
    """k3_tiny (19 sites, up to 4 sources) forward and backward: the kernel against the torch path.
    Under the interpreter one program covers all 12 tokens (the edges are test_triton_kernels')."""
    from kernels.attn_res import triton_attn_res as T
    monkeypatch.setattr(T, "INTERPRET_BLOCKS", (16, 64))
    torch.manual_seed(0)
    model = K3Model(ModelConfig()).to(DEV)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res.proj"):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 512, (1, 12), device=DEV)
    labels = torch.randint(0, 512, (1, 12), device=DEV)

    def loss_and_grads():
        model.zero_grad()
        loss = model(tokens, labels=labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = loss_and_grads()
    calls = []

    def kernel(sources, query, gain, norm_weight, norm_eps, out_dtype, pass_through, residual=None):
        calls.append((len(sources), residual is not None))
        return attn_res_site(sources, query, gain, norm_weight, norm_eps, out_dtype, pass_through, backend="triton",
                             residual=residual)

    monkeypatch.setattr(model_attn_res, "attn_res_site", kernel)
    got, got_grads = loss_and_grads()
    cfg = ModelConfig()
    assert len(calls) == 2 * cfg.num_layers + 1 and max(n for n, _ in calls) == 4
    # the mlp site of every layer that writes no block adds its attention branch, the first site of every
    # layer after the first and the output site add the FFN output of the layer before
    mlp_sites = sum(i % cfg.attn_res_block_size != 0 for i in range(cfg.num_layers))
    assert sum(res for _, res in calls) == mlp_sites + cfg.num_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-9,
                                   msg=lambda m, n=n: f"{n}: {m}")


@triton_cpu
def test_triton_custom_op_registration():
    """k3::attn_res's and k3::attn_res_backward's schemas and fake shapes (what torch.compile relies on)
    agree with the kernels, here at 3 sources, without the norm and with it (bf16 out), the backward
    with an incoming gradient for two of the sources; and with a bf16 residual added to the last source."""
    sources, w, gain, go = random_inputs(3, (2, 5, 96), seed=4)
    sources = [v.float().to(DEV) for v in sources]
    qt = (w.view(-1) * gain).float().contiguous().to(DEV)  # on the sources' device
    nw = (torch.rand(96) + 0.5).to(DEV)
    residual = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    for norm, res in [((None, 0.0, None), None), ((nw, 1e-6, torch.bfloat16), None), ((nw, 1e-6, torch.bfloat16), residual)]:
        torch.library.opcheck(torch.ops.k3.attn_res, (qt, sources, *norm, res))
        out, r, a, last = torch.ops.k3.attn_res(qt, sources, *norm, res)
        mixed = sources if res is None else [*sources[:-1], last]
        grad_in = [None, sources[0] * 0.5, sources[2] + 1.0]
        torch.library.opcheck(torch.ops.k3.attn_res_backward,
                              (mixed, qt, go.to(out).contiguous(), r, a, norm[0], norm[1], grad_in,
                               None if res is None else res.dtype))


@triton_cpu
@pytest.mark.parametrize("S, shape, passed", [(3, (2, 5, 96), 3), (4, (13, 96), 1), (2, (3, 1000), 2)])
def test_passed_sources_carry_later_gradients(S, shape, passed):
    """attn_res_site with pass_through: a later use of the passed sources (here a second site and a
    product with fixed random tensors) sends its gradient into this site's backward, which adds it in
    the kernel. Every source's gradient equals the torch path's, where autograd sums the two."""
    sources, w, gain, go = random_inputs(S, shape, seed=40 + S)
    nw = torch.rand(shape[-1], generator=torch.Generator().manual_seed(S), dtype=torch.float64) + 0.5
    weights = [torch.randn(shape, generator=torch.Generator().manual_seed(50 + i), dtype=torch.float64)
               for i in range(S)]

    def use(sources_, w_, gain_, backend):
        y, kept = attn_res_site(sources_, w_, gain_, nw.to(sources_[0]), 1e-6, None, passed, backend=backend)
        assert len(kept) == passed and all(torch.equal(k, v) for k, v in zip(kept, sources_[S - passed:]))
        later = attn_res_rms_norm(sources_[:S - passed] + kept, w_ * 0.5, gain_, nw.to(sources_[0]), 1e-6,
                                  backend=backend)
        return y + later + sum(k * c.to(k) for k, c in zip(kept, weights[S - passed:]))

    want = _fwd_bwd(functools.partial(use, backend="torch"), sources, w, gain, go)
    got = _fwd_bwd(functools.partial(use, backend="triton"), _leaves(sources, dtype=torch.float32), w.float(),
                   gain.float(), go)
    for i, (x, ref) in enumerate(zip([got[0], *got[1]], [want[0], *want[1]])):
        scale = float(ref.abs().max())
        err = float((x.detach().cpu().double() - ref.detach().cpu()).abs().max())
        assert err <= 10 * RTOL * scale, f"tensor {i}: max err {err:.3g} of {scale:.3g}"


@triton_cpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_passed_sources_under_compile_sum_in_the_kernels(with_residual):
    """Two sites in a row, the second reading what the first passed on (and, with a residual, adding a
    branch to the last of them), compiled (AOT autograd): the gradients equal the eager ones, and the
    backward graph adds no source-shaped tensors (the sums happen inside the sites' backward kernels)."""
    from torch._dynamo.backends.common import aot_autograd

    sources, w, gain, _ = random_inputs(3, (2, 5, 96), seed=60)
    params = [t.float() for t in (w, gain, torch.rand(96, dtype=torch.float64) + 0.5)]
    g = torch.Generator().manual_seed(61)
    c1, c2, c3, branch = (torch.randn(2, 5, 96, generator=g).to(DEV) for _ in range(4))

    def two_sites(v0, v1, v2, w_, gain_, nw, b):  # each tensor read once: every sum is one the sites take
        y1, passed = attn_res_site([v0, v1, v2], w_, gain_, nw, 1e-6, None, 3, backend="triton")
        y2, (p2,) = attn_res_site(passed, w_ * 0.5, gain_, nw, 1e-6, None, 1, backend="triton",
                                  residual=b if with_residual else None)
        return (y1 * c1).sum() + (y2 * c2).sum() + (p2 * c3).sum()

    def grads(fn):
        leaves = _leaves([*[v.float() for v in sources], *params, branch.to(torch.bfloat16)])
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    backward_adds = []

    def record(gm, example_inputs):
        backward_adds.extend(n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor
                             and tuple(n.meta["val"].shape) == (2, 5, 96))
        return gm.forward

    want = grads(two_sites)
    torch._dynamo.reset()
    got = grads(torch.compile(two_sites, backend=aot_autograd(fw_compiler=lambda gm, _: gm.forward,
                                                              bw_compiler=record), fullgraph=True))
    for i, (x, ref) in enumerate(zip(got, want)):
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"grad {i}: {m}")
    assert backward_adds == [], [n.format_node() for n in backward_adds]


@triton_cpu
@pytest.mark.parametrize("S, shape", [(3, (2, 5, 96)), (1, (13, 96)), (2, (3, 1000))], ids=str)
def test_triton_residual_is_added_to_the_last_source(S, shape):
    """attn_res_site(..., residual=b): the last source is v_{S-1} + b (bf16 b, fp32 sources), formed by the
    kernel (rows of 96; the chunked path, d = 1000, adds first), passed on in place of v_{S-1}. The sum
    equals torch's exactly; the output, and every gradient (b's included, with a later reader of the sum
    sending one into the site), equal the torch path's."""
    sources, w, gain, _ = random_inputs(S, shape, seed=70 + S)
    g = torch.Generator().manual_seed(80 + S)
    nw = torch.rand(shape[-1], generator=g) + 0.5
    residual = torch.randn(shape, generator=g).to(torch.bfloat16)
    c1, c2 = (torch.randn(shape, generator=g).to(DEV) for _ in range(2))

    def run(backend):
        *vs, wl, gl, rl = _leaves([*[v.float() for v in sources], w.float(), gain.float(), residual])
        y, passed = attn_res_site(vs, wl, gl, nw.to(DEV), 1e-6, None, 1, backend=backend, residual=rl)
        ((y * c1).sum() + (passed[-1] * c2).sum()).backward()
        return y, passed[-1], [t.grad for t in (*vs, wl, gl, rl)]

    y_ref, p_ref, grads_ref = run("torch")
    y, p, grads = run("triton")
    assert torch.equal(p, p_ref) and p.dtype == torch.float32
    _assert_near(y, y_ref, float(y_ref.abs().max()), "y")
    names = [*(f"dv{i}" for i in range(S)), "dw", "dgain", "dres"]
    for name, got, want in zip(names, grads, grads_ref):
        assert got.dtype == want.dtype, name
        if name == "dres":  # bf16: the same fp32 value rounded once either way
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6 * float(want.abs().max()))
        else:
            _assert_near(got, want, float(want.abs().max()), name)


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)
