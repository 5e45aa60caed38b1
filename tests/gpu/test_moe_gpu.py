"""The grouped routed experts on CUDA in bf16 (torch._grouped_mm, and the expert-tiled CUTLASS kernel on rows
padded per expert where its library is built) against the per-expert loop in fp32, at bench-1B MoE dims, with
natural and skewed routing. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

from k3train.config.schema import ModelConfig
from k3train.model.moe import RoutedExperts, experts_and_combine
from k3train.parallel.tensor_parallel import TPSpec
from k3train.parallel.token_dispatcher import LocalTokenDispatcher

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _cutlass_built() -> bool:
    from kernels import grouped_gemm_sm90
    return grouped_gemm_sm90.available()


@pytest.mark.parametrize("routing", ["natural", "skewed"])
@pytest.mark.parametrize("gemm, folded", [("torch", False), ("tiles:0", False), ("fused:1", False), ("torch", True),
                                          ("fused:1", True), ("fused:1:0", True), ("fused:1:w", True)])
def test_grouped_bf16_matches_fp32_loop(routing, gemm, folded):
    """The grouped experts in bf16 against the fp32 loop: outputs and the gradients of z, the gate weights, w13 and
    w2. ``folded``: the gate weights ride in SiTU's pass (the layer's path, ``experts_and_combine``; with "fused:1"
    in the products' epilogues, ds from the W2 dgrad's) and the combine is unweighted."""
    if gemm != "torch" and not _cutlass_built():
        pytest.skip("needs kernels.grouped_gemm_sm90's library (python -m kernels.grouped_gemm_sm90.build)")
    torch.manual_seed(0)
    cfg = ModelConfig(num_experts=128, num_experts_per_token=8, latent_size=512, moe_intermediate_size=256)
    experts = RoutedExperts(cfg, TPSpec(None, 0.02)).cuda()
    experts.grouped_gemm = gemm
    n, k, E = 4096, cfg.num_experts_per_token, cfg.num_experts
    if routing == "natural":
        idx = torch.randn(n, E, device="cuda").topk(k, dim=-1).indices
    else:  # a few hot experts, one expert never chosen
        popularity = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample().cuda()
        popularity[-1] = 0
        idx = torch.multinomial(popularity.expand(n, E), k, replacement=False)
    z = torch.randn(n, cfg.latent_size, device="cuda", requires_grad=True)
    w = torch.rand(n, k, device="cuda", requires_grad=True)
    g = torch.randn(n, cfg.latent_size, device="cuda")
    disp = LocalTokenDispatcher(E)

    def grouped():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rows, tokens_per_expert, handle = disp.dispatch(z.bfloat16(), idx, experts.row_tile, w if folded else None)
            if folded:
                return experts_and_combine(disp, experts, rows, tokens_per_expert, w, handle)
            return disp.combine(experts(rows, tokens_per_expert), w, handle)

    params = (z, w, experts.w13, experts.w2)
    out = grouped()
    assert out.dtype == torch.bfloat16
    got = torch.autograd.grad(out, params, g)
    want_out = experts.forward_looped(z, idx, w)
    want = torch.autograd.grad(want_out, params, g)
    assert _rel(out, want_out) < 1e-2
    for a, b in zip(got, want):
        assert b.abs().max() > 0 and _rel(a, b) < 2e-2, _rel(a, b)
