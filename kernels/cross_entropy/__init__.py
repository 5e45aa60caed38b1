"""Per-token cross-entropy over vocabulary-sharded logits, without an fp32 copy of the logits.

    losses = cross_entropy(logits, labels, group=None, vocab_start=0, grad_into_logits=False)
    # [..., V_local], [...] → fp32 [...]

logits are this rank's slice [vocab_start, vocab_start + V_local) of the vocabulary (the whole
vocabulary when ``group`` is None); labels are global ids, each owned by exactly one rank of
``group``. Per row: m = max over the vocabulary, s = Σ exp(z − m), loss = log s + m − z_y, and
dz = g · (exp(z − m)/s − [v == y]) in the logits' dtype (math in ``reference.py``). Each rank
computes its local (m_r, s_r, zy_r) [N]; three [N] all-reduces over ``group`` (MAX of m, SUM of
s_r · exp(m_r − m), SUM of zy_r) combine them. Only the logits and the fp32 lse = m + log s [N]
are saved for backward. With ``grad_into_logits`` the Triton backward writes dz over the saved logits
(contiguous ones) instead of a new [N, V_local] tensor: the caller gives up the logits after the backward
(the model's loss head does: they are its own temporary), and the step's peak memory drops by their size
(at bench-1B's 16 × 4096 rows and 163,840 words: 21 GB). ``backend`` picks the local kernels:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: ``triton_cross_entropy.py`` (logits bf16, fp16 or fp32), one read of the logits
  forward and one read + one dz write backward; on CPU through Triton's interpreter;
* ``"torch"``: ``reference.local_stats`` / ``reference.local_grad`` (fp32 [N, V_local] temporaries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..backend import use_triton
from . import reference

__all__ = ["cross_entropy"]


def _combine(m: torch.Tensor, s: torch.Tensor, zy: torch.Tensor, group
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (m_r, s_r, zy_r) [N] → (lse, loss) [N] over ``group`` (None: this rank alone)."""
    if group is not None:
        m_r = m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = s * torch.exp(m_r - m)
        dist.all_reduce(s, group=group)
        dist.all_reduce(zy, group=group)
    lse = m + torch.log(s)
    return lse, lse - zy


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, triton_kernels, grad_into_logits):
        if triton_kernels:
            from .triton_cross_entropy import ce_stats
            m, s, zy = ce_stats(logits, labels, vocab_start)
        else:
            m, s, zy = reference.local_stats(logits, labels, vocab_start)
        lse, loss = _combine(m, s, zy, group)
        ctx.save_for_backward(logits, labels, lse)
        ctx.vocab_start, ctx.triton_kernels = vocab_start, triton_kernels
        ctx.in_place = grad_into_logits and logits.is_contiguous()
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        grad = grad_loss.to(lse.dtype).contiguous()
        if ctx.triton_kernels:
            from .triton_cross_entropy import ce_grad
            dz = ce_grad(logits, labels, lse, grad, ctx.vocab_start, in_place=ctx.in_place)
        else:
            dz = reference.local_grad(logits, labels, lse, grad, ctx.vocab_start)
        return dz, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None, vocab_start: int = 0,
                  backend: str = "auto", grad_into_logits: bool = False) -> torch.Tensor:
    """Per-token loss (fp32, labels' shape) from logits [..., V_local] and global labels [...];
    differentiable in the logits. ``grad_into_logits``: the backward may overwrite the logits with their
    gradient (module docstring)."""
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"cross entropy takes logits [..., V_local] and labels [...]; got "
                         f"{tuple(logits.shape)}, {tuple(labels.shape)}")
    triton_kernels = use_triton(logits, backend, "cross-entropy")
    z = logits.reshape(-1, logits.shape[-1])
    if z.stride(-1) != 1:
        z = z.contiguous()
    loss = _CrossEntropy.apply(z, labels.reshape(-1).contiguous(), int(vocab_start), group, triton_kernels,
                               grad_into_logits)
    return loss.view(labels.shape)
