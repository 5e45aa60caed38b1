"""Plain-torch cross-entropy over one vocabulary shard: the per-row statistics and the gradient.

logits z [N, V_local] are this rank's vocabulary slice [vocab_start, vocab_start + V_local); labels
y [N] are global vocabulary ids. Per row n::

    m_r   = max_v z[n, v]                       (local)
    s_r   = Σ_v exp(z[n, v] − m_r)              (local, relative to the local max)
    zy_r  = z[n, y − vocab_start] if this shard owns y, else 0

The caller combines over the shards: m = max_r m_r, s = Σ_r s_r · exp(m_r − m), z_y = Σ_r zy_r,
lse = m + log s, loss = lse − z_y, and the gradient of the shard is

    dz[n, v] = g[n] · (exp(z[n, v] − lse) − [vocab_start + v == y]).

Math is in fp32 (float64 inputs stay float64, for tests); dz in the logits' dtype.
"""

from __future__ import annotations

import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _local_target(labels: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local column of each label clamped into the shard [N], whether the shard owns it [N])."""
    idx = labels.long() - vocab_start
    owned = (idx >= 0) & (idx < v_local)
    return idx.clamp(0, v_local - 1), owned


def local_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V_local], labels [N] → (m_r, s_r, zy_r), each [N] in the compute dtype."""
    z = logits.to(_compute_dtype(logits))
    m = z.max(dim=1).values
    s = torch.exp(z - m[:, None]).sum(dim=1)
    idx, owned = _local_target(labels, vocab_start, z.shape[1])
    zy = torch.where(owned, z.gather(1, idx[:, None]).squeeze(1), 0.0)
    return m, s, zy


def local_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
               vocab_start: int = 0) -> torch.Tensor:
    """dz [N, V_local] in the logits' dtype from the global lse [N] and the loss gradient g [N]."""
    ct = _compute_dtype(logits)
    p = torch.exp(logits.to(ct) - lse.to(ct)[:, None])
    idx, owned = _local_target(labels, vocab_start, logits.shape[1])
    p.scatter_add_(1, idx[:, None], -owned.to(ct)[:, None])
    return (grad.to(ct)[:, None] * p).to(logits.dtype)
