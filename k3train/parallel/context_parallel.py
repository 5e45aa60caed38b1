"""Context parallelism for the KDA mixer: each CP rank holds one contiguous chunk of every row.

KDA's recurrent state crosses the chunk boundaries (PARALLEL_NOTES.md §2, issue 12). Per row and
head, the chunk maps the state entering it affinely: S_out = M·S_in + S_ext (M [K, K], fp32;
``kernels.kda.state_passing``). A rank

1. computes its chunk's (M, S_ext) for every row (M = 0 when a document starts inside it);
2. all-gathers them over the CP group and chains the chunks before it in fp32:
   S_in[r] = M[r−1]·S_in[r−1] + S_ext[r−1], S_in[0] = 0;
3. reruns its chunk with S_in[r] as the initial state of its first document (unless a
   document starts at the chunk's first token).

The backward is autograd's: the all-gather's backward sums every rank's gradient for each chunk's
(M, S_ext) (the mirror chain), and the rerun and the transition pass differentiate as usual. That
sum is a collective, so every rank's output must depend on what it gathered, even where the value
is not needed (rank 0, a chunk that starts a document): there it enters multiplied by 0.

The short conv reads W − 1 tokens before the chunk: ``causal_conv_context_parallel`` takes them
from the previous rank (its backward returns their gradient there). Positions are within-document
positions of the whole row, so the conv's document mask needs nothing else.

Shapes: x [B, L, C] and position_ids [B, L] are this rank's chunk of B rows; q, k, g [B, L, H, K],
v [B, L, H, V], beta [B, L, H].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.kda import kda
from kernels.kda.state_passing import chain_states, segment_transition


class _AllGather(torch.autograd.Function):
    """[C, *shape] of every rank's x; the backward sums the C ranks' gradients of x's copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather_with_grad(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


def causal_conv_context_parallel(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor, group,
                                 conv) -> torch.Tensor:
    """``conv`` (the model's causal_conv_with_resets) on this rank's chunk, with the W − 1 tokens
    before it taken from the previous CP rank (zeros on rank 0, where the row starts)."""
    halo_len = weight.shape[-1] - 1
    if halo_len == 0:
        return conv(x, weight, position_ids)
    halos = all_gather_with_grad(x[:, -halo_len:], group)  # [C, B, W−1, C]
    rank = dist.get_rank(group)
    halo = halos[rank - 1] if rank > 0 else 0.0 * halos[0]  # in the graph: see the module docstring
    pos_halo = torch.zeros_like(position_ids[:, :halo_len])  # never read: only the outputs' positions mask
    out = conv(torch.cat([halo, x], 1), weight, torch.cat([pos_halo, position_ids], 1))
    return out[:, halo_len:]


def _row_documents(position_ids: torch.Tensor) -> list[tuple[list[int], bool]]:
    """Per row of the chunk: local document bounds [0, …, L] and whether a document starts at
    the chunk's first token."""
    out = []
    for row in position_ids.tolist():
        starts = [t for t in range(1, len(row)) if row[t] == 0]
        out.append(([0, *starts, len(row)], row[0] == 0))
    return out


def kda_context_parallel(q, k, v, g, beta, A_log, dt_bias, position_ids: torch.Tensor, group, *,
                         lower_bound: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """KDA on this rank's chunk of every row, exact against the whole rows on one rank → o [B, L, H, V]."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    kw = dict(lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm)
    rows = _row_documents(position_ids)
    Ms, Ss = [], []
    for b, (bounds, starts) in enumerate(rows):
        seg = [t[b:b + 1] for t in (q, k, v, g, beta)]
        M, S = segment_transition(*seg, A_log, dt_bias, cu_seqlens=torch.tensor(bounds, device=q.device),
                                  starts_document=starts, **kw)
        Ms.append(M[0])
        Ss.append(S[0])
    M_all = all_gather_with_grad(torch.stack(Ms), group)  # [C, B, H, K, K] fp32
    S_all = all_gather_with_grad(torch.stack(Ss), group)  # [C, B, H, K, V] fp32
    rank = dist.get_rank(group)
    S_in = chain_states(M_all[:rank + 1], S_all[:rank + 1])[rank]  # [B, H, K, V]
    S_in = S_in + 0.0 * (M_all.sum() + S_all.sum())  # rank 0's S_in is a constant otherwise

    # rerun: the rows packed into one, every local document with its initial state
    cu, h0 = [0], []
    for b, (bounds, starts) in enumerate(rows):
        for j in range(len(bounds) - 1):
            cu.append(b * L + bounds[j + 1])
            h0.append(S_in[b] if j == 0 and not starts else 0.0 * S_in[b])  # in the graph everywhere

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, B * L, *t.shape[2:]).contiguous()

    o, _ = kda(flat(q), flat(k), flat(v), flat(g), flat(beta), A_log, dt_bias, initial_state=torch.stack(h0),
               cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=q.device), **kw)
    return o.view(B, L, H, V)
