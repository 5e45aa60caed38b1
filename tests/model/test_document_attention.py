"""MLA's attention over packed documents on CPU (``k3train/model/document_attention.py``): the ways a CPU can
run forward. FlexAttention has no CPU backward; the GPU tests (tests/gpu/test_document_attention_gpu.py)
cover gradients and the CUDA-only ways."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

from k3train.model import document_attention
from k3train.model.document_attention import allowed, attend, document_block_mask
from k3train.model.documents import Documents

B, H, T, DQK, DV = 2, 2, 256, 48, 32


def _docs(lengths) -> Documents:
    return Documents.from_position_ids(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]))


def _dense(docs: Documents) -> torch.Tensor:
    return allowed(docs.doc_ids, docs.doc_ids, torch.arange(T)).unsqueeze(1)


def test_each_way_equals_sdpa_with_the_dense_mask(monkeypatch):
    """Causal SDPA for one document a row, the block mask, and every ``DOCUMENT_ATTENTION`` (SDPA with the
    mask on CPU) give what the dense mask gives."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, T, DQK, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g)
    for lengths in (([T], [T]), ([100, 1, 155], [T - 9, 9])):
        docs = _docs(lengths)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=_dense(docs), scale=DQK ** -0.5)
        with torch.no_grad():
            flex = attend(q, k, v, DQK ** -0.5, dataclasses.replace(docs, block_mask=document_block_mask(docs.doc_ids)),
                          lambda: None)
        torch.testing.assert_close(flex, want, rtol=1e-4, atol=1e-5)
        for way in document_attention.WAYS:
            monkeypatch.setattr(document_attention, "DOCUMENT_ATTENTION", way)
            got = attend(q, k, v, DQK ** -0.5, docs, lambda: _dense(docs))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_new_batch_block_mask_does_not_recompile():
    """A compiled function attending through one micro-batch's block mask, then other batches' (a new
    mask function over new document ids each time): dynamo compiles it once. (The trainer's compiled
    bench-1B run with FlexAttention recompiled; this rules out the per-batch mask function.)"""
    torch._dynamo.reset()
    compiles = CompileCounter()
    fn = torch.compile(lambda q, k, v, docs: attend(q, k, v, DQK ** -0.5, docs, lambda: None), backend=compiles)
    g = torch.Generator().manual_seed(1)
    for lengths in (([100, 156], [T]), ([50, 206], [128, 128]), ([T], [10, 246])):
        docs = _docs(lengths)
        docs = dataclasses.replace(docs, block_mask=document_block_mask(docs.doc_ids))
        q, k = (torch.randn(B, H, T, DQK, generator=g) for _ in range(2))
        v = torch.randn(B, H, T, DV, generator=g)
        with torch.no_grad():
            got = fn(q, k, v, docs)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=_dense(docs), scale=DQK ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert compiles.frame_count == 1, compiles.frame_count


def test_lse_head_max_reads_each_kernels_layout_and_never_under_bounds():
    """[H, tokens] (flash varlen) and [B, H, T(, 1)] (cuDNN) both reduce to each head's maximum; a NaN
    entry makes that head's bound +inf (no bound), not NaN, which would compare false against τ."""
    lse = torch.randn(B, H, T)
    want = lse.amax(dim=(0, 2))
    torch.testing.assert_close(document_attention.lse_head_max(lse), want)
    torch.testing.assert_close(document_attention.lse_head_max(lse.unsqueeze(-1)), want)
    torch.testing.assert_close(document_attention.lse_head_max(lse.transpose(0, 1).flatten(1)), want)
    lse[1, 0, 7] = float("nan")
    got = document_attention.lse_head_max(lse)
    assert got[0] == float("inf") and got[1] == want[1]


def test_attend_with_lse_bound_has_no_bound_on_cpu():
    """CPU attention (SDPA with the dense mask) computes no log-sum-exp: the output is ``attend``'s, the
    bound None, and QK-clip takes the exact maximum."""
    docs = _docs([[100, 156], [T]])
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, H, T, DQK, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g)
    o, bound = document_attention.attend_with_lse_bound(q, k, v, DQK ** -0.5, docs, lambda: _dense(docs))
    assert bound is None
    torch.testing.assert_close(o, attend(q, k, v, DQK ** -0.5, docs, lambda: _dense(docs)), rtol=0, atol=0)
