"""Triton router tail: one forward kernel, one backward kernel (math in ``reference.py``).

A program holds a [BLOCK_M, BLOCK_E ≥ E] tile of rows (all of a row's experts at once, E ≤ ``MAX_E``):

* forward: loads the logits (any strides) as fp32, s = σ(z), biased = s + b (padding columns −∞),
  then k+1 rounds of: the row maximum, the lowest column holding it (ties go to the lower expert
  id), its score gathered, the column masked to −∞. The first k rounds give the experts and their
  scores (in descending biased order, as ``torch.topk``), the (k+1)-th round's maximum is the cutoff.
  Writes experts [M, k] int64, weights [M, k] fp32, scores [M, E] fp32 and cutoff [M] fp32.
* backward: from dweights [M, k] (any strides), experts and the saved scores, per row: the chosen
  columns and their dw scattered into the row's dense tile in registers (k compares against the
  column ids), S and Σ dw_j s_j as row sums, then the dense dlogits [M, E] fp32 (zero outside the
  chosen experts) written once. No atomics, no separate zero fill.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported), on small tiles so that tests cover several programs and the row edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..row_tiles import RowTiles, row_tiles

MAX_E = 4096
GPU_BLOCK_ELEMS = 4096  # elements of one [BLOCK_M, BLOCK_E] tile: 32 rows of E=128, 4 rows of E=1024 (untuned)


@triton.jit
def _route_fwd_kernel(Z, BIAS, W, EXPERTS, S, CUTOFF, M, E, stride_zm, stride_ze, scaling,
                      K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    z = tl.load(Z + rows[:, None].to(tl.int64) * stride_zm + cols[None, :] * stride_ze, mask=mask,
                other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-z))
    b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    cur = tl.where(col_ok[None, :], s + b[None, :], float("-inf"))
    w = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j in range(K):
        top = tl.max(cur, axis=1)
        idx = tl.min(tl.where(cur == top[:, None], cols[None, :], BLOCK_E), axis=1)
        idx = tl.minimum(idx, E - 1)  # only a row of NaNs matches no column: keep its ids in range
        hit = cols[None, :] == idx[:, None]
        s_j = tl.sum(tl.where(hit, s, 0.0), axis=1)
        total += s_j
        at_j = kcols[None, :] == j
        w = tl.where(at_j, s_j[:, None], w)
        ids = tl.where(at_j, idx[:, None], ids)
        cur = tl.where(hit, float("-inf"), cur)
    cutoff = tl.max(cur, axis=1)
    w = w / total[:, None] * scaling
    kmask = row_ok[:, None] & (kcols[None, :] < K)
    out_k = rows[:, None].to(tl.int64) * K + kcols[None, :]
    tl.store(W + out_k, w, mask=kmask)
    tl.store(EXPERTS + out_k, ids.to(tl.int64), mask=kmask)
    tl.store(S + rows[:, None].to(tl.int64) * E + cols[None, :], s, mask=mask)
    tl.store(CUTOFF + rows, cutoff, mask=row_ok)


@triton.jit
def _route_bwd_kernel(DW, EXPERTS, S, DZ, M, E, stride_dwm, stride_dwk, scaling,
                      K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < E)
    rows64 = rows.to(tl.int64)
    s = tl.load(S + rows64[:, None] * E + cols[None, :], mask=mask, other=0.0)
    dw = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.int32)
    for j in range(K):
        e_j = tl.load(EXPERTS + rows64 * K + j, mask=row_ok, other=-1)
        dw_j = tl.load(DW + rows64 * stride_dwm + j * stride_dwk, mask=row_ok, other=0.0).to(tl.float32)
        hit = cols[None, :] == e_j[:, None]
        dw = tl.where(hit, dw_j[:, None], dw)
        chosen = tl.where(hit, 1, chosen)
    sel = chosen != 0
    total = tl.sum(tl.where(sel, s, 0.0), axis=1)
    total = tl.where(row_ok, total, 1.0)  # rows past M: no 0/0
    c = tl.sum(tl.where(sel, dw * s, 0.0), axis=1) / total
    ds = (scaling / total)[:, None] * (dw - c[:, None])
    dz = tl.where(sel, ds * (s * (1.0 - s)), 0.0)
    tl.store(DZ + rows64[:, None] * E + cols[None, :], dz, mask=mask)


def _interpreted() -> bool:
    return isinstance(_route_fwd_kernel, InterpretedFunction)


def _tiles(e: int) -> RowTiles:
    return row_tiles(e, MAX_E, GPU_BLOCK_ELEMS, _interpreted(), "the Triton router's expert count")


def route_forward(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [M, E] fp32 (any strides), bias [E] fp32 (any stride) → weights [M, k] fp32, experts [M, k] int64,
    scores [M, E] fp32, cutoff [M] fp32 (all contiguous)."""
    M, E = logits.shape
    dev = logits.device
    bias = bias.contiguous()
    weights = torch.empty(M, top_k, dtype=torch.float32, device=dev)
    experts = torch.empty(M, top_k, dtype=torch.int64, device=dev)
    scores = torch.empty(M, E, dtype=torch.float32, device=dev)
    cutoff = torch.empty(M, dtype=torch.float32, device=dev)
    block_m, block_e, warps = _tiles(E)
    block_k = max(2, triton.next_power_of_2(top_k))
    _route_fwd_kernel[(triton.cdiv(M, block_m),)](logits, bias, weights, experts, scores, cutoff, M, E,
                                                 logits.stride(0), logits.stride(1), scaling, K=top_k,
                                                 BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=block_k,
                                                 num_warps=warps)
    return weights, experts, scores, cutoff


def route_backward(dweights: torch.Tensor, experts: torch.Tensor, scores: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """dweights [M, k] (any float dtype and strides), experts [M, k] int64 and scores [M, E] fp32
    (contiguous, from ``route_forward``) → dlogits [M, E] fp32."""
    M, E = scores.shape
    dlogits = torch.empty(M, E, dtype=torch.float32, device=scores.device)
    block_m, block_e, warps = _tiles(E)
    _route_bwd_kernel[(triton.cdiv(M, block_m),)](dweights, experts, scores, dlogits, M, E, dweights.stride(0),
                                                 dweights.stride(1), scaling, K=experts.shape[1],
                                                 BLOCK_M=block_m, BLOCK_E=block_e, num_warps=warps)
    return dlogits
