"""Causal softmax attention within packed documents: MLA's core, o = softmax(q kᵀ · scale + M) v.

q [B, H, Tq, Dqk], k [B, H, Tk, Dqk], v [B, H, Tk, Dv] → o [B, H, Tq, Dv], where M lets query i see key
j only if j ≤ i (by position in the whole row) and both lie in one document. ``attend`` picks one of
four ways from the micro-batch's ``Documents``:

- one document per row: ``scaled_dot_product_attention(is_causal=True)`` (cuDNN or flash attention on
  Hopper);
- ``"flex"`` (packed rows on CUDA, ``docs.block_mask`` set by the model): FlexAttention with the
  document block mask ``document_block_mask`` builds once per micro-batch; 128×128 tiles that no
  allowed pair falls in are skipped. Inductor generates the kernels: inlined into a compiled layer's
  graph (``train.compile``), or through the standalone compiled ``flex_attention`` when the layer is
  eager;
- ``"flash"`` (packed bf16/fp16 rows on CUDA): each document as its own causal sequence through flash
  attention's variable-length kernels (``aten._flash_attention_forward`` with ``cu_seqlens``; its autograd
  formula gives the backward): work in Σ len², no mask. Flash attention takes one head dim for q, k and v, so v
  is zero-padded from Dv to Dqk and the output cut back;
- otherwise (``"sdpa"``, CPU, where FlexAttention has no backward, fp32 rows, which flash attention does
  not take, and context-parallel shards): SDPA with the dense bool mask [B, 1, Tq, Tk] (``allowed``),
  which costs a full T² row.

``attend_with_lse_bound`` also returns each head's largest softmax log-sum-exp, an upper bound on its max
logit that QK-clip reads instead of the exact maximum where it is under τ (``GatedMLA``).

``DOCUMENT_ATTENTION`` selects the way for packed rows on CUDA; it is "flash". Measured end to end on one
H200 (bench-1B, 8×4096 rows packed with documents of mean length 1024, compiled with CUDA graphs, AdamW,
``benchmarks/train_step.py --mean-doc 1024``, 2026-12-01): 239.3 ms a step with "flash" against 269.4 ms
with the dense mask ("sdpa"), and 237.7 ms with one document a row. FlexAttention: 1.49 ms
forward+backward at 2×4096 against the dense mask's 2.72 ms (``benchmarks/mla_attention.py``), but the
trainer's compiled bench-1B run with it took 1.5 s, then 67 s a step: graphs recorded and compiled again,
for a reason not found (not the mask function being a new closure each micro-batch: a compiled
FlexAttention call does not recompile for that, tests/model/test_document_attention.py). cuDNN's ragged
kernels (``aten._cudnn_attention_forward`` with ``cu_seqlens``, torch 2.11) were tried and dropped: 55 ms
forward at these shapes and a wrong dq in the backward (docs/operating.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from k3train.model.documents import Documents

DOCUMENT_ATTENTION = "flash"  # "flash" | "flex" | "sdpa": packed rows on CUDA
WAYS = ("sdpa", "flex", "flash")
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash attention's kernels; fp32 rows take SDPA's dense mask
_compiled_flex = torch.compile(flex_attention, dynamic=False)  # compiled at its first call


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The causal-and-same-document mask of rows ``doc_ids`` [B, T] (int64, one id per document) as a
    FlexAttention block mask [B, 1 (all heads), T, T]; built by a compiled function on CUDA."""
    B, T = doc_ids.shape

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(causal_same_document, B, None, T, T, device=doc_ids.device, _compile=doc_ids.is_cuda)


def allowed(doc_ids: torch.Tensor, key_doc_ids: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """[B, Tq, Tk] bool: key j is visible to query i (at row position ``query_pos[i]``) — causal and in the
    same document. ``doc_ids`` [B, Tq] of the queries, ``key_doc_ids`` [B, Tk] of the keys."""
    key_pos = torch.arange(key_doc_ids.shape[1], device=doc_ids.device)
    return (key_pos[None, :] <= query_pos[:, None]) & (doc_ids[:, :, None] == key_doc_ids[:, None, :])


def flash_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each document of the flattened rows: q, k [B, H, T, Dqk], v [B, H, T, Dv]
    (Dv ≤ Dqk), ``cu_seqlens`` [N+1] int32 offsets over the B·T tokens (empty documents at the end
    allowed) → (o [B, H, T, Dv], the kernel's softmax log-sum-exp, fp32 with heads on dim 0). No
    document is longer than a row, so T bounds every length."""
    B, H, T, d_qk = q.shape
    d_v = v.shape[-1]

    def tokens_heads(x):  # [B, H, T, D] → [B·T, H, D] (a view when x came from [B, T, H, D])
        return x.transpose(1, 2).reshape(B * T, H, x.shape[-1])

    v_padded = F.pad(v, (0, d_qk - d_v))
    cu = cu_seqlens.to(torch.int32)
    o, lse = torch.ops.aten._flash_attention_forward(tokens_heads(q), tokens_heads(k), tokens_heads(v_padded), cu, cu,
                                                     T, T, 0.0, True, False, scale=scale)[:2]
    return o[..., :d_v].view(B, T, H, d_v).transpose(1, 2), lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: Documents,
           dense_mask: Callable[[], torch.Tensor]) -> torch.Tensor:
    """o [B, H, Tq, Dv] in v's dtype, the way the module docstring gives; ``dense_mask()`` builds the
    bool mask [B, 1, Tq, Tk] when SDPA needs it."""
    if docs.one_per_row and docs.shard is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if docs.block_mask is not None:
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex
        return flex(q, k, v, block_mask=docs.block_mask, scale=scale)
    if _takes_flash(q, docs):
        return flash_varlen_causal(q, k, v, docs.cu_seqlens, scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(), scale=scale)


def attend_with_lse_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: Documents,
                          dense_mask: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attend``'s o, with each head's largest softmax log-sum-exp where the way's kernel computes one:
    bound [H] fp32, detached, else None. For every query row i, L_i = log Σ_j exp(s_ij) over its allowed
    keys, so m_i ≤ L_i ≤ m_i + log n_i (m_i its largest logit, n_i ≤ T its key count), and the head's
    max logit m_h ≤ max_i L_i ≤ m_h + log T: QK-clip needs no exact maximum for a head whose bound is
    already under τ. Ways with a bound: one document a row on CUDA in bf16/fp16 (cuDNN's fused attention,
    ``aten._scaled_dot_product_cudnn_attention``, what SDPA picks there on Hopper; sm80 and later), and
    "flash"."""
    if docs.one_per_row and docs.shard is None and q.is_cuda and q.dtype in FLASH_DTYPES:
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                    scale=scale)[:2]
        return o, lse_head_max(lse)
    if docs.block_mask is None and _takes_flash(q, docs):
        o, lse = flash_varlen_causal(q, k, v, docs.cu_seqlens, scale)
        return o, lse_head_max(lse)
    return attend(q, k, v, scale, docs, dense_mask), None


def lse_head_max(lse: torch.Tensor) -> torch.Tensor:
    """[H] fp32: the largest entry per head of a kernel's log-sum-exp, [H, tokens] (flash attention's
    variable-length layout) or [B, H, T, ...] (cuDNN's, flash attention's padded one). Padding entries a
    kernel leaves unwritten can only raise the maximum, so it stays an upper bound; NaN becomes +inf
    (no bound)."""
    lse = lse.detach().float()
    head_dim = 0 if lse.dim() == 2 else 1
    per_head = lse.amax(dim=[d for d in range(lse.dim()) if d != head_dim])
    return torch.where(per_head.isnan(), float("inf"), per_head)


def _takes_flash(q: torch.Tensor, docs: Documents) -> bool:
    return DOCUMENT_ATTENTION == "flash" and q.is_cuda and docs.shard is None and q.dtype in FLASH_DTYPES
