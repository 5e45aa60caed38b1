"""KDA state passing (kernels/kda/state_passing.py): the segment map S_out = M S_in + S_ext,
the fp32 chain, and the one-process CP forward/backward against the full-sequence
recurrence (fp32 and fp64, batches and packed documents that cross segments)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

try:
    import kernels.kda  # noqa: F401
except ImportError:  # the repo root is not on sys.path when the package is not installed
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from kernels.kda import kda_chunked, kda_recurrent  # noqa: E402
from kernels.kda.state_passing import (chain_states, kda_cp_simulate, segment_bounds,  # noqa: E402
                                       segment_transition, transition_recurrent)

F64 = torch.float64
PARAMS = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"]


def rand_inputs(B, T, H, K, V, *, N=None, dtype=F64, seed=0):
    """Random, never-zero inputs; dt_bias ~ -4 keeps per-token decay near e^-0.1, so that
    the state carried across a segment (M S_in) is not negligible.  A_log, dt_bias and
    the initial state stay fp32 (the kda contract)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen) * s + shift

    xs = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K, s=0.5), r(B, T, H, s=0.7)]
    xs = [x.to(dtype) for x in xs]
    A_log = torch.rand(H, generator=gen) * 0.6 - 0.3
    dt_bias = r(H * K, s=0.5, shift=-4.0)
    h0 = r(N if N is not None else B, H, K, V, s=0.5)
    return xs + [A_log, dt_bias, h0]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def forward(fn, xs, cu=None, use_h0=True, grad=False, with_final=True, **kw):
    """(o, final, grads dict or None) of fn on copies of xs; loss = <o, do> + <final, ds>
    (without the second term when not with_final)."""
    xs = [x.detach().clone().requires_grad_(grad) for x in xs]
    o, s = fn(*xs[:7], initial_state=xs[7] if use_h0 else None, output_final_state=True,
              cu_seqlens=cu, **kw)
    if not grad:
        return o, s, None
    gen = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=F64)).sum()
    if with_final:
        loss = loss + (s.double() * torch.randn(s.shape, generator=gen, dtype=F64)).sum()
    used = xs if use_h0 else xs[:7]
    return o, s, dict(zip(PARAMS, torch.autograd.grad(loss, used)))


def full64(xs, cu=None, use_h0=True, grad=False, with_final=True):
    def fn(*a, **kw):
        return kda_recurrent(*a, dtype=F64, **kw)
    return forward(fn, xs, cu, use_h0, grad, with_final)


def fp64_final(xs, cu=None, use_h0=True):
    """Per-document final states in fp64 (kda_recurrent rounds its final state to fp32):
    the token-by-token transition of each whole document applied to its initial state."""
    B, H, K, V = xs[0].shape[0], xs[0].shape[2], xs[0].shape[3], xs[2].shape[3]
    spans = [(b, 0, xs[0].shape[1]) for b in range(B)] if cu is None else \
        [(0, s, e) for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:])]
    out = []
    for n, (b, s, e) in enumerate(spans):
        M, S = transition_recurrent(*(x[b:b + 1, s:e] for x in xs[:5]), xs[5], xs[6], dtype=F64)
        h0 = xs[7][n].double() if use_h0 else torch.zeros(H, K, V, dtype=F64)
        out.append((M @ h0 + S)[0])
    return torch.stack(out)


# ------------------------------------------------------------------ (i) the segment map

@pytest.mark.parametrize("path", ["one_pass", "two_passes", "recurrent"])
def test_segment_map_matches_recurrence(path, monkeypatch):
    B, T, H, K, V = 2, 19, 2, 8, 6
    recurrent = path == "recurrent"
    if path == "two_passes":  # K + V above the kernels' V limit: M and S_ext separately
        import kernels.kda.state_passing as sp
        monkeypatch.setattr(sp, "MAX_V", K + V - 1)
    xs = rand_inputs(B, T, H, K, V, seed=1)
    S_in = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(3))
    M, S_ext = segment_transition(*xs[:7], recurrent=recurrent)
    assert M.shape == (B, H, K, K) and S_ext.shape == (B, H, K, V) and M.dtype == F64
    Mr, Sr = transition_recurrent(*xs[:7], dtype=F64)
    assert rel(M, Mr) < 1e-12 and rel(S_ext, Sr) < 1e-12
    # S_out = M S_in + S_ext is the recurrence run from S_in, for any S_in
    _, S_out, _ = full64(xs[:7] + [S_in])
    assert rel(M @ S_in.double() + S_ext, S_out) < 1e-6       # kda_recurrent rounds to fp32
    assert (M @ S_in.double()).norm() > 0.1 * S_ext.norm()     # the carried part matters
    # fp32 inputs: fp32 map, same numbers
    x32 = [x.float() for x in xs[:5]] + xs[5:7]
    M32, S32 = segment_transition(*x32, recurrent=recurrent)
    assert M32.dtype == torch.float32 and rel(M32, M) < 1e-5 and rel(S32, S_ext) < 1e-5


@pytest.mark.parametrize("recurrent", [False, True])
def test_segment_with_document_start_has_zero_map(recurrent):
    """A document starting inside the segment (or at its first token) cuts the state:
    M = 0 exactly and S_ext is the last document's state from its own initial state."""
    T, H, K, V = 17, 2, 8, 6
    xs = rand_inputs(1, T, H, K, V, N=3, seed=2)
    h_last = xs[7][2:3]
    for cu, starts in (([0, 6, 11, T], False), ([0, T], True), ([0, 4, T], True)):
        M, S_ext = segment_transition(*xs[:7], cu_seqlens=torch.tensor(cu), recurrent=recurrent,
                                      starts_document=starts, reset_state=h_last)
        assert torch.count_nonzero(M) == 0
        tail = [x[:, cu[-2]:] for x in xs[:5]] + xs[5:7]
        _, want, _ = full64(tail + [h_last])
        assert rel(S_ext, want) < 1e-6


# ------------------------------------------------------------------ (ii) CP forward, batch

SEGMENTS = [2, 3, 4, [5, 1, 17], [11, 12], [2, 9, 4, 8]]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("segments", SEGMENTS, ids=str)
def test_cp_forward_matches_full_sequence(dtype, segments):
    B, T, H, K, V = 2, 23, 2, 8, 6
    xs = rand_inputs(B, T, H, K, V, seed=4)
    xs = [x.to(dtype) for x in xs[:5]] + xs[5:]
    o, s, _ = forward(kda_cp_simulate, xs, segments=segments)
    o_ref, s_ref, _ = full64(xs)
    tol = 1e-10 if dtype == F64 else 1e-5
    assert o.dtype == dtype and s.dtype == (F64 if dtype == F64 else torch.float32)
    assert rel(o, o_ref) < tol, rel(o, o_ref)
    assert rel(s, fp64_final(xs) if dtype == F64 else s_ref) < tol
    # a rerun without the passed state would be visibly wrong
    last = segment_bounds(T, segments)[-1][0]
    o_cut, _ = kda_chunked(*(x[:, last:].contiguous() for x in xs[:5]), *xs[5:7])
    assert rel(o_cut, o_ref[:, last:]) > 1e-2


# ------------------------------------------------------------------ (iii) packed documents

CU = [0, 7, 10, 11, 25, 40]  # 5 documents; 25..40 crosses several segment boundaries
PACKED_SEGMENTS = [
    [13, 13, 14],        # documents start inside every segment
    [7, 3, 1, 14, 15],   # every segment starts with a document
    [4, 6, 18, 5, 7],    # segment [10, 28): starts a document, holds two more starts
    [26, 4, 3, 7],       # [26, 30), [30, 33), [33, 40): inside one document
]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("use_h0", [False, True])
@pytest.mark.parametrize("segments", PACKED_SEGMENTS, ids=str)
def test_cp_forward_packed_documents(dtype, use_h0, segments):
    H, K, V = 2, 8, 6
    xs = rand_inputs(1, CU[-1], H, K, V, N=len(CU) - 1, seed=5)
    xs = [x.to(dtype) for x in xs[:5]] + xs[5:]
    cu = torch.tensor(CU)
    o, s, _ = forward(kda_cp_simulate, xs, cu, use_h0, segments=segments)
    o_ref, s_ref, _ = full64(xs, cu, use_h0)
    tol = 1e-10 if dtype == F64 else 1e-5
    assert rel(o, o_ref) < tol, rel(o, o_ref)
    assert rel(s, fp64_final(xs, cu, use_h0) if dtype == F64 else s_ref) < tol


# ------------------------------------------------------------------ (iv) gradients

@pytest.mark.parametrize("case", ["batch", "packed", "packed_h0"])
def test_cp_gradients_match_full_sequence(case):
    H, K, V = 2, 8, 6
    if case == "batch":
        xs, cu, segs, use_h0 = rand_inputs(2, 21, H, K, V, seed=6), None, [6, 1, 9, 5], True
    else:
        xs, cu, segs = rand_inputs(1, 40, H, K, V, N=5, seed=7), torch.tensor(CU), [4, 6, 18, 5, 7]
        use_h0 = case == "packed_h0"
    # against the recurrence, through o only (kda_recurrent rounds its final state to fp32)
    o, _, g = forward(kda_cp_simulate, xs, cu, use_h0, grad=True, with_final=False,
                      segments=segs)
    o_ref, _, g_ref = full64(xs, cu, use_h0, grad=True, with_final=False)
    assert rel(o, o_ref) < 1e-10
    for n in g_ref:
        # A_log, dt_bias, h0 are fp32 leaves: their gradients are rounded to fp32
        tol = 1e-10 if n in PARAMS[:5] else 1e-6
        assert rel(g[n], g_ref[n]) < tol, (n, rel(g[n], g_ref[n]))
        assert g[n].norm() > 0, n
    # through o and the final states: against the recurrence at fp32, and against the
    # single-segment run (no state passing, all fp64) exactly
    _, _, g = forward(kda_cp_simulate, xs, cu, use_h0, grad=True, segments=segs)
    _, _, g_ref = full64(xs, cu, use_h0, grad=True)
    _, _, g_one = forward(kda_cp_simulate, xs, cu, use_h0, grad=True, segments=1)
    for n in g_ref:
        assert rel(g[n], g_ref[n]) < 1e-6, (n, rel(g[n], g_ref[n]))
        tol = 1e-10 if n in PARAMS[:5] else 1e-6
        assert rel(g[n], g_one[n]) < tol, (n, rel(g[n], g_one[n]))


# ------------------------------------------------------------------ (v) fp32 chain

def test_chain_is_fp32_for_bf16_inputs():
    B, T, H, K, V = 2, 24, 2, 8, 8
    xs = rand_inputs(B, T, H, K, V, dtype=torch.bfloat16, seed=8)
    M, S_ext = segment_transition(*(x[:, :12].contiguous() for x in xs[:5]), *xs[5:7])
    assert M.dtype == S_ext.dtype == torch.float32
    S_in = chain_states(torch.stack([M.bfloat16()]), torch.stack([S_ext.bfloat16()]))
    assert S_in.dtype == torch.float32
    o, s, _ = forward(kda_cp_simulate, xs, segments=[12, 5, 7])
    o_ref, s_ref = kda_chunked(*xs[:7], initial_state=xs[7], output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel(s, s_ref) < 1e-5                    # fp32 all the way: no bf16 rounding
    assert rel(o, o_ref) < 1e-2                    # o differs only by its bf16 rounding


def test_chain_states_prefix():
    C, B, H, K, V = 4, 2, 3, 5, 4
    gen = torch.Generator().manual_seed(9)
    M = torch.randn(C, B, H, K, K, generator=gen, dtype=F64)
    S_ext = torch.randn(C, B, H, K, V, generator=gen, dtype=F64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    S_in = chain_states(M, S_ext, S0)
    want = S0
    for c in range(C):
        assert torch.allclose(S_in[c], want, rtol=1e-12, atol=1e-12)
        want = torch.einsum("bhij,bhjv->bhiv", M[c], want) + S_ext[c]
    assert torch.equal(chain_states(M, S_ext)[1], S_ext[0])


def test_segment_bounds():
    assert segment_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert segment_bounds(5, [1, 4]) == [(0, 1), (1, 5)]
    for bad in (0, 6, [2, 2], [0, 5], []):
        with pytest.raises(ValueError):
            segment_bounds(5, bad)


# ------------------------------------------------------------------ Triton path (interpreter)

def test_cp_with_triton_op_interpreter():
    """The same CP run through the Triton kernels (M from the [0 | v] / [I | 0] pass at
    V + K columns), under TRITON_INTERPRET on CPU: forward and gradients."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter (CPU run)")
    from kernels.kda.chunk import kda_triton
    xs = rand_inputs(1, 40, 1, 16, 16, N=5, dtype=torch.float32, seed=10)
    cu = torch.tensor(CU)
    o, s, g = forward(kda_cp_simulate, xs, cu, True, grad=True, segments=[13, 13, 14],
                      op=kda_triton)
    o_ref, s_ref, g_ref = full64(xs, cu, True, grad=True)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5
    for n in g_ref:
        assert rel(g[n], g_ref[n]) < 1e-4, (n, rel(g[n], g_ref[n]))
