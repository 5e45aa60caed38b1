"""Activation recompute (``train.recompute``; K3 report §5.2.2), applied to a built model from outside.

A recomputed module saves only its inputs in the forward; its backward runs the forward again to
rebuild the activations (``torch.utils.checkpoint``, non-reentrant). The policies are cumulative:

    none      nothing
    attn_res  every AttnRes site, x = RMSNorm(Agg(B ∪ [P])): the fp32 mix [B, T, d] and its fp32
              normalised copy (2 per site, 2 sites per layer plus the output one) are not kept
    kda       attn_res, plus every KDA token mixer (projections, short conv, recurrence, gate, o_proj)
    full      every whole decoder layer (its sites, mixer and FFN/MoE) and the output AttnRes site

The forward's side effects happen once per micro-batch: the replay runs inside
``k3train.model.replay.replay()``, where the MoE layers neither count expert load, nor observe for
Quantile Balancing, nor keep router inputs, and MLA does not track its max logit. The replay routes
as the original did (same inputs, weights and bias), so the gradients are those of ``none``.

The model stays plain: a recomputed module's ``forward`` is replaced on the instance, so parameter
names and state dicts are unchanged (hooks on a recomputed module run once; hooks on its submodules
run again in the replay). The replay runs the whole region (torch's early stop, once the last needed
activation is rebuilt, is off): every rank then makes all the collectives its forward made, in the
same order, whatever each rank saved (an expert-parallel rank without tokens saves less). Apply after
the pipeline split (placeholders of other stages' layers are skipped) and after QAT (the fake-quant
callables are read in each call).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from k3train.config.schema import RECOMPUTE_POLICIES
from k3train.model.attn_res import AttnResAggregator
from k3train.model.k3 import K3Model
from k3train.model.kda import KimiDeltaAttention
from k3train.model.layer import K3Layer
from k3train.model.replay import replay


def recomputed(forward: Callable) -> Callable:
    """``forward`` under activation checkpointing; its second call (the backward's) is a replay."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to replay
            return forward(*args, **kwargs)
        calls = 0

        def once_then_replay(*a, **k):
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*a, **k)
            with replay():
                return forward(*a, **k)

        with set_checkpoint_early_stop(False):
            return checkpoint(once_then_replay, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(model: K3Model, policy: str) -> list[str]:
    """Make the modules that ``policy`` names recompute in backward; returns their names."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"train.recompute={policy!r}: use one of {', '.join(RECOMPUTE_POLICIES)}")
    kinds = {"none": (), "attn_res": (AttnResAggregator,), "kda": (AttnResAggregator, KimiDeltaAttention),
             "full": (K3Layer,)}[policy]
    names = []
    for name, module in model.named_modules():
        if isinstance(module, kinds) or (policy == "full" and name == "output_attn_res"):
            module.forward = recomputed(module.forward)
            names.append(name)
    return names
