"""Packed-sequence bookkeeping: where each document starts.

A row of ``position_ids`` [B, T] restarts at 0 at every document start (the data
pipeline resets positions after each EOD). From it we derive what each sequence
mixer needs so that no information crosses a document boundary:

- ``position_ids``: the short conv masks taps that reach before the document start;
- ``cu_seqlens`` [N+1] (int32, over the flattened B·T tokens): KDA resets its state (under context
  parallelism: over this rank's chunk rows, ``pieces``). For compiled layers (``bucket=True``) it is
  padded with empty documents at the end (repeats of B·T) to a power-of-two length, so that the
  graphs see a few lengths over a run, not one per document count (CUDA graph trees record a graph
  for every length they meet), and ``one_per_row`` is False even where every row is one document;
- ``doc_ids`` [B, T]: MLA allows attention only within one document (on CUDA, ``block_mask``: the same
  mask as FlexAttention's block mask, built once per micro-batch by the model).

Under context parallelism (``shard`` set) the tensors describe this rank's share of each row
(``k3train.parallel.context_shard``); ``query_index`` [T_local] gives each local token's position
in the whole row and ``key_doc_ids`` [B, T] the document ids of the whole rows (MLA's keys).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from k3train.parallel.context_parallel import ChunkPieces
from k3train.parallel.context_shard import ContextShard


@dataclass
class Documents:
    position_ids: torch.Tensor  # [B, T] int64, position within the document
    doc_ids: torch.Tensor  # [B, T] int64, document index (unique over the batch)
    cu_seqlens: torch.Tensor  # [N + 1] int32, document offsets in the flattened B*T tokens
    one_per_row: bool  # every row holds exactly one document (no mask needed beyond causal)
    shard: ContextShard | None = None  # context parallelism: this rank's share of the rows
    pieces: ChunkPieces | None = None  # its chunk rows cut at document starts (KDA's packing under CP)
    query_index: torch.Tensor | None = None  # [T_local] int64, position of each local token in the row
    key_doc_ids: torch.Tensor | None = None  # [B, T] int64, doc_ids of the whole rows
    block_mask: BlockMask | None = None  # FlexAttention's form of MLA's mask (packed rows on CUDA)
    offsets: tuple[int, ...] | None = None  # cu_seqlens's values, when they were counted on the host

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, bucket: bool = False) -> "Documents":
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
        starts = position_ids == 0
        starts[:, 0] = True  # a row always starts a (possibly continued) document
        flat = starts.flatten()
        doc_ids = flat.long().cumsum(0).view_as(position_ids) - 1
        offsets = flat.nonzero().flatten().to(torch.int32)
        total = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
        # Compiled layers (bucket) take every batch as packed, so that a batch whose rows hold one
        # document each does not switch them to another graph (a re-compile of every layer).
        one_per_row = not bucket and bool(offsets.numel() == position_ids.shape[0])
        if bucket:
            total = total.expand(bucketed_length(offsets.numel() + 1) - offsets.numel())
        cu_seqlens = torch.cat([offsets, total])
        # The document count varies from batch to batch: compiled layers (train.compile) take it as a
        # symbolic size instead of recompiling for each count.
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        host_offsets = None if cu_seqlens.is_cuda else tuple(cu_seqlens.tolist())  # on the host: no read-back
        return cls(position_ids=position_ids, doc_ids=doc_ids, cu_seqlens=cu_seqlens, one_per_row=one_per_row,
                   offsets=host_offsets)

    def to(self, device: torch.device) -> "Documents":
        """These documents on ``device`` (built from a host batch): to a GPU through pinned memory,
        queued behind the stream's work, so the host does not wait. Not for context-parallel shards."""
        if self.shard is not None:
            raise ValueError("Documents.to: context-parallel documents are built on the device (for_shard)")

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

        cu_seqlens = move(self.cu_seqlens)
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)  # as from_position_ids marks it
        return dataclasses.replace(self, position_ids=move(self.position_ids), doc_ids=move(self.doc_ids),
                                   cu_seqlens=cu_seqlens)

    @classmethod
    def for_shard(cls, position_ids: torch.Tensor, shard: ContextShard) -> "Documents":
        """The documents of this CP rank's share [B, T/C] of rows whose other chunks are elsewhere."""
        whole = cls.from_position_ids(shard.gather_sequence(position_ids))
        index = shard.global_index(position_ids.shape[1], position_ids.device)
        pieces = ChunkPieces.from_position_ids(position_ids)
        return cls(position_ids=position_ids, doc_ids=whole.doc_ids[:, index], cu_seqlens=pieces.cu_seqlens,
                   one_per_row=whole.one_per_row, shard=shard, pieces=pieces, query_index=index,
                   key_doc_ids=whole.doc_ids)

    @classmethod
    def single(cls, batch: int, seq: int, device: torch.device | str = "cpu") -> "Documents":
        """One document per row, built from the shapes alone (``from_position_ids`` reads the document
        count back from the device: a host sync)."""
        position_ids = torch.arange(seq, device=device).expand(batch, seq)
        doc_ids = torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq)
        cu_seqlens = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq
        return cls(position_ids=position_ids, doc_ids=doc_ids, cu_seqlens=cu_seqlens, one_per_row=True)


MIN_BUCKET = 16  # the shortest padded cu_seqlens


def bucketed_length(n: int) -> int:
    """The padded length of a cu_seqlens of ``n`` entries: the next power of two, at least ``MIN_BUCKET``."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())
