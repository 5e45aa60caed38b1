"""Packed-sequence bookkeeping: where each document starts.

A row of ``position_ids`` [B, T] restarts at 0 at every document start (the data
pipeline resets positions after each EOD). From it we derive what each sequence
mixer needs so that no information crosses a document boundary:

- ``position_ids``: the short conv masks taps that reach before the document start;
- ``cu_seqlens`` [N+1] (int32, over the flattened B·T tokens): KDA resets its state;
- ``doc_ids`` [B, T]: MLA allows attention only within one document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Documents:
    position_ids: torch.Tensor  # [B, T] int64, position within the document
    doc_ids: torch.Tensor  # [B, T] int64, document index (unique over the batch)
    cu_seqlens: torch.Tensor  # [N + 1] int32, document offsets in the flattened B*T tokens
    one_per_row: bool  # every row holds exactly one document (no mask needed beyond causal)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "Documents":
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
        starts = position_ids == 0
        starts[:, 0] = True  # a row always starts a (possibly continued) document
        flat = starts.flatten()
        doc_ids = flat.long().cumsum(0).view_as(position_ids) - 1
        offsets = flat.nonzero().flatten().to(torch.int32)
        total = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
        cu_seqlens = torch.cat([offsets, total])
        one_per_row = bool(cu_seqlens.numel() - 1 == position_ids.shape[0])
        return cls(position_ids=position_ids, doc_ids=doc_ids, cu_seqlens=cu_seqlens, one_per_row=one_per_row)

    @classmethod
    def single(cls, batch: int, seq: int, device: torch.device | str = "cpu") -> "Documents":
        pos = torch.arange(seq, device=device).expand(batch, seq)
        return cls.from_position_ids(pos)
