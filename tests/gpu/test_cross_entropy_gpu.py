"""Fused cross-entropy on CUDA at bench-1B shapes (run with ``pytest -m gpu``).

logits [8192, 163840] (8,192 tokens, the full vocabulary, TP = 1): the Triton kernels (the
``auto`` backend on CUDA) against F.cross_entropy in fp32 on the same values. bf16 logits: loss
within 1e-4 absolute (fp32 sums of 163,840 terms), dz within 1e-4 relative (fp32 exp and lse) plus half a bf16
ulp of the fp32 gradient plus 1e-9 absolute; fp32 logits (4096 rows, for memory): no bf16 term.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cross_entropy import cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

V = 163840


@pytest.mark.parametrize("dtype, N", [(torch.bfloat16, 8192), (torch.float32, 4096)], ids=["bf16", "fp32"])
def test_kernel_matches_f_cross_entropy_bench_1b(dtype, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (4 * torch.randn(N, V, device="cuda", generator=g)).to(dtype)
    z[::7] += 30.0  # rows far from zero: the online max matters
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    go = torch.rand(N, device="cuda", generator=g) + 0.5

    zl = z.clone().requires_grad_()
    loss = cross_entropy(zl, labels)
    assert "_CrossEntropy" in str(loss.grad_fn.next_functions)
    loss.backward(go)
    dz = zl.grad
    del zl

    zf = z.float().requires_grad_()
    want = F.cross_entropy(zf, labels, reduction="none")
    want.backward(go)
    want_dz = zf.grad
    del zf

    assert loss.dtype == torch.float32 and dz.dtype == dtype
    assert (loss - want).abs().max().item() < 1e-4
    rel = 1e-4 + (2.0**-8 if dtype == torch.bfloat16 else 0.0)
    tol = 1e-9 + rel * want_dz.abs()
    bad = (dz.float() - want_dz).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} dz elements off, max err {(dz.float() - want_dz).abs().max().item():.3g}"
