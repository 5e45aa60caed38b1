"""MLA's attention over packed documents on CUDA (run with ``pytest -m gpu``): FlexAttention with the
document block mask and flash attention's variable-length kernels ("flash") against SDPA with the dense
mask, each against an fp32 reference.

bench-1B's MLA shapes: [2, 8 heads, 4096] tokens, qk 192, v 128, bf16; rows packed with documents of
random lengths (one crossing nothing, several short ones, one row a single document). The output and
q/k/v gradients of each bf16 way are compared with fp32 SDPA on the same inputs: their relative error
must stay within 2x SDPA's bf16 error plus 1e-3; "flash" also with the offsets padded with empty
documents (compiled layers pad them). Then a bench-1B-shaped K3 model (2 layers, one of them MLA) gives
the same loss and gradients through each way as through the dense mask; and a compiled function over
FlexAttention does not recompile for a new micro-batch's block mask.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from k3train.model import document_attention
from k3train.model.document_attention import allowed, attend, document_block_mask
from k3train.model.documents import Documents

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B, H, T, DQK, DV = 2, 8, 4096, 192, 128
LENGTHS = ([700, 1, 1500, 33, 1862], [T])


def _position_ids(lengths=LENGTHS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).cuda()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _dense_mask(docs: Documents) -> torch.Tensor:
    return allowed(docs.doc_ids, docs.doc_ids, torch.arange(T, device="cuda")).unsqueeze(1)


@pytest.mark.parametrize("way, bucket", [("flex", False), ("flash", False), ("flash", True)])
def test_way_matches_dense_mask_within_bf16_noise(way, bucket, monkeypatch):
    torch._dynamo.reset()
    docs = Documents.from_position_ids(_position_ids(), bucket=bucket)
    if way == "flex":
        docs = dataclasses.replace(docs, block_mask=document_block_mask(docs.doc_ids))
    mask = _dense_mask(docs)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, DQK, device="cuda", generator=g) for _ in range(2))  # [B, T, H, D], as MLA
    v = torch.randn(B, T, H, DV, device="cuda", generator=g)
    do = torch.randn(B, H, T, DV, device="cuda", generator=g)

    def run(dtype, chosen):
        monkeypatch.setattr(document_attention, "DOCUMENT_ATTENTION", chosen)
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        how = docs if chosen != "sdpa" else dataclasses.replace(docs, block_mask=None)
        o = attend(*(t.transpose(1, 2) for t in leaves), DQK ** -0.5, how, lambda: mask)
        o.backward(do.to(dtype))
        return [o.detach(), *(t.grad for t in leaves)]

    want = run(torch.float32, "sdpa")
    dense = run(torch.bfloat16, "sdpa")
    got = run(torch.bfloat16, way)
    for name, f, d, w in zip(("o", "dq", "dk", "dv"), got, dense, want):
        assert torch.isfinite(f).all(), name
        assert _rel(f, w) <= 2 * _rel(d, w) + 1e-3, (name, _rel(f, w), _rel(d, w))


def test_flash_way_takes_fp32_rows_through_the_dense_mask(monkeypatch):
    """flash attention has no fp32 kernels: fp32 packed rows (an fp32 run, or the fp32 reference of a
    test) go through SDPA with the dense mask, and match it exactly, instead of failing."""
    monkeypatch.setattr(document_attention, "DOCUMENT_ATTENTION", "flash")
    docs = Documents.from_position_ids(_position_ids())
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(B, H, T, DQK, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(B, H, T, DV, device="cuda", generator=g)
    mask = _dense_mask(docs)
    got = attend(q, k, v, DQK ** -0.5, docs, lambda: mask)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=DQK ** -0.5)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("way", ["flex", "flash"])
def test_model_through_way_equals_dense_mask(way, monkeypatch):
    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=1024, num_layers=2, vocab_size=4096, full_attn_layers=[2], kda_num_heads=8,
                      kda_head_dim=128, mla_num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, dense_intermediate_size=1024, num_experts=8,
                      num_experts_per_token=2, latent_size=512, moe_intermediate_size=256)
    model = K3Model(cfg).cuda()
    dense_model = copy.deepcopy(model)
    pos = _position_ids()
    tokens, labels = (torch.randint(0, cfg.vocab_size, (B, T), device="cuda") for _ in range(2))
    results = []
    for m, chosen in ((model, way), (dense_model, "sdpa")):
        monkeypatch.setattr(document_attention, "DOCUMENT_ATTENTION", chosen)
        assert (m.documents(tokens, pos).block_mask is not None) == (chosen == "flex")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(tokens, pos, labels)
        loss.backward()
        results.append((float(loss), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (got_loss, got_grads), (dense_loss, dense_grads) = results
    assert abs(got_loss - dense_loss) < 2e-3 * abs(dense_loss), (got_loss, dense_loss)
    total = sum(float((got_grads[n] - g).norm()) ** 2 for n, g in dense_grads.items()) ** 0.5
    norm = sum(float(g.norm()) ** 2 for g in dense_grads.values()) ** 0.5
    assert total < 2e-2 * norm, (total, norm)


def test_compiled_flex_does_not_recompile_for_a_new_batch():
    """A compiled function that attends through the block mask of one micro-batch, then another (new
    document ids, new BlockMask): one compile, and each call matches the dense-mask path."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("inductor")  # this function's compiles (the block masks compile their own)
    fn = torch.compile(lambda q, k, v, docs: attend(q, k, v, DQK ** -0.5, docs, lambda: None), backend=compiles)
    g = torch.Generator(device="cuda").manual_seed(2)
    for lengths in (LENGTHS, ([T // 2, T // 2], [100, T - 100])):
        docs = Documents.from_position_ids(_position_ids(lengths))
        docs = dataclasses.replace(docs, block_mask=document_block_mask(docs.doc_ids))
        q, k = (torch.randn(B, H, T, DQK, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        v = torch.randn(B, H, T, DV, device="cuda", dtype=torch.bfloat16, generator=g)
        got = fn(q, k, v, docs).float()
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_dense_mask(docs),
                                                                scale=DQK ** -0.5).float()
        assert _rel(got, want) < 1e-2, _rel(got, want)
    assert compiles.frame_count == 1, compiles.frame_count


@pytest.mark.parametrize("packed, compiled", [(False, False), (True, False), (False, True), (True, True)])
def test_kernel_log_sum_exp_bounds_each_heads_max_logit(packed, compiled):
    """``attend_with_lse_bound``: cuDNN's log-sum-exp (one document a row) and flash attention's (packed
    rows, offsets padded as compiled layers pad them) give per head m_h ≤ bound ≤ m_h + log T against the
    exact max logit (``kernels.max_logit``), eagerly and compiled in one graph; the output and q/k/v
    gradients match ``attend``'s within bf16 noise."""
    from kernels.max_logit import max_logit

    torch._dynamo.reset()
    lengths = LENGTHS if packed else ([T], [T])
    docs = Documents.from_position_ids(_position_ids(lengths), bucket=packed)
    assert docs.one_per_row != packed
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k = (3 * torch.randn(B, T, H, DQK, device="cuda", generator=g) for _ in range(2))  # logits of std ≈ 3
    v = torch.randn(B, T, H, DV, device="cuda", generator=g)
    do = torch.randn(B, H, T, DV, device="cuda", generator=g)
    mask = _dense_mask(docs)
    fn = document_attention.attend_with_lse_bound
    if compiled:
        fn = torch.compile(fn, fullgraph=True)

    def run(way):
        leaves = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        o, bound = way(*(t.transpose(1, 2) for t in leaves), DQK ** -0.5, docs, lambda: mask)
        o.backward(do.to(torch.bfloat16))
        return o.detach(), bound, [t.grad for t in leaves], [t.detach().transpose(1, 2) for t in leaves]

    o, bound, grads, (qb, kb, _) = run(fn)
    want_o, _, want_grads, _ = run(lambda *a: (attend(*a), None))
    exact = max_logit(qb, kb, docs.doc_ids, docs.doc_ids, torch.arange(T, device="cuda"), DQK ** -0.5)
    assert bound is not None and bound.shape == (H,) and bound.dtype == torch.float32
    slack = 1e-3 * exact.abs() + 1e-3
    assert bool((bound >= exact - slack).all()), (bound, exact)
    assert bool((bound <= exact + math.log(T) + slack).all()), (bound, exact)
    for name, got, want in zip(("o", "dq", "dk", "dv"), [o, *grads], [want_o, *want_grads]):
        assert _rel(got, want) < 2e-2, (name, _rel(got, want))
