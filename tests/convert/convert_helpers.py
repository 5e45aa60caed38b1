"""Helpers of the conversion tests: a random k3_tiny model saved as one of our checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from k3train.config.schema import ModelConfig
from k3train.convert.dist_checkpoint import write_model_checkpoint
from k3train.model.k3 import K3Model
from k3train.model.roles import get_role, interleave_rows


def random_tiny(seed: int, bf16_values: bool = True, mxfp4_experts: bool = False) -> K3Model:
    """k3_tiny with every tensor random (AttnRes queries, A_log and router biases included, never
    their zero init). ``bf16_values``: weights hold bf16-representable values (what a bf16 export
    keeps exactly); ``mxfp4_experts``: routed experts hold MXFP4-representable values (QAT-trained)."""
    torch.manual_seed(seed)
    model = K3Model(ModelConfig(), linear_backend="torch")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith(("_res.proj", ".A_log", ".e_score_correction_bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(("norm", "norm.weight")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif t.dim() >= 2:  # a row-interleaved stack (w13) drawn matrix by matrix, as HF holds it (w1, w3)
                s = getattr(get_role(t), "row_interleave", 1)
                drawn = torch.randn(*t.shape[:-2], s, t.shape[-2] // s, t.shape[-1], generator=g)
                t.copy_(interleave_rows(drawn) * 0.2 / t.shape[-1] ** 0.5)
            if bf16_values and not name.endswith(("conv1d", "A_log", "dt_bias", "o_norm", "correction_bias")):
                t.copy_(t.bfloat16().float())
            if mxfp4_experts and name.endswith((".experts.w13", ".experts.w2")):  # MXFP4 blocks run along rows
                from k3train.convert.mxfp4 import pack_mxfp4, unpack_mxfp4

                rows = t.view(-1, t.shape[-1])
                rows.copy_(unpack_mxfp4(*pack_mxfp4(rows, backend="torch"), dtype=torch.float32, backend="torch"))
    return model.eval()


def save_model(model: K3Model, out: Path) -> Path:
    """``model`` as a weights-only checkpoint of ours (the format training writes, global shapes)."""
    tensors = {n: (tuple(t.shape), t.dtype, lambda t=t: t.detach().clone()) for n, t in model.state_dict().items()}
    write_model_checkpoint(out, model.cfg, tensors)
    return out


def packed_batch(seed: int, batch: int = 2, seq: int = 24, vocab: int = 512):
    """Random tokens [B, T] and position_ids that restart at random document starts in row 1."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.arange(seq).repeat(batch, 1)
    if batch > 1:
        cuts = sorted(torch.randperm(seq - 2, generator=g)[:2].add(1).tolist())
        start = 0
        for c in cuts + [seq]:
            pos[1, start:c] = torch.arange(c - start)
            start = c
    return tokens, pos
