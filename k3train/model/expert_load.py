"""Expert load of one MoE layer over the micro-batches of a step, kept on the device.

    tokens[e]  = Σ_micro-batches  #{(i, j): expert_ij = e}       step-pooled tokens per expert
    worst      = max_micro-batches  max_e c_e / mean_e c_e        the worst single micro-batch
    computed   = Σ_micro-batches  rows this rank's expert GEMMs ran (differs from this rank's
                 routed copies under expert parallelism: what the EP balance figure compares)

The trainer pools ``tokens`` (sum) and ``worst`` (max) over data-parallel ranks and reports
max/mean of the pooled tokens per layer. Nothing here waits on the host.
"""

from __future__ import annotations

import torch


class ExpertLoad:
    def __init__(self):
        self.tokens: torch.Tensor | None = None  # [E] fp32
        self.worst: torch.Tensor | None = None  # [] fp32
        self.computed = 0

    @torch.no_grad()
    def add(self, tokens_per_expert: torch.Tensor) -> None:
        """Count one micro-batch's routed token copies [E]."""
        counts = tokens_per_expert.float()
        ratio = counts.max() / counts.mean().clamp(min=1e-9)
        if self.tokens is None:
            self.tokens, self.worst = counts.clone(), ratio
        else:
            self.tokens += counts
            self.worst = torch.maximum(self.worst, ratio)

    def reset(self) -> None:
        self.tokens = self.worst = None
        self.computed = 0
