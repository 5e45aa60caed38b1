"""Causal softmax attention within packed documents: MLA's core, o = softmax(q kᵀ · scale + M) v.

q [B, H, Tq, Dqk], k [B, H, Tk, Dqk], v [B, H, Tk, Dv] → o [B, H, Tq, Dv], where M lets query i see key
j only if j ≤ i (by position in the whole row) and both lie in one document. Three ways, chosen per
call by ``attend``:

- one document per row: ``scaled_dot_product_attention(is_causal=True)`` (cuDNN or flash attention on
  Hopper);
- packed documents with a ``BlockMask`` (CUDA): FlexAttention. ``document_block_mask`` builds it once
  per micro-batch from ``doc_ids`` and every MLA layer shares it; 128×128 tiles that no allowed pair
  falls in are skipped, so packed documents cost less than one causal row, where SDPA's dense mask
  costs more. Inductor generates the kernels: inlined into a compiled layer's graph
  (``train.compile``), or through the standalone compiled ``flex_attention`` when the layer is eager;
- otherwise (CPU, where FlexAttention has no backward, and context-parallel shards): SDPA with the
  dense bool mask [B, 1, Tq, Tk] (``allowed``).

``DOCUMENT_ATTENTION`` ("flex" or "sdpa") selects the way for packed documents on CUDA. It is "sdpa":
FlexAttention is 1.8x faster forward+backward at bench-1B shapes (``benchmarks/mla_attention.py``), but
the trainer's compiled bench-1B run with it spent seconds to a minute a step (recompiling, by every
sign: the block mask's function was a new closure every micro-batch, and torch.compile guards on the
function object). The mask function is now one object that reads the micro-batch's document ids from
``_DOCUMENT_IDS`` (each compiled call lifts them as a graph input, so a backward reads its own
batch's ids); that is not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

DOCUMENT_ATTENTION = "sdpa"
_compiled_flex = torch.compile(flex_attention, dynamic=False)  # compiled at its first call
_DOCUMENT_IDS: list[torch.Tensor] = []  # the document ids [B, T] of the latest block mask


def _causal_same_document(b, h, q_idx, kv_idx):
    doc_ids = _DOCUMENT_IDS[0]
    return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The causal-and-same-document mask of rows ``doc_ids`` [B, T] (int64, one id per document) as a
    FlexAttention block mask [B, 1 (all heads), T, T]; its mask function reads these ids until the
    next call."""
    B, T = doc_ids.shape
    _DOCUMENT_IDS[:] = [doc_ids]
    return create_block_mask(_causal_same_document, B, None, T, T, device=doc_ids.device, _compile=True)


def allowed(doc_ids: torch.Tensor, key_doc_ids: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """[B, Tq, Tk] bool: key j is visible to query i (at row position ``query_pos[i]``) — causal and in the
    same document. ``doc_ids`` [B, Tq] of the queries, ``key_doc_ids`` [B, Tk] of the keys."""
    key_pos = torch.arange(key_doc_ids.shape[1], device=doc_ids.device)
    return (key_pos[None, :] <= query_pos[:, None]) & (doc_ids[:, :, None] == key_doc_ids[:, None, :])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal_only: bool,
           block_mask: BlockMask | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """o [B, H, Tq, Dv] in v's dtype: causal (``causal_only``), else through ``block_mask`` when given,
    else through the bool ``mask`` [B, 1, Tq, Tk]."""
    if causal_only:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if block_mask is not None:
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex
        return flex(q, k, v, block_mask=block_mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
