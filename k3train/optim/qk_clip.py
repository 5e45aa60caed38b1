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
are multiplied by exactly 1, i.e. left as they were bit for bit (the clip runs on the
device for every head, so that the step never waits on the host for it).

The forward (``GatedMLA`` with ``track_max_logit = True``) keeps a running per-head max
in the fp32 buffer ``max_logit`` [local heads] (for a head whose attention log-sum-exp bound
stays under tau, that bound: at most log T over the exact maximum, and still under tau, so
nothing is clipped; the reported maximum is then an upper bound); this function all-reduces it with MAX
over the data-parallel group (one collective for all layers), clips, and resets it to
-inf. Under TP each rank owns whole heads, so it clips only its own heads; no TP
communication is needed.

The clip scales the main weights (``k3train.precision.main_params.main_param``); under bf16
parameters the caller then refreshes the model's compute copies (``MainParams.sync_model``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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


class QKClipReport(Mapping):
    """What ``apply_qk_clip`` did, as a read-only mapping: ``max_logit`` (largest finite maximum over all
    heads, after the reduction; -inf when nothing was tracked), ``num_clipped_heads``, ``min_eta``,
    ``clipped`` {module name: [local head indices]} and ``nonfinite`` {module name: [heads]} (NaN/+inf
    maxima, reported and left unclipped). The figures stay on the device until the first key is read:
    reading them waits for the GPU, so the trainer reads them only on the steps it logs."""

    def __init__(self, names: list[str], maxima: torch.Tensor, over: torch.Tensor, eta: torch.Tensor,
                 heads: list[int]):
        self._names, self._heads = names, heads
        self._device = (maxima, over, eta)  # [total local heads] each
        self._host: Optional[dict[str, Any]] = None

    def _read(self) -> dict[str, Any]:
        if self._host is None:
            maxima, over, eta = torch.stack([t.float() for t in self._device]).cpu()
            finite = maxima[torch.isfinite(maxima)]
            bad = torch.isnan(maxima) | (maxima == float("inf"))
            out: dict[str, Any] = {"max_logit": float(finite.max()) if finite.numel() else float("-inf"),
                                   "num_clipped_heads": int(over.sum()),
                                   "min_eta": float(eta[over > 0].min()) if over.any() else 1.0,
                                   "clipped": {}, "nonfinite": {}}
            off = 0
            for name, H in zip(self._names, self._heads):
                for key, mask in (("clipped", over[off:off + H] > 0), ("nonfinite", bad[off:off + H])):
                    if mask.any():
                        out[key][name] = mask.nonzero().flatten().tolist()
                off += H
            self._host = out
        return self._host

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def track_max_logits(model: nn.Module, tau: Optional[float] = None) -> None:
    """Make every MLA layer of ``model`` keep the per-head max logit that ``apply_qk_clip`` reads. With
    ``tau``, a head whose attention log-sum-exp bound is under it keeps the bound instead of the exact
    maximum (``GatedMLA``; ``optim.qk_clip_exact_max`` turns that off)."""
    for _, mod in find_mla_modules(model):
        mod.track_max_logit = True
        mod.qk_clip_tau = tau


@torch.no_grad()
def apply_qk_clip(model: nn.Module, tau: Optional[float], group=None) -> QKClipReport:
    """Clip the q/k weights of every MLA head whose tracked max logit exceeds ``tau``.

    ``group``: the data-parallel process group over which the per-head max is
    all-reduced (MAX) first; None for no reduction. ``tau=None`` only resets the
    trackers. Nothing is read back to the host: every head's weights are multiplied by
    its eta on the device (exactly 1 for heads at or under tau, which leaves them bit for
    bit as they were). Returns a ``QKClipReport``.
    """
    if tau is not None and tau <= 0:
        raise ValueError(f"QK-clip tau must be positive, got {tau}")
    mods = find_mla_modules(model)
    if not mods:
        empty = torch.zeros(0)
        return QKClipReport([], empty, empty, empty, [])
    for name, m in mods:
        if m.max_logit.numel() != int(m.num_heads):
            raise ValueError(f"QK-clip: module '{name}' has max_logit of {m.max_logit.numel()} entries for "
                             f"{int(m.num_heads)} heads")
    flat = torch.cat([m.max_logit.detach().float().reshape(-1) for _, m in mods])
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl" and not flat.is_cuda:
            flat = flat.cuda()
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    heads = [int(m.num_heads) for _, m in mods]
    if tau is None:
        over, eta = torch.zeros_like(flat, dtype=torch.bool), torch.ones_like(flat)
    else:  # NaN and +inf maxima are reported (QKClipReport), never clipped: tau / inf would zero the head
        over = torch.isfinite(flat) & (flat > tau)
        eta = torch.where(over, tau / flat.clamp_min(1e-30), torch.ones_like(flat))
    off = 0
    for (_, m), H in zip(mods, heads):
        if tau is not None:
            _scale_heads(m, eta[off:off + H])
        m.max_logit.fill_(float("-inf"))
        off += H
    return QKClipReport([name for name, _ in mods], flat, over, eta, heads)


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
    kv_scale = torch.cat([sq[:, None].expand(H, dn), eta.new_ones(H, dv)], dim=1).reshape(-1)
    wq.mul_(q_scale.to(wq.device, wq.dtype)[:, None])
    wkv.mul_(kv_scale.to(wkv.device, wkv.dtype)[:, None])


def qk_clip_eta(max_logit: float, tau: float) -> float:
    """K2's per-head factor eta = min(1, tau / S_max)."""
    return 1.0 if not math.isfinite(max_logit) or max_logit <= tau else tau / max_logit
