"""The per-head maximum attention logit over the allowed (query, key) pairs: what QK-clip reads from
every MLA layer each training step (math in ``reference.py``)::

    m = max_logit(q, k, q_doc, k_doc, q_pos, scale, heads=None)
    # q [B, H, Tq, D], k [B, H, Tk, D], q_doc [B, Tq], k_doc [B, Tk], q_pos [Tq] → m [H] fp32

Key j is allowed to query i of row b when j ≤ q_pos[i] and q_doc[b, i] = k_doc[b, j] (causal within a
document; under context parallelism the queries are a shard of the row and q_pos their positions in it).
``heads`` [H] bool, a device tensor: only those heads are computed, the others are −inf (the Triton
kernel's programs of the others read no key; QK-clip asks only for heads whose log-sum-exp bound does not
already keep them under τ). No gradient. ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise; also ``"torch"`` wherever the kernel
  does not apply: a head dim that is not a sum of at most three powers of two ≥ 16 (``feature_pieces``),
  a scale ≤ 0, or no query or key;
* ``"triton"``: ``triton_max_logit.py``: one launch; the logits never leave the program. Eagerly a
  direct launch, under ``torch.compile`` the ``torch.library`` custom op ``k3::max_logit``
  (``backend.eager_or_compiled``);
* ``"torch"``: ``reference.max_logit``: an fp32 einsum of blocks of query rows against every key, then
  the mask. On the GPU that is about 0.4 TFLOP a layer at bench-1B's 8×4096 tokens on fp32 SIMT
  GEMMs, the bulk of the trainer's ~40 ms a step over ``benchmarks/train_step.py`` with AdamW (the
  trainer's Muon recipe turns QK-clip on).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["max_logit"]


def feature_pieces(d: int) -> tuple[int, int, int] | None:
    """The head dim D as up to three powers of two ≥ 16, largest first, zeros for absent pieces (192 →
    (128, 64, 0)): the Triton kernel's dots. None when D is no such sum (then the torch path runs)."""
    bits = [1 << i for i in range(d.bit_length() - 1, -1, -1) if d >> i & 1]
    if not bits or bits[-1] < 16 or len(bits) > 3:
        return None
    return tuple(bits + [0] * (3 - len(bits)))


def _triton(q, k, q_doc, k_doc, q_pos, scale, heads):
    from .triton_max_logit import max_logit as triton_max_logit
    return triton_max_logit(q, k, q_doc, k_doc, q_pos, scale, heads)


@torch.library.custom_op("k3::max_logit", mutates_args=())
def _max_logit_op(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor,
                  scale: float, heads: Optional[torch.Tensor]) -> torch.Tensor:
    return _triton(q, k, q_doc, k_doc, q_pos, scale, heads)


@_max_logit_op.register_fake
def _max_logit_op_fake(q, k, q_doc, k_doc, q_pos, scale, heads):
    return q.new_empty(q.shape[1], dtype=torch.float32)


_max_logit = eager_or_compiled(_triton, _max_logit_op)


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor,
              scale: float, heads: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """[H] fp32: max over allowed pairs of scale · q·k per head (module docstring); −inf where none is
    and for heads outside ``heads``."""
    B, H, Tq, D = q.shape
    if k.dim() != 4 or k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} must be [B, H, Tk, D] = [{B}, {H}, Tk, {D}] for q {tuple(q.shape)}")
    Tk = k.shape[2]
    if q_doc.shape != (B, Tq) or k_doc.shape != (B, Tk) or q_pos.shape != (Tq,):
        raise ValueError(f"q_doc {tuple(q_doc.shape)}, k_doc {tuple(k_doc.shape)}, q_pos {tuple(q_pos.shape)} must be "
                         f"[{B}, {Tq}], [{B}, {Tk}], [{Tq}]")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if heads is not None and (heads.shape != (H,) or heads.dtype != torch.bool):
        raise ValueError(f"heads must be a bool mask [{H}], got {heads.dtype} {tuple(heads.shape)}")
    if use_triton(q, backend, "max_logit") and Tq > 0 and Tk > 0 and scale > 0 and feature_pieces(D) is not None:
        q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
        return _max_logit(q, k, q_doc.contiguous(), k_doc.contiguous(), q_pos.contiguous(), float(scale),
                          None if heads is None else heads.contiguous())
    best = reference.max_logit(q, k, q_doc, k_doc, q_pos, scale)
    return best if heads is None else best.masked_fill(~heads, float("-inf"))
