"""The weight-gradient experiments' operands: bench-1B's routing (16,384 tokens, 8 of 128 experts; "natural": top-k
of random scores, "skewed": experts drawn from Dirichlet(0.3) popularities) on the padded layout of row tile 64, and
random bf16 operands of the pair W13 (g1 [R, 512], x1 [R, 512]) and W2 (g2 [R, 512], x2 [R, 256])."""

import torch

from kernels import moe_plan

N, K, E, LATENT, WIDTH, ROW_TILE = 16384, 8, 128, 512, 256, 64


def pair_operands(routing: str):
    """(g1, x1, g2, x2, offsets [E] int32) on the GPU."""
    if routing == "natural":
        experts = torch.randn(N, E, device="cuda").topk(K, dim=-1).indices
    else:
        popularity = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample().cuda()
        experts = torch.multinomial(popularity.expand(N, E), K, replacement=False)
    plan = moe_plan.routing_plan(experts, E, ROW_TILE)
    rows = plan.inverse.numel() + plan.pad_rows.numel()
    offsets, _ = moe_plan.group_offsets(plan.group_rows, ROW_TILE, 0)
    g1, x1, g2 = (torch.randn(rows, LATENT, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    x2 = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16)
    return g1, x1, g2, x2, offsets
