"""Quantile Balancing's histogram update: the Triton kernel against the torch reference (CPU: Triton
interpreter; GPU: the same tests on CUDA), and the reference against its definition in float64.

The counts are integers and the bins come from the same fp32 operations (IEEE division on both
sides), so kernel and reference must agree exactly, also for values placed on bin edges, outside
the grid (clamped) and NaN scores (bin 0).
"""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from k3train.model.quantile_balancing import QuantileBalancer
from kernels.qb_histogram import histogram_add
from kernels.qb_histogram import reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(37, 96, 64), (13, 896, 1000), (10, 128, 7), (9, 8, 5), (6, 3, 1)]  # N, E, B


def _inputs(n, e, b, seed):
    """Sigmoid scores [n, e], cutoffs [n] (a row's (k+1)-th largest score plus noise), and the grid
    QB builds for a bias in ±0.3: lo = b_min − 1, width = (b_max − b_min + 2) / B."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(n, e, generator=g) * 2)
    cutoff = scores.quantile(0.8, dim=1) + 0.05 * torch.randn(n, generator=g)
    bias = torch.empty(e).uniform_(-0.3, 0.3, generator=g)
    lo = bias.min() - 1.0
    width = (bias.max() - bias.min() + 2.0) / b
    return scores, cutoff, lo, width


def _float64_counts(scores, cutoff, lo, width, b):
    """counts[e, bin] of the definition, with the bins of fp32 r − lo over fp32 width computed in float64
    from the same fp32 values (the division rounded once to fp32, as IEEE division does)."""
    r = (cutoff.unsqueeze(1) - scores) - lo  # fp32, as the kernels compute it
    q = (r.double() / width.double()).float().double().floor().clamp(0, b - 1).long()
    counts = torch.zeros(scores.shape[1], b, dtype=torch.int32)
    for e in range(scores.shape[1]):
        counts[e] = torch.bincount(q[:, e], minlength=b)
    return counts


@pytest.mark.parametrize("n,e,b", SHAPES, ids=str)
def test_reference_matches_definition(n, e, b):
    scores, cutoff, lo, width = _inputs(n, e, b, e + b)
    counts = torch.zeros(e, b, dtype=torch.int32)
    R.histogram_add(counts, scores, cutoff, lo, width)
    assert torch.equal(counts, _float64_counts(scores, cutoff, lo, width, b))
    assert bool((counts.sum(1) == n).all()), "every token lands in one bin of every expert"


def test_balancer_observes_through_the_op():
    """QuantileBalancer's histogram is this op's counts (same grid), accumulated over micro-batches."""
    torch.manual_seed(0)
    qb = QuantileBalancer(16, 2, "histogram", bins=50)
    bias = torch.empty(16).uniform_(-0.2, 0.2)
    want = torch.zeros(16, 50, dtype=torch.int32)
    for _ in range(3):
        scores = torch.rand(11, 16)
        cutoff = scores.topk(3, dim=1).values[:, 2] + bias.max()
        qb.observe(scores, cutoff, bias)
        lo, width = bias.min() - 1.0, (bias.max() - bias.min() + 2.0) / 50
        R.histogram_add(want, scores, cutoff, lo, width)
    assert torch.equal(qb.counts, want)


def test_errors():
    scores, cutoff, lo, width = _inputs(4, 8, 5, 0)
    counts = torch.zeros(8, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        histogram_add(counts.long(), scores, cutoff, lo, width)
    with pytest.raises(ValueError, match=r"\[N, E\]"):
        histogram_add(counts, scores, cutoff[:3], lo, width)
    with pytest.raises(ValueError, match="float32"):
        histogram_add(counts, scores.double(), cutoff, lo, width)
    with pytest.raises(ValueError, match="backend"):
        histogram_add(counts, scores, cutoff, lo, width, backend="cuda")


def _both(scores, cutoff, lo, width, b):
    """(Triton counts, reference counts), each from zero."""
    got = torch.zeros(scores.shape[1], b, dtype=torch.int32, device=DEV)
    histogram_add(got, scores.to(DEV), cutoff.to(DEV), lo.to(DEV), width.to(DEV), backend="triton")
    want = torch.zeros(scores.shape[1], b, dtype=torch.int32)
    R.histogram_add(want, scores, cutoff, lo, width)
    return got.cpu(), want


@triton_cpu
@pytest.mark.parametrize("n,e,b", SHAPES, ids=str)
def test_triton_matches_reference(n, e, b):
    scores, cutoff, lo, width = _inputs(n, e, b, 7 * e + b)
    got, want = _both(scores, cutoff, lo, width, b)
    assert torch.equal(got, want)


@triton_cpu
def test_triton_edges_clamps_nan_strides_and_accumulation():
    """Scores placed exactly on bin edges, r below the grid and above it (clamped to the first and last
    bin), a NaN score (bin 0), scores as a strided view, and counts that already hold a histogram."""
    n, e, b = 12, 10, 8
    scores, cutoff, lo, width = _inputs(n, e, b, 3)
    edges = lo + width * torch.arange(b, dtype=torch.float32)
    scores[0, :8] = cutoff[0] - edges  # r = lo + j·width: on bin edge j (up to fp32 rounding, as torch)
    scores[1, 0], scores[1, 1] = cutoff[1] - lo + 5.0, cutoff[1] - lo - 50.0  # r below / above the grid
    scores[2, 3] = float("nan")
    wide = torch.zeros(n, 2 * e)
    wide[:, ::2] = scores
    got = torch.zeros(e, b, dtype=torch.int32, device=DEV)
    for view in (scores, wide[:, ::2]):  # twice: the second adds to the first
        histogram_add(got, view.to(DEV), cutoff.to(DEV), lo.to(DEV), width.to(DEV), backend="triton")
    want = torch.zeros(e, b, dtype=torch.int32)
    for _ in range(2):
        R.histogram_add(want, scores, cutoff, lo, width)
    assert torch.equal(got.cpu(), want)
    # counts are [expert, bin]: token 1's expert 0 below the grid, its expert 1 above it, token 2's NaN at expert 3
    assert int(want[0, 0]) >= 2 and int(want[1, b - 1]) >= 2 and int(want[3, 0]) >= 2


@triton_cpu
def test_triton_empty_batch_adds_nothing():
    got = torch.ones(4, 3, dtype=torch.int32, device=DEV)
    histogram_add(got, torch.empty(0, 4, device=DEV), torch.empty(0, device=DEV), torch.zeros((), device=DEV),
                  torch.ones((), device=DEV), backend="triton")
    assert bool((got == 1).all())


@triton_cpu
def test_triton_under_compile_is_the_custom_op():
    """Inside ``torch.compile`` the kernel runs as ``k3::qb_histogram_add`` (declared to mutate counts):
    the compiled counts equal the reference's, twice in a row (the second call adds), and opcheck
    passes (schema, fake impl, mutation)."""
    n, e, b = 21, 12, 9
    scores, cutoff, lo, width = _inputs(n, e, b, 5)
    args = [t.to(DEV) for t in (scores, cutoff, lo, width)]
    got = torch.zeros(e, b, dtype=torch.int32, device=DEV)
    compiled = torch.compile(lambda c, *a: histogram_add(c, *a, backend="triton"), fullgraph=True)
    compiled(got, *args)
    compiled(got, *args)
    want = torch.zeros(e, b, dtype=torch.int32)
    for _ in range(2):
        R.histogram_add(want, scores, cutoff, lo, width)
    assert torch.equal(got.cpu(), want)
    torch.library.opcheck(torch.ops.k3.qb_histogram_add.default,
                          (torch.zeros(e, b, dtype=torch.int32, device=DEV), *args),
                          test_utils=("test_schema", "test_faketensor"))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton_at_k3_shapes():
    """bench-1B (8192 tokens, E = 128) and K3 (E = 896), B = 1000 bins: the auto backend on CUDA."""
    for n, e in ((8192, 128), (8192, 896)):
        scores, cutoff, lo, width = _inputs(n, e, 1000, e)
        got = torch.zeros(e, 1000, dtype=torch.int32, device="cuda")
        histogram_add(got, scores.cuda(), cutoff.cuda(), lo.cuda(), width.cuda())
        want = torch.zeros(e, 1000, dtype=torch.int32)
        R.histogram_add(want, scores, cutoff, lo, width)
        assert torch.equal(got.cpu(), want)
