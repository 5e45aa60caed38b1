"""Context parallelism for the KDA mixer, on the load-balanced split of ``context_shard``: each CP
rank holds chunks r and 2C−1−r of every row (2C chunks of L tokens).

KDA's recurrent state crosses the chunk boundaries (PARALLEL_NOTES.md §2, issue 12). Per row and
head, a chunk maps the state entering it affinely: S_out = M·S_in + S_ext (M [K, K], fp32;
``kernels.kda.state_passing``). A rank

1. computes (M, S_ext) of its two chunks for every row in one packed pass (M = 0 when a document
   starts inside);
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

from dataclasses import dataclass

import torch

from kernels.kda import MAX_V, kda
from kernels.kda.state_passing import chain_states
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


@dataclass(frozen=True)
class ChunkPieces:
    """This rank's chunk rows [N = 2B, L] cut at every document start, as one packed sequence of
    N·L tokens (computed once per forward, shared by every KDA layer): piece offsets ``cu`` [P + 1]
    (and as an int32 device tensor), whether each piece continues a document from the chunk before
    (a row's first piece, unless a document starts at its first token), and each piece's row."""

    cu: list[int]
    continues: list[bool]
    row_of: list[int]
    cu_seqlens: torch.Tensor

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "ChunkPieces":
        """position_ids: [B, 2L], this rank's share of the rows."""
        rows = _chunk_rows(position_ids)
        N, L = rows.shape
        cu, continues, row_of = [0], [], []
        for b, row in enumerate(rows.tolist()):  # one host read per forward
            starts = [t for t in range(1, L) if row[t] == 0]
            for j, end in enumerate([*starts, L]):
                cu.append(b * L + end)
                continues.append(j == 0 and row[0] != 0)
                row_of.append(b)
        return cls(cu, continues, row_of, torch.tensor(cu, dtype=torch.int32, device=position_ids.device))

    @property
    def last(self) -> list[int]:
        """Each row's last piece."""
        n = len(self.row_of)
        return [i for i in range(n) if i + 1 == n or self.row_of[i + 1] != self.row_of[i]]


def _chunk_transitions(q, k, v, g, beta, A_log, dt_bias, pieces: ChunkPieces, kw) -> torch.Tensor:
    """[N, H, K, K + V] fp32: each chunk row's [M | S_ext] from one packed KDA pass.

    The recurrence is linear in the state, so running values [0 | v] from the state [I | 0] carries
    M in the first K value columns and S_ext in the rest; a piece that does not continue a document
    starts from 0 (its M is 0). A row's [M | S_ext] is the final state of its last piece."""
    N, L, H, K = q.shape
    V = v.shape[-1]
    eye = torch.eye(K, device=q.device).expand(H, K, K)
    zero = q.new_zeros(H, K, K + V, dtype=torch.float32)
    x0 = torch.stack([torch.cat([eye, zero[..., K:]], -1) if c else zero for c in pieces.continues])
    v_aug = torch.cat([v.new_zeros(N, L, H, K), v], -1)
    _, final = kda(*(_packed(t) for t in (q, k, v_aug, g, beta)), A_log, dt_bias, initial_state=x0.contiguous(),
                   output_final_state=True, cu_seqlens=pieces.cu_seqlens, **kw)
    return final[pieces.last]


def _packed(t: torch.Tensor) -> torch.Tensor:
    """[N, L, *] → [1, N·L, *]."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:]).contiguous()


def kda_context_parallel(q, k, v, g, beta, A_log, dt_bias, pieces: ChunkPieces, shard: ContextShard, *,
                         lower_bound: float, use_qk_l2norm: bool = True) -> torch.Tensor:
    """KDA on this rank's share of every row, exact against the whole rows on one rank
    → o [B, 2L, H, V]. Two packed KDA passes (transitions, then the rerun) and one collective."""
    B, T_local, H, K = q.shape
    V = v.shape[-1]
    if K + V > MAX_V:
        raise ValueError(f"kda context parallel: K + V = {K + V} is above the kernel's {MAX_V} value columns")
    kw = dict(lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm)
    q, k, v, g, beta = (_chunk_rows(t) for t in (q, k, v, g, beta))
    MS = _chunk_transitions(q, k, v, g, beta, A_log, dt_bias, pieces, kw)
    MS_all = _per_chunk(MS, shard)  # [2C, B, H, K, K + V] fp32
    M_all, S_all = MS_all.split([K, V], -1)
    S_in = _mine(chain_states(M_all, S_all), shard)  # [2B, H, K, V]
    S_in = S_in + 0.0 * MS_all.sum()  # chunk 0's S_in is a constant otherwise

    # rerun: every piece from its entering state (0 where a document starts; in the graph everywhere)
    h0 = torch.stack([S_in[b] if c else 0.0 * S_in[b] for b, c in zip(pieces.row_of, pieces.continues)])
    o, _ = kda(*(_packed(t) for t in (q, k, v, g, beta)), A_log, dt_bias, initial_state=h0,
               cu_seqlens=pieces.cu_seqlens, **kw)
    return o.view(B, T_local, H, V)
