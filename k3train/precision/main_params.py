"""Mixed precision as Megatron-Core does it: bf16 model weights, fp32 main weights (``precision.params``).

With ``precision.params=bf16`` each trainable parameter ``p`` of the model is held twice:

    p        the compute copy that forward and backward read: bf16, except where the parameter's role
             says ``keep_fp32`` (K3_SPEC §2.2/§4: KDA's A_log, dt_bias, short-conv weights, o_norm; the
             fp32 router's weight; AttnRes's pseudo-query and key gain), which stay fp32;
    main(p)  an fp32 ``nn.Parameter`` with ``p``'s role (``main_param``): what the optimizer steps,
             QK-clip rescales, checkpoints save and load, and gradient clipping sees the gradient of.

The main weights are the truth; the compute copies are derived from them by ``sync_model`` only:

    p ← round_bf16(main(p))           (one copy over a flat buffer)
    p ← Q(main(p))                    for weights with a rounding of their own (``rounding``): MXFP4
                                      QAT's fake quantizer of the routed experts, so that the forward
                                      sees exactly the values an export packs from the main weights
                                      (Q(x) is exact in bf16, and Q(Q(x)) = Q(x))
    p ← main(p)                       for the ``keep_fp32`` ones

It runs at construction, and the trainer calls it after every optimizer step (and QK-clip) and after
loading a checkpoint. At construction the main weights are the model's fp32 initial values, so a
bf16-parameter run starts from the same weights as an fp32 one.

Memory per parameter (bf16 params): 2 B compute copy + 4 B main weight + 4 B main gradient
(``k3train.parallel.grad_buffers``) + the optimizer state (AdamW 8 B, Muon 4 B), against 4 + 4 + state
for fp32 params; during the backward a bf16 gradient (2 B) lives until it has been copied or added
into the main gradient. Under bf16 autocast the fp32 model also saves a bf16 cast of each weight for the backward
(2 B), which a bf16 model does not need.

With ``precision.params=fp32`` nothing is copied: a parameter is its own main weight
(``main_param(p) is p``) and ``sync_model`` does nothing.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from k3train.model.roles import get_role, set_role

MAIN_ATTR = "k3_main_param"

Rounding = Callable[[torch.Tensor], torch.Tensor]


def main_param(p: torch.Tensor) -> torch.Tensor:
    """The fp32 main weight of model parameter ``p`` (``p`` itself when parameters are fp32)."""
    return getattr(p, MAIN_ATTR, p)


def _keeps_fp32(p: torch.Tensor) -> bool:
    role = get_role(p)
    return role is not None and role.keep_fp32


class MainParams:
    """Casts ``model``'s trainable parameters to ``dtype`` (bf16) and keeps their fp32 main weights.

    ``rounding`` pairs model parameters with the function that makes their compute copy from their
    main weight where plain rounding is not enough (``k3train.precision.mx_qat.qat_roundings``).
    Compute copies that are cast share one flat buffer, and so do their main weights, so
    ``sync_model`` is one copy kernel plus one for the fp32-kept parameters.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, rounding: Sequence[tuple[nn.Parameter, Rounding]] = ()):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"precision.params: parameters are fp32 or bf16, got {dtype}")
        self.dtype = dtype
        params = [p for p in model.parameters() if p.requires_grad]
        self._cast: list[nn.Parameter] = []  # stored in dtype
        self._kept: list[nn.Parameter] = []  # keep_fp32
        self._rounding: list[tuple[nn.Parameter, Rounding]] = []
        if dtype == torch.float32 or not params:
            return
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("MainParams needs the model's parameters in fp32 (build the model, then wrap it once)")
        device = params[0].device
        self._cast = [p for p in params if not _keeps_fp32(p)]
        self._kept = [p for p in params if _keeps_fp32(p)]
        ordered = self._cast + self._kept
        self._main_flat = torch.cat([p.detach().reshape(-1) for p in ordered])
        self._compute_flat = torch.empty(sum(p.numel() for p in self._cast), dtype=dtype, device=device)
        offset = 0
        for i, p in enumerate(ordered):
            n = p.numel()
            main = nn.Parameter(self._main_flat[offset:offset + n].view_as(p))
            role = get_role(p)
            if role is not None:
                set_role(main, role)
            setattr(p, MAIN_ATTR, main)
            if i < len(self._cast):  # the cast ones come first, at the same offsets in both buffers
                p.data = self._compute_flat[offset:offset + n].view_as(p)
            offset += n
        self._rounding = list(rounding)
        self.sync_model()

    @torch.no_grad()
    def sync_model(self) -> None:
        """Compute copies ← main weights (rounded to bf16, or by their ``rounding``); no-op for fp32 params."""
        if not self._cast and not self._kept:
            return
        self._compute_flat.copy_(self._main_flat[: self._compute_flat.numel()])
        if self._kept:
            torch._foreach_copy_(self._kept, [main_param(p) for p in self._kept])
        for p, fn in self._rounding:
            p.copy_(fn(main_param(p)))
