"""One pipeline stage's part of ``K3Model``: the model stays plain, the split is applied from outside.

Every rank builds the whole model with the same seed (so the initial weights equal one rank's at
any layout, as under tensor parallelism) and then drops what it does not run: the layers of other
stages become parameterless placeholders, so the kept parameters keep their global names
(``layers.{i}.…``) and checkpoints reshard across pipeline sizes. The first chunk's stage keeps the
embedding, the last chunk's the output AttnRes, final norm and LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.model.documents import Documents
from k3train.model.k3 import K3Model
from k3train.parallel.pipeline.layout import Chunk


class OnAnotherStage(nn.Module):
    """Stands in for layer ``layer_idx``, which another pipeline stage holds."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, *args):
        raise RuntimeError(f"layer {self.layer_idx} runs on another pipeline stage")


def keep_stage(model: K3Model, chunks: list[Chunk], stage: int) -> K3Model:
    """Drop from ``model`` (in place) everything that pipeline stage ``stage`` does not run."""
    mine = [c for c in chunks if c.stage == stage]
    kept = {layer for c in mine for layer in c.layers}
    for i in range(len(model.layers)):
        if i not in kept:
            model.layers[i] = OnAnotherStage(i)
    if not any(c.first for c in mine):
        model.embed_tokens = None
    if not any(c.last for c in mine):
        model.output_attn_res = model.norm = model.lm_head = None
    return model


def run_chunk(model: K3Model, chunk: Chunk, docs: Documents, bank: list[torch.Tensor], partial: torch.Tensor
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The chunk's layers: (B, P) → (B', P'); B' = B plus the rows this chunk writes. Within the chunk a
    layer's FFN output is added to P by the next layer's first site; the chunk's last one is added here."""
    pending = None
    for layer in chunk.layers:
        bank, partial, pending = model.layers[layer](bank, partial, docs, pending)
    return bank, partial if pending is None else partial + pending
