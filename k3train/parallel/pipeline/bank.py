"""Block AttnRes across pipeline stages: which bank rows cross each hop, and the rows a stage holds.

Layer l writes bank row l // S when l % S == 0 (K3_SPEC §2.1), so chunk c creates the rows of its
block-write layers. Every later layer reads every row, so every later chunk needs all of them. A
stage keeps the rows it has seen (created or received) for the whole micro-batch, across its
virtual stages; on the hop c → c+1 the receiving stage p' = (c+1) mod P has seen everything up to
its previous chunk c+1−P, so the hop carries P and only the rows created in chunks c+2−P … c
(AttnRes paper §4.1, cross-stage caching). The whole-bank send carries every row created in 0 … c.

Per micro-batch and hop the message is [1 + rows, b, t, d] fp32: P first, then the rows by index.
The backward mirrors it: the hop c+1 → c returns the gradients of exactly those tensors. A row's
gradient accumulates on each stage over all of its chunks that read it (``RowCache``) plus what the
next stage returned for it, and goes back once, on the hop where the row came in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3train.parallel.pipeline.layout import Chunk


@dataclass(frozen=True)
class BankPlan:
    created: list[list[int]]  # rows written in chunk c
    before: list[list[int]]  # rows that exist when chunk c starts
    sent: list[list[int]]  # rows sent on the hop c → c+1 (new to the receiving stage)
    whole: list[list[int]]  # rows the whole-bank send would carry on that hop

    @classmethod
    def build(cls, chunks: list[Chunk], pipeline: int, block_size: int) -> "BankPlan":
        created = [[l // block_size for l in c.layers if l % block_size == 0] for c in chunks]
        before, sent, whole, seen = [], [], [], []
        for c in range(len(chunks)):
            before.append(list(seen))
            seen += created[c]
            sent.append([j for k in range(max(0, c + 2 - pipeline), c + 1) for j in created[k]])
            whole.append(list(seen))
        return cls(created, before, sent, whole)

    def hop_rows(self) -> tuple[int, int]:
        """Rows sent per micro-batch over all forward hops: (cached plan, whole bank)."""
        hops = range(len(self.sent) - 1)
        return sum(len(self.sent[c]) for c in hops), sum(len(self.whole[c]) for c in hops)

    def hop_bytes(self, tokens: int, hidden: int) -> tuple[int, int]:
        """Forward bytes per micro-batch of ``tokens`` tokens (P and rows fp32): (cached, whole bank).
        The backward sends the same again."""
        hops = len(self.sent) - 1
        sent, whole = self.hop_rows()
        per_row = tokens * hidden * 4
        return (hops + sent) * per_row, (hops + whole) * per_row


class RowCache:
    """The bank rows one stage holds for one micro-batch: row index → fp32 leaf [b, t, d].

    Each row is a detached leaf that every later chunk of this stage reads, so the gradients of
    all those chunks accumulate in its ``.grad``. Dropped when the micro-batch's first chunk on
    this stage has finished its backward."""

    def __init__(self):
        self.rows: dict[int, torch.Tensor] = {}

    def hold(self, index: int, value: torch.Tensor, grad: bool) -> torch.Tensor:
        leaf = value.detach().requires_grad_(grad)
        self.rows[index] = leaf
        return leaf

    def get(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.rows[j] for j in indices]

    def grad(self, index: int) -> torch.Tensor | None:
        return self.rows[index].grad

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        leaf = self.rows[index]
        leaf.grad = grad.clone() if leaf.grad is None else leaf.grad + grad
