"""The per-head maximum attention logit over the allowed (query, key) pairs, in plain torch: the
reference of the Triton kernel and the CPU path (QK-clip reads it, K3_SPEC.md §4).

For q [B, H, Tq, D], k [B, H, Tk, D], the queries' document ids ``q_doc`` [B, Tq] and row positions
``q_pos`` [Tq], the keys' document ids ``k_doc`` [B, Tk] (key j sits at row position j):

    m_h = max over b, i, j with j ≤ q_pos[i] and q_doc[b, i] = k_doc[b, j]  of  scale · q[b,h,i] · k[b,h,j]

in fp32 from the inputs as given (bf16 products are exact in fp32). Computed in blocks of query rows,
so no [Tq, Tk] score tensor is held for a whole row.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 256


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    """[H] fp32 (module docstring); −inf for a head with no allowed pair."""
    Tq, Tk = q.shape[2], k.shape[2]
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    key_pos = torch.arange(Tk, device=q.device)
    for s in range(0, Tq, QUERY_BLOCK):
        e = min(s + QUERY_BLOCK, Tq)
        logits = torch.einsum("bhqd,bhkd->bhqk", q[:, :, s:e].float(), k.float()) * scale
        ok = (key_pos[None, :] <= q_pos[s:e, None]) & (q_doc[:, s:e, None] == k_doc[:, None, :])  # [B, e−s, Tk]
        best = torch.maximum(best, logits.masked_fill(~ok.unsqueeze(1), float("-inf")).amax(dim=(0, 2, 3)))
    return best
