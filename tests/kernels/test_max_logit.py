"""Per-head maximum attention logit: the Triton kernel against the torch reference on random q and k
(CPU: Triton interpreter; GPU: CUDA), over packed documents, one document a row, a context-parallel
style shard (query positions not 0..Tq−1) and ragged lengths; the reference against a dense float64
computation. The kernel accumulates the same exact fp32 products in another order: within a few fp32 ulp
of the logit's magnitude."""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from kernels.max_logit import feature_pieces, max_logit
from kernels.max_logit import reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _doc_ids(lengths, device=DEV) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths]).to(device)


def _qk(B, H, Tq, Tk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g).to(dtype).to(DEV).transpose(1, 2)  # strided, as MLA passes them
    k = torch.randn(B, Tk, H, D, generator=g).to(dtype).to(DEV).transpose(1, 2)
    return q, k


def _dense64(q, k, q_doc, k_doc, q_pos, scale):
    s = torch.einsum("bhqd,bhkd->bhqk", q.double().cpu(), k.double().cpu()) * scale
    ok = (torch.arange(k.shape[2])[None, :] <= q_pos.cpu()[:, None]) & (q_doc.cpu()[:, :, None] == k_doc.cpu()[:, None, :])
    return s.masked_fill(~ok.unsqueeze(1), float("-inf")).amax(dim=(0, 2, 3))


CASES = {
    "packed": (([70, 1, 100, 29], [200]), None),
    "one_per_row": (([133], [133]), None),
    "shard": (([90, 110], [200]), torch.cat([torch.arange(0, 50), torch.arange(150, 200)])),  # zigzag halves
}


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_dense_float64(case):
    lengths, shard = CASES[case]
    k_doc = _doc_ids(lengths, "cpu")
    q_pos = torch.arange(k_doc.shape[1]) if shard is None else shard
    q_doc = k_doc[:, q_pos]
    q, k = _qk(len(lengths), 3, q_pos.numel(), k_doc.shape[1], 48, torch.float32, 1)
    got = R.max_logit(q.cpu(), k.cpu(), q_doc, k_doc, q_pos, 0.125)
    torch.testing.assert_close(got.double(), _dense64(q, k, q_doc, k_doc, q_pos, 0.125), rtol=1e-5, atol=1e-5)


@triton_cpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, D", [(torch.float32, 48), (torch.bfloat16, 192), (torch.float32, 112)])
def test_triton_equals_reference(case, dtype, D):
    lengths, shard = CASES[case]
    k_doc = _doc_ids(lengths)
    q_pos = torch.arange(k_doc.shape[1], device=DEV) if shard is None else shard.to(DEV)
    q_doc = k_doc[:, q_pos]
    q, k = _qk(len(lengths), 2, q_pos.numel(), k_doc.shape[1], D, dtype, 2 + D)
    k[:, :, -1] = 10 * q[:, :, 0]  # the largest logit of all pairs, not allowed: the last key is after query 0
    got = max_logit(q, k, q_doc, k_doc, q_pos, D ** -0.5, backend="triton")
    want = max_logit(q, k, q_doc, k_doc, q_pos, D ** -0.5, backend="torch")
    assert got.dtype == torch.float32 and got.shape == (2,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the mask matters: the maximum over every pair is larger
    everything = max_logit(q, k, torch.zeros_like(q_doc), torch.zeros_like(k_doc),
                           torch.full_like(q_pos, k_doc.shape[1] - 1), D ** -0.5, backend="torch")
    assert (everything > want).all()


@triton_cpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_head_mask_computes_only_the_selected_heads(backend):
    """``heads``: the selected heads' maxima as without a mask, −inf for the others (whose programs read
    no key in the kernel)."""
    k_doc = _doc_ids(([70, 1, 100, 29],))
    q_pos = torch.arange(200, device=DEV)
    q, k = _qk(1, 4, 200, 200, 192, torch.bfloat16, 5)
    heads = torch.tensor([True, False, False, True], device=DEV)
    got = max_logit(q, k, k_doc, k_doc, q_pos, 0.1, heads=heads, backend=backend)
    want = max_logit(q, k, k_doc, k_doc, q_pos, 0.1, backend="torch")
    torch.testing.assert_close(got[heads], want[heads], rtol=1e-5, atol=1e-5)
    assert bool((got[~heads] == float("-inf")).all()) and bool(torch.isfinite(want).all())
    none = max_logit(q, k, k_doc, k_doc, q_pos, 0.1, heads=torch.zeros_like(heads), backend=backend)
    assert bool((none == float("-inf")).all())


@triton_cpu
def test_triton_custom_op_passes_opcheck_and_compiles():
    k_doc = _doc_ids(([40, 24],))
    q_pos = torch.arange(64, device=DEV)
    q, k = _qk(1, 2, 64, 64, 32, torch.float32, 3)
    q, k = q.contiguous(), k.contiguous()
    torch.library.opcheck(torch.ops.k3.max_logit, (q, k, k_doc, k_doc, q_pos, 0.2, None))
    heads = torch.tensor([True, False], device=DEV)
    torch.library.opcheck(torch.ops.k3.max_logit, (q, k, k_doc, k_doc, q_pos, 0.2, heads))
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: max_logit(*a, 0.2, backend="triton"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(q, k, k_doc, k_doc, q_pos), max_logit(q, k, k_doc, k_doc, q_pos, 0.2, backend="torch"),
                               rtol=1e-5, atol=1e-5)


def test_feature_pieces_cut_the_head_dim_into_the_kernels_dots():
    assert feature_pieces(192) == (128, 64, 0) and feature_pieces(112) == (64, 32, 16) and feature_pieces(16) == (16, 0, 0)
    assert feature_pieces(240) is None and feature_pieces(40) is None and feature_pieces(0) is None


def test_errors():
    q = torch.zeros(1, 2, 8, 16)
    doc, pos = torch.zeros(1, 8, dtype=torch.long), torch.arange(8)
    with pytest.raises(ValueError, match="must be \\[B, H, Tk, D\\]"):
        max_logit(q, torch.zeros(1, 3, 8, 16), doc, doc, pos, 1.0)
    with pytest.raises(ValueError, match="q_doc"):
        max_logit(q, q, doc[:, :4], doc, pos, 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        max_logit(q, q.double(), doc, doc, pos, 1.0)
    with pytest.raises(ValueError, match="heads must be a bool mask \\[2\\]"):
        max_logit(q, q, doc, doc, pos, 1.0, heads=torch.ones(3, dtype=torch.bool))


def test_triton_cpu_subprocess():
    rerun_under_interpreter(__file__)
