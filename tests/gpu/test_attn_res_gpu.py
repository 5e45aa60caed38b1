"""Block AttnRes aggregation on CUDA at bench-1B shapes (run with ``pytest -m gpu``).

8192 tokens ([2, 4096]), d = 1024, S = 1..5 fp32 sources, random non-zero w and γ: the Triton
kernels (the ``auto`` backend on CUDA) and the torch fp32 path are both compared with the float64
reference; the kernel's error on every output and gradient must stay within 4× the torch fp32
path's error plus 1e-6 of the tensor's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attn_res import MAX_SOURCES, attn_res_aggregate
from kernels.attn_res import reference as R

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = (2, 4096, 1024)


def _inputs(S: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = SHAPE[-1]
    sources = [torch.randn(SHAPE, device="cuda", generator=g, dtype=torch.float64)
               * torch.randn(*SHAPE[:-1], 1, device="cuda", generator=g, dtype=torch.float64).exp()
               for _ in range(S)]
    w = torch.randn(1, d, device="cuda", generator=g, dtype=torch.float64) * (3.0 / d**0.5)
    gain = torch.rand(d, device="cuda", generator=g, dtype=torch.float64) + 0.5
    go = torch.randn(SHAPE, device="cuda", generator=g, dtype=torch.float64)
    return sources, w, gain, go


def _run(backend: str, sources, w, gain, go, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in [*sources, w, gain]]
    out = attn_res_aggregate(leaves[:-2], leaves[-2], leaves[-1], backend=backend)
    out.backward(go.to(dtype))
    return out, [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5])
def test_kernel_matches_reference_bench_1b(S):
    sources, w, gain, go = _inputs(S, seed=S)
    out, got = _run("auto", sources, w, gain, go, torch.float32)
    assert type(out.grad_fn).__name__ == "_AttnResBackward"  # auto -> Triton on CUDA (kernels.attn_res._AttnRes)
    _, torch32 = _run("torch", sources, w, gain, go, torch.float32)
    _, ref = _run("torch", sources, w, gain, go, torch.float64)
    names = ["out", *(f"dv[{i}]" for i in range(S)), "dw", "dgain"]
    for name, k, t, r in zip(names, got, torch32, ref):
        assert k.dtype == torch.float32 and k.shape == r.shape, name
        err_k, err_t = float((k.double() - r).abs().max()), float((t.double() - r).abs().max())
        bound = 4 * err_t + 1e-6 * float(r.abs().max())
        assert err_k <= bound, f"S={S} {name}: kernel err {err_k:.3g}, torch fp32 err {err_t:.3g}"


def test_more_sources_than_the_kernel_falls_back():
    sources, w, gain, _ = _inputs(MAX_SOURCES + 1, seed=9)
    sources = [v[:, :64].float() for v in sources]
    with pytest.warns(UserWarning, match="using the torch reference"):
        out = attn_res_aggregate(sources, w.float(), gain.float())
    assert torch.equal(out, R.attn_res_forward(sources, w.float(), gain.float()))
