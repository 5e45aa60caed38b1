"""Plain-torch MoE token permutation, differentiated by torch autograd.

With N tokens, k choices a token and ``order`` a permutation of range(N·k) (grouped row m holds
token copy order[m] = i·k + j, token i's j-th choice) and ``inverse`` its inverse::

    dispatch:  x[m] = z[order[m] // k]                        z [N, ℓ] → x [N·k, ℓ] (+ P zero padding rows)
               dz[i] = Σ_j dx[inverse[i·k + j]]
    combine:   u[i] = Σ_j w[i, j] · y[inverse[i·k + j]]       y [N·k, ℓ], w [N, k] → u [N, ℓ]
               dy[inverse[i·k + j]] = w[i, j] · du[i],   dw[i, j] = <y[inverse[i·k + j]], du[i]>

Sums over j and over ℓ are taken in fp32 (torch reduces half-precision tensors in fp32) and
rounded once to the output dtype. The backward of each index_select writes every row once (the
index is a permutation), so it is exact.
"""

from __future__ import annotations

import torch


def dispatch_rows(z: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int,
                  pad_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [N·k, ℓ] with x[m] = z[order[m] // k]. With ``pad_rows`` [P]: x [N·k + P, ℓ] with
    x[inverse[i·k + j]] = z[i] and zeros elsewhere (the padded layout; ``order`` unused).

    The k copies are materialised in token order first, so that autograd forms dz as a sum over
    a [N, k, ℓ] view (fp32 accumulation) rather than an index_add in z's dtype."""
    n, ell = z.shape
    copies = z.unsqueeze(1).expand(n, top_k, ell).reshape(n * top_k, ell)
    if pad_rows is None:
        return copies.index_select(0, order)
    return copies.new_zeros(n * top_k + pad_rows.numel(), ell).index_copy(0, inverse, copies)


def combine_rows(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                 inverse: torch.Tensor) -> torch.Tensor:
    """u [N, ℓ] in y.dtype with u[i] = Σ_j weights[i, j] · y[inverse[i·k + j]], in fp32 (fp64
    for fp64 inputs); ``order`` is unused (kept for one signature)."""
    n, k = weights.shape
    acc = torch.promote_types(torch.promote_types(y.dtype, weights.dtype), torch.float32)  # fp64 stays
    per_token = y.index_select(0, inverse).view(n, k, y.shape[-1])
    return (weights.to(acc).unsqueeze(-1) * per_token.to(acc)).sum(1).to(y.dtype)
