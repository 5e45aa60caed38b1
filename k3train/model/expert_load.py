"""Expert load of one MoE layer over the micro-batches of a step, kept on the device.

    tokens[e]  = Σ_micro-batches  #{(i, j): expert_ij = e}       step-pooled tokens per expert
    worst      = max_micro-batches  max_e c_e / mean_e c_e        the worst single micro-batch
    computed   = Σ_micro-batches  rows this rank's expert GEMMs ran (differs from this rank's
                 routed copies under expert parallelism: what the EP balance figure compares)

The trainer pools ``tokens`` (sum) and ``worst`` (max) over data-parallel ranks and reports
max/mean of the pooled tokens per layer. Nothing here waits on the host. ``tokens`` and ``worst``
are non-persistent buffers (they move with the model and stay out of checkpoints), added to in
place and zeroed by ``reset``, so that a compiled forward finds the same Python state every
micro-batch. ``computed`` is a Python int (the rows are a shape), counted eagerly only: it is read
under expert parallelism only, which ``train.compile`` excludes, and an int attribute written
inside a compiled graph would be guarded on (a recompile per micro-batch).
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertLoad(nn.Module):
    def __init__(self, num_experts: int):
        super().__init__()
        self.register_buffer("tokens", torch.zeros(num_experts), persistent=False)  # [E] fp32
        self.register_buffer("worst", torch.zeros(()), persistent=False)  # [] fp32
        self.computed = 0  # rows

    @torch.no_grad()
    def add(self, tokens_per_expert: torch.Tensor, copies: int, rows: int) -> None:
        """Count one micro-batch's routed token copies [E] (``copies`` = N·k of them: their mean per
        expert is copies / E, known on the host) and the ``rows`` its expert GEMMs ran. Four small
        kernels: the add, the max, its scaling by E / copies, the maximum into ``worst``."""
        self.tokens += tokens_per_expert  # int64 counts added into fp32 (exact below 2^24 per expert)
        if copies:
            torch.maximum(self.worst, tokens_per_expert.max() * (tokens_per_expert.numel() / copies), out=self.worst)
        if not torch.compiler.is_compiling():
            self.computed += rows

    def reset(self) -> None:
        self.tokens.zero_()
        self.worst.zero_()
        self.computed = 0
