"""Triton cross-entropy over one vocabulary shard: a statistics kernel and a gradient kernel.

logits z is [N, V_local] with unit column stride (row stride ``stride``); labels [N] are global ids,
``vocab_start`` the shard's first id (math in ``reference.py``):

* forward, one program a row (grid N): one pass over the row in BLOCK_V blocks with an online max,
  m ← max(m, max_block z), s ← s · exp(m_old − m) + Σ_block exp(z − m), and the owned target logit;
  writes m_r, s_r, zy_r, each fp32 [N]. The logits are read once; nothing [N, V] is written.
* backward, one program a row × BLOCK_V columns (grid N × ⌈V_local / BLOCK_V⌉):
  dz = g · (exp(z − lse) − [vocab_start + v == y]) stored in the logits' dtype, from one read of z.

Loads are cast to fp32, all math is fp32. On CPU the kernels run through Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# GPU blocks: forward BLOCK_V columns an iteration, backward BLOCK_V columns a program. Swept at 32768 × 163840
# bf16 on one H200 (benchmarks/cross_entropy.py --tiles): 7.98 ms fwd+bwd at 2048/2048/4 warps, 8.10-8.54 at
# 4096-16384; either way about 4 TB/s over the 32 GB the two kernels move.
# The interpreter takes small blocks so tests cover several blocks and a masked tail.
GPU_FWD, GPU_BWD, GPU_NUM_WARPS = 2048, 2048, 4
INTERPRET_BLOCK = 128


@triton.jit
def _ce_stats_kernel(Z, LABELS, M, S, ZY, stride, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        z = tl.load(base + v0 + cols, mask=v0 + cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    idx = tl.load(LABELS + row).to(tl.int64) - vocab_start
    owned = (idx >= 0) & (idx < V)
    zy = tl.load(base + idx, mask=owned, other=0.0).to(tl.float32)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(ZY + row, zy)


@triton.jit
def _ce_grad_kernel(Z, LABELS, LSE, G, DZ, stride, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z = tl.load(Z + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + row)
    g = tl.load(G + row)
    idx = tl.load(LABELS + row).to(tl.int64) - vocab_start
    p = tl.exp(z - lse) - tl.where(cols == idx, 1.0, 0.0)
    tl.store(DZ + row * V + cols, (g * p).to(DZ.dtype.element_ty), mask=mask)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_ce_stats_kernel, InterpretedFunction)


def _blocks(t: torch.Tensor) -> tuple[int, int, dict]:
    """(forward BLOCK_V, backward BLOCK_V, launch options) for logits t."""
    if t.is_cuda:
        return GPU_FWD, GPU_BWD, {"num_warps": GPU_NUM_WARPS}
    if interpreter_active():
        return INTERPRET_BLOCK, INTERPRET_BLOCK, {}
    raise RuntimeError("the Triton cross-entropy kernels got a CPU tensor, but Triton's interpreter is "
                       "off: set TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")


def ce_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V_local] (unit column stride), labels contiguous [N] → (m_r, s_r, zy_r) fp32 [N]."""
    N, V = logits.shape
    m, s, zy = (torch.empty(N, dtype=torch.float32, device=logits.device) for _ in range(3))
    if N:
        block, _, opts = _blocks(logits)
        _ce_stats_kernel[(N,)](logits, labels, m, s, zy, logits.stride(0), V, vocab_start,
                               BLOCK_V=block, **opts)
    return m, s, zy


def ce_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
            vocab_start: int, in_place: bool = False) -> torch.Tensor:
    """dz [N, V_local] (contiguous, logits' dtype) from lse and the loss gradient g, fp32 contiguous [N];
    ``in_place`` (contiguous logits): written over the logits (each program reads its block of z before it
    writes dz there, and reads nothing else of z), which saves an [N, V_local] allocation."""
    N, V = logits.shape
    if in_place and not logits.is_contiguous():
        raise ValueError("ce_grad: in_place needs contiguous logits (dz is written with row stride V)")
    dz = logits if in_place else torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if dz.numel():
        _, block, opts = _blocks(logits)
        _ce_grad_kernel[(N, triton.cdiv(V, block))](logits, labels, lse, grad, dz, logits.stride(0), V,
                                                   vocab_start, BLOCK_V=block, **opts)
    return dz
