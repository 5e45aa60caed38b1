"""Context parallelism for the KDA mixer, on the load-balanced split of ``context_shard``: each CP
rank holds chunks r and 2C−1−r of every row (2C chunks of L tokens).

KDA's recurrent state crosses the chunk boundaries (PARALLEL_NOTES.md §2, issue 12). Per row and
head, a chunk maps the state entering it affinely: S_out = M·S_in + S_ext (M [K, K], fp32;
``kernels.kda.state_passing``). A rank

1. computes (M, S_ext) of its two chunks for every row (M = 0 when a document starts inside);
2. all-gathers them (one collective) over the CP group and chains the 2C chunks in global order
   in fp32:
   S_in[c] = M[c−1]·S_in[c−1] + S_ext[c−1], S_in[0] = 0;
3. reruns its chunks with S_in[c] as the initial state of their first document (unless a
   document starts at the chunk's first token).

The backward is autograd's: the all-gather's backward sums every rank's gradient for each chunk's
(M, S_ext) (the mirror chain), and the rerun and the transition pass differentiate as usual. That
sum is a collective, so every rank's output must depend on what it gathered, even where the value
is not needed (chunk 0, a chunk that starts a document): there it enters multiplied by 0.

The short conv reads W − 1 tokens before each chunk: ``causal_conv_context_parallel`` takes them
from the rank holding the chunk before (its backward returns their gradient there); the model
convolves q, k and v in one call, so one collective per layer carries all three halos. Positions are
within-document positions of the whole row, so the conv's document mask needs nothing else.

Shapes: x [B, 2L, C] and position_ids [B, 2L] are this rank's share of B rows; q, k, g
[B, 2L, H, K], v [B, 2L, H, V], beta [B, 2L, H]. Inside, the share is viewed as 2B chunk rows
[2B, L, ...] (row 2b + s = slot s of row b).
"""

from __future__ import annotations

import torch

from kernels.kda import kda
from kernels.kda.state_passing import chain_states, segment_transition
from k3train.parallel.context_shard import ContextShard


def _chunk_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, 2L, *] → [2B, L, *]: one row per (row, slot)."""
    return t.reshape(t.shape[0] * 2, t.shape[1] // 2, *t.shape[2:]).contiguous()


def _per_chunk(rows: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """[2B, *] values of this rank's chunk rows → [2C, B, *] of every chunk, global order."""
    slots = rows.reshape(-1, 2, *rows.shape[1:]).transpose(0, 1)  # [2, B, *]
    return shard.all_chunks(slots)


def _mine(per_chunk: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """[2C, B, *] → [2B, *]: this rank's chunks, as chunk rows."""
    return torch.stack([per_chunk[c] for c in shard.chunks], 1).flatten(0, 1)


def causal_conv_context_parallel(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor,
                                 shard: ContextShard, conv) -> torch.Tensor:
    """``conv`` (the model's causal_conv_with_resets) on this rank's share, each chunk with the
    W − 1 tokens before it from the chunk before (zeros before chunk 0, where the row starts)."""
    halo_len = weight.shape[-1] - 1
    if halo_len == 0:
        return conv(x, weight, position_ids)
    rows, pos = _chunk_rows(x), _chunk_rows(position_ids)
    tails = _per_chunk(rows[:, -halo_len:], shard)  # [2C, B, W−1, C]
    before = torch.cat([0.0 * tails[:1], tails[:-1]])  # chunk c reads chunk c−1's tail; in the graph
    halo = _mine(before, shard)
    pos_halo = torch.zeros_like(pos[:, :halo_len])  # never read: only the outputs' positions mask
    out = conv(torch.cat([halo, rows], 1), weight, torch.cat([pos_halo, pos], 1))
    return out[:, halo_len:].reshape(x.shape[0], x.shape[1], *out.shape[2:])


def _row_documents(position_ids: torch.Tensor) -> list[tuple[list[int], bool]]:
    """Per chunk row: local document bounds [0, …, L] and whether a document starts at the chunk's
    first token."""
    out = []
    for row in position_ids.tolist():
        starts = [t for t in range(1, len(row)) if row[t] == 0]
        out.append(([0, *starts, len(row)], row[0] == 0))
    return out


def kda_context_parallel(q, k, v, g, beta, A_log, dt_bias, position_ids: torch.Tensor, shard: ContextShard, *,
                         lower_bound: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """KDA on this rank's share of every row, exact against the whole rows on one rank
    → o [B, 2L, H, V]."""
    B, T_local, H, K = q.shape
    V = v.shape[-1]
    kw = dict(lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm)
    q, k, v, g, beta = (_chunk_rows(t) for t in (q, k, v, g, beta))
    rows = _row_documents(_chunk_rows(position_ids))
    L = T_local // 2
    Ms, Ss = [], []
    for b, (bounds, starts) in enumerate(rows):
        seg = [t[b:b + 1] for t in (q, k, v, g, beta)]
        M, S = segment_transition(*seg, A_log, dt_bias, cu_seqlens=torch.tensor(bounds, device=q.device),
                                  starts_document=starts, **kw)
        Ms.append(M[0])
        Ss.append(S[0])
    MS_all = _per_chunk(torch.cat([torch.stack(Ms), torch.stack(Ss)], -1), shard)  # [2C, B, H, K, K + V] fp32
    M_all, S_all = MS_all.split([K, V], -1)
    S_in = _mine(chain_states(M_all, S_all), shard)  # [2B, H, K, V]
    S_in = S_in + 0.0 * (M_all.sum() + S_all.sum())  # chunk 0's S_in is a constant otherwise

    # rerun: the chunk rows packed into one, every local document with its initial state
    cu, h0 = [0], []
    for b, (bounds, starts) in enumerate(rows):
        for j in range(len(bounds) - 1):
            cu.append(b * L + bounds[j + 1])
            h0.append(S_in[b] if j == 0 and not starts else 0.0 * S_in[b])  # in the graph everywhere

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, 2 * B * L, *t.shape[2:]).contiguous()

    o, _ = kda(flat(q), flat(k), flat(v), flat(g), flat(beta), A_log, dt_bias, initial_state=torch.stack(h0),
               cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=q.device), **kw)
    return o.view(B, T_local, H, V)
