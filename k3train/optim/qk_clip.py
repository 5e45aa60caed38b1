"""QK-Clip (Kimi K2, arXiv 2507.20534) for K3's gated NoPE MLA layers.

After an optimizer step, for every MLA head h whose largest pre-softmax logit since the
last clip, S_h = max q·k / sqrt(nope + rope), exceeds tau:

    eta_h = min(1, tau / S_h)
    q_b_proj rows of head h, nope part  *= sqrt(eta_h)
    q_b_proj rows of head h, "rope" part *= eta_h      (it meets the shared k_r)
    kv_b_proj rows of head h, k_nope part *= sqrt(eta_h)

so every logit of head h is multiplied by exactly eta_h (q_nope·k_nope gets
sqrt·sqrt, q_rope·k_r gets eta·1) and the new maximum is tau. The shared k_r rows of
``kv_a_proj`` and the v rows of ``kv_b_proj`` are never touched. Heads at or under tau
are not touched at all.

The forward (``GatedMLA`` with ``track_max_logit = True``) keeps a running per-head max
in the fp32 buffer ``max_logit`` [local heads]; this function all-reduces it with MAX
over the data-parallel group (one collective for all layers), clips, and resets it to
-inf. Under TP each rank owns whole heads, so it clips only its own heads; no TP
communication is needed.

The clip scales the main weights (``k3train.precision.main_params.main_param``); under bf16
parameters the caller then refreshes the model's compute copies (``MainParams.sync_model``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3train.precision.main_params import main_param

_REQUIRED = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_b_proj", "kv_b_proj", "max_logit")


def _gated_mla_class():
    try:
        from k3train.model.mla import GatedMLA  # noqa: PLC0415 - the model may not exist yet
    except Exception:  # ImportError, or megatron missing on a benchmark machine
        return None
    return GatedMLA


def find_mla_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every GatedMLA in ``model`` (or a module with the same QK-clip attributes)."""
    cls = _gated_mla_class()
    out = []
    for name, mod in model.named_modules():
        if (cls is not None and isinstance(mod, cls)) or all(hasattr(mod, a) for a in _REQUIRED):
            out.append((name, mod))
    return out


@torch.no_grad()
def apply_qk_clip(model: nn.Module, tau: Optional[float], group=None) -> dict[str, Any]:
    """Clip the q/k weights of every MLA head whose tracked max logit exceeds ``tau``.

    ``group``: the data-parallel process group over which the per-head max is
    all-reduced (MAX) first; None for no reduction. ``tau=None`` only resets the
    trackers. Returns a report: ``max_logit`` (largest over all heads, after the
    reduction), ``num_clipped_heads``, ``min_eta``, ``clipped`` {module name: [local
    head indices]}, ``nonfinite`` {module name: [heads]} (NaN/+inf maxima are reported
    and left unclipped; -inf means no logits were tracked).
    """
    mods = find_mla_modules(model)
    report: dict[str, Any] = {"max_logit": float("-inf"), "num_clipped_heads": 0, "min_eta": 1.0, "clipped": {}, "nonfinite": {}}
    if not mods:
        return report
    flat = torch.cat([m.max_logit.detach().float().reshape(-1) for _, m in mods])
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl" and not flat.is_cuda:
            flat = flat.cuda()
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    flat = flat.cpu()
    finite = flat[torch.isfinite(flat)]
    if finite.numel():
        report["max_logit"] = float(finite.max())
    off = 0
    for name, m in mods:
        H = int(m.num_heads)
        smax = flat[off : off + H]
        off += H
        if smax.numel() != H:
            raise ValueError(f"QK-clip: module '{name}' has max_logit of {smax.numel()} entries for {H} heads")
        bad = torch.isnan(smax) | (smax == float("inf"))
        if bad.any():
            report["nonfinite"][name] = bad.nonzero().flatten().tolist()
        if tau is not None:
            if tau <= 0:
                raise ValueError(f"QK-clip tau must be positive, got {tau}")
            over = (~bad) & torch.isfinite(smax) & (smax > tau)
            if over.any():
                eta = torch.where(over, tau / smax.clamp_min(1e-30), torch.ones_like(smax))
                _scale_heads(m, eta)
                heads = over.nonzero().flatten().tolist()
                report["clipped"][name] = heads
                report["num_clipped_heads"] += len(heads)
                report["min_eta"] = min(report["min_eta"], float(eta.min()))
        m.max_logit.fill_(float("-inf"))
    return report


def _scale_heads(m: nn.Module, eta: torch.Tensor) -> None:
    """Scale head-specific q/k rows by per-head eta (see the module docstring)."""
    dn, dr, dv = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim)
    H = eta.numel()
    sq = eta.sqrt()
    wq = main_param(m.q_b_proj.weight)
    wkv = main_param(m.kv_b_proj.weight)
    if wq.shape[0] != H * (dn + dr):
        raise ValueError(f"QK-clip: q_b_proj has {wq.shape[0]} rows, expected {H}*({dn}+{dr})")
    if wkv.shape[0] != H * (dn + dv):
        raise ValueError(f"QK-clip: kv_b_proj has {wkv.shape[0]} rows, expected {H}*({dn}+{dv})")
    q_scale = torch.cat([sq[:, None].expand(H, dn), eta[:, None].expand(H, dr)], dim=1).reshape(-1)
    kv_scale = torch.cat([sq[:, None].expand(H, dn), torch.ones(H, dv)], dim=1).reshape(-1)
    wq.mul_(q_scale.to(wq.device, wq.dtype)[:, None])
    wkv.mul_(kv_scale.to(wkv.device, wkv.dtype)[:, None])


def qk_clip_eta(max_logit: float, tau: float) -> float:
    """K2's per-head factor eta = min(1, tau / S_max)."""
    return 1.0 if not math.isfinite(max_logit) or max_logit <= tau else tau / max_logit
