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


def _case(routing: str, gemm: str, folded: bool):
    """bench-1B's MoE dims, 4096 tokens: (experts, z, gate weights w, chosen experts idx, the output's gradient g,
    the grouped layer's forward as a closure). Skewed: a few hot experts, one expert never chosen. ``folded``: the
    gate weights ride in SiTU's pass (the layer's path, ``experts_and_combine``) and the combine is unweighted."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_experts=128, num_experts_per_token=8, latent_size=512, moe_intermediate_size=256)
    experts = RoutedExperts(cfg, TPSpec(None, 0.02)).cuda()
    experts.grouped_gemm = gemm
    n, k, E = 4096, cfg.num_experts_per_token, cfg.num_experts
    if routing == "natural":
        idx = torch.randn(n, E, device="cuda").topk(k, dim=-1).indices
    else:
        popularity = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample().cuda()
        popularity[-1] = 0
        idx = torch.multinomial(popularity.expand(n, E), k, replacement=False)
    z = torch.randn(n, cfg.latent_size, device="cuda", requires_grad=True)
    w = torch.rand(n, k, device="cuda", requires_grad=True)
    g = torch.randn(n, cfg.latent_size, device="cuda")
    disp = LocalTokenDispatcher(E)

    def grouped():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rows, tokens_per_expert, handle = disp.dispatch(z.bfloat16(), idx, experts.row_tile)
            if folded:
                return experts_and_combine(disp, experts, rows, tokens_per_expert, w, handle)
            return disp.combine(experts(rows, tokens_per_expert), w, handle)

    return experts, z, w, idx, g, grouped


@pytest.mark.parametrize("routing", ["natural", "skewed"])
@pytest.mark.parametrize("gemm, folded", [("torch", False), ("tiles:0", False), ("fused:1", False), ("torch", True),
                                          ("fused:1", True)])
def test_grouped_bf16_matches_fp32_loop(routing, gemm, folded):
    """The grouped experts in bf16 against the fp32 loop: outputs and the gradients of z, the gate weights, w13 and
    w2 (with "fused:1" and ``folded``, ds from the W2 dgrad's epilogue)."""
    if gemm != "torch" and not _cutlass_built():
        pytest.skip("needs kernels.grouped_gemm_sm90's library (python -m kernels.grouped_gemm_sm90.build)")
    experts, z, w, idx, g, grouped = _case(routing, gemm, folded)
    params = (z, w, experts.w13, experts.w2)
    out = grouped()
    assert out.dtype == torch.bfloat16
    got = torch.autograd.grad(out, params, g)
    want_out = experts.forward_looped(z, idx, w)
    want = torch.autograd.grad(want_out, params, g)
    assert _rel(out, want_out) < 1e-2
    for a, b in zip(got, want):
        assert b.abs().max() > 0 and _rel(a, b) < 2e-2, _rel(a, b)


@pytest.mark.parametrize("routing", ["natural", "skewed"])
def test_programmatic_dependent_launch_changes_nothing(routing, monkeypatch):
    """With K3_PDL=1 (``kernels.grid_dependency``) the layer's Triton kernels launch early and wait in-kernel for
    their predecessors: outputs and gradients are bit-equal to plain stream order, eagerly and as replays of a CUDA
    graph captured with it on ("fused:1" where the CUTLASS library is built, else "torch")."""
    experts, z, w, _, g, grouped = _case(routing, "fused:1" if _cutlass_built() else "torch", True)
    params = (z, w, experts.w13, experts.w2)

    def step():
        out = grouped()
        return (out, *torch.autograd.grad(out, params, g))

    want = step()
    monkeypatch.setenv("K3_PDL", "1")
    for _ in range(2):  # the second call runs the compiled PDL kernels from Triton's cache
        got = step()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, want):
            assert torch.equal(a, b)
