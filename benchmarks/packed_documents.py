"""Rows of packed documents for the benchmarks: position_ids that restart at every document start."""

from __future__ import annotations

import torch


def packed_position_ids(batch: int, seq: int, mean_doc: float, seed: int = 0) -> torch.Tensor:
    """position_ids [batch, seq] int64 of rows filled with documents whose lengths are drawn from an
    exponential distribution of mean ``mean_doc`` tokens (at least 1; the last one cut at the row end)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        pos, left = [], seq
        while left:
            n = min(left, max(1, int(torch.empty(1).exponential_(1 / mean_doc, generator=g))))
            pos.append(torch.arange(n))
            left -= n
        rows.append(torch.cat(pos))
    return torch.stack(rows)
