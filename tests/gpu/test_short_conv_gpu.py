"""KDA's causal short conv with document resets on CUDA at bench-1B shapes (run with ``pytest -m gpu``).

x [2, 4096, 3072] (q, k, v of 8 heads × 128 side by side), W = 4, packed documents of 1..2048
tokens, bf16 and fp32 x: the Triton kernels (the ``auto`` backend on CUDA) against the float64
reference on the same input values. Every element of out and dx within the store's rounding (half
a bf16 ulp; none for fp32) plus 1e-6 of the sum of its terms' magnitudes; dweight (fp32, a sum over
8192 tokens) within 1e-5 of that sum.
"""

from __future__ import annotations

import pytest
import torch

from kernels.short_conv import causal_conv_with_resets
from kernels.short_conv import reference as R

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B, T, C, W = 2, 4096, 3072, 4


def packed_positions(g: torch.Generator) -> torch.Tensor:
    """[B, T] positions of documents of 1..2048 tokens (log-uniform), the second row opening
    inside one."""
    rows = []
    for b in range(B):
        pos, start = [], 100 * b
        while len(pos) < T:
            n = int(torch.empty(()).uniform_(0, 11, generator=g).exp2())
            pos += range(start, start + max(n, 1))
            start = 0
        rows.append(torch.tensor(pos[:T]))
    return torch.stack(rows).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_matches_reference_bench_1b(dtype):
    g = torch.Generator().manual_seed(0)
    pos = packed_positions(g)
    assert int((pos == 0).sum()) > 4
    x = torch.randn(B, T, C, generator=g).to(dtype).cuda()
    weight = torch.empty(C, 1, W).uniform_(-0.5, 0.5, generator=g).cuda()
    go = torch.randn(B, T, C, generator=g).to(dtype).cuda()
    xl, wl = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = causal_conv_with_resets(xl, wl, pos)
    assert type(out.grad_fn).__name__.startswith("_CausalConvWithResets")  # auto -> Triton on CUDA
    out.backward(go)

    x64, w64, g64 = x.double(), weight.double(), go.double()
    ref_out = R.causal_conv_forward(x64, w64, pos)
    ref_dx, ref_dw = R.causal_conv_backward(x64, w64, pos, g64)
    abs_out = R.causal_conv_forward(x64.abs(), w64.abs(), pos)
    abs_dx, abs_dw = R.causal_conv_backward(x64.abs(), w64.abs(), pos, g64.abs())
    rnd = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    for name, got, ref, bound, rel in [("out", out, ref_out, abs_out, 1e-6), ("dx", xl.grad, ref_dx, abs_dx, 1e-6),
                                       ("dweight", wl.grad, ref_dw, abs_dw, 1e-5)]:
        assert got.shape == ref.shape, name
        err = (got.double() - ref).abs()
        tol = rel * bound + (rnd * ref.abs() if name != "dweight" else 0.0)
        assert bool((err <= tol).all()), f"{dtype} {name}: max err {float(err.max()):.3g}"
    assert out.dtype == xl.grad.dtype == dtype and wl.grad.dtype == torch.float32
