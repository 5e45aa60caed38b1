"""Quantization-aware training with MX fake quantization (K3_SPEC.md §3: routed experts see
MXFP4 weights and MXFP8 activations during post-training; everything else stays high precision).

* :func:`mx_fake_quant`: autograd op. Forward = quantize + dequantize along the last
  (reduction) dim in blocks of 32 (``kernels.mx``), in the input's dtype. Backward =
  straight-through: the incoming gradient is passed on unchanged.
* :class:`MXFakeQuant`: the same as a module (a callable with its settings).
* :class:`QATLinear`: ``nn.Linear`` whose weight and input go through fake quant.
* :func:`enable_expert_qat` / :func:`disable_expert_qat`: switch QAT on/off for every
  ``RoutedExperts`` module of a model (their ``weight_fake_quant`` / ``input_fake_quant``
  hooks) and touch nothing else.
* :func:`qat_roundings`: under bf16 parameters (``k3train.precision.main_params``) the experts'
  bf16 compute copies are the fake-quantized fp32 main weights, so the forward sees exactly
  the values an export packs (fake quant is exact in bf16 and idempotent).

Defaults: weights MXFP4 (E2M1) with the RCEIL scale rule, which is the rule of the K3
checkpoint export (scale 2^ceil(log2(amax/6))), so the QAT values are exactly the values
that ``k3train.convert.mxfp4.pack_mxfp4`` ships. Activations MXFP8 E4M3, RCEIL.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.mx import get_format, mx_fake_quantize
from kernels.mx.formats import check_rule

__all__ = ["mx_fake_quant", "MXFakeQuant", "QATLinear", "enable_expert_qat", "disable_expert_qat",
           "qat_roundings", "DEFAULT_WEIGHT_FORMAT", "DEFAULT_INPUT_FORMAT", "DEFAULT_RULE"]

DEFAULT_WEIGHT_FORMAT = "e2m1"
DEFAULT_INPUT_FORMAT = "e4m3"
DEFAULT_RULE = "rceil"


class _MXFakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, rule, backend):
        return mx_fake_quantize(x, fmt, rule, backend)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def mx_fake_quant(x: torch.Tensor, fmt: str = DEFAULT_WEIGHT_FORMAT, rule: str = DEFAULT_RULE,
                  backend: str = "auto") -> torch.Tensor:
    """Fake-quantize ``x`` [..., K] (K % 32 == 0) with a straight-through gradient."""
    if x.numel() == 0:  # e.g. an expert that received no tokens
        return x
    return _MXFakeQuantSTE.apply(x, get_format(fmt).name, check_rule(rule), backend)


class MXFakeQuant:
    """Callable fake quantizer: ``MXFakeQuant("e2m1")(w)``.

    A plain object rather than an ``nn.Module``, so that installing it on a module adds
    nothing to the module tree or the state dict.
    """

    def __init__(self, fmt: str = DEFAULT_WEIGHT_FORMAT, rule: str = DEFAULT_RULE,
                 backend: str = "auto"):
        self.fmt = get_format(fmt).name
        self.rule = check_rule(rule)
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return mx_fake_quant(x, self.fmt, self.rule, self.backend)

    def __repr__(self) -> str:
        return f"MXFakeQuant(fmt={self.fmt!r}, rule={self.rule!r}, backend={self.backend!r})"


class QATLinear(nn.Linear):
    """``y = fq_in(x) @ fq_w(W)^T + b``; the reduction dim (in_features) must be a multiple of 32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 weight_format: str = DEFAULT_WEIGHT_FORMAT, input_format: str | None = DEFAULT_INPUT_FORMAT,
                 rule: str = DEFAULT_RULE, backend: str = "auto", device=None, dtype=None):
        if in_features % 32:
            raise ValueError(f"QATLinear: in_features={in_features} is not a multiple of the MX "
                             f"block size 32")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight_fake_quant = MXFakeQuant(weight_format, rule, backend)
        self.input_fake_quant = MXFakeQuant(input_format, rule, backend) if input_format else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "QATLinear":
        q = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            q.weight.copy_(linear.weight)
            if linear.bias is not None:
                q.bias.copy_(linear.bias)
        return q

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight={self.weight_fake_quant}, input={self.input_fake_quant}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_fake_quant is not None:
            x = self.input_fake_quant(x)
        return F.linear(x, self.weight_fake_quant(self.weight), self.bias)


def _routed_expert_modules(model: nn.Module):
    from k3train.model.moe import RoutedExperts  # lazy: the model package is heavy
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def enable_expert_qat(model: nn.Module, weight_format: str = DEFAULT_WEIGHT_FORMAT,
                      input_format: str | None = DEFAULT_INPUT_FORMAT,
                      weight_rule: str = DEFAULT_RULE, input_rule: str = DEFAULT_RULE,
                      backend: str = "auto") -> int:
    """Turn on fake quant for every routed-expert module (K3's QAT recipe); return how many.

    Only ``RoutedExperts.weight_fake_quant`` / ``.input_fake_quant`` are set: attention,
    shared experts, the dense FFN, router, norms and the head stay in full precision.
    The experts' reduction dims (ℓ for w13, the expert width for w2) must be multiples of 32.
    """
    mods = _routed_expert_modules(model)
    wq = MXFakeQuant(weight_format, weight_rule, backend)
    iq = MXFakeQuant(input_format, input_rule, backend) if input_format else None
    for m in mods:
        for name in ("w13", "w2"):
            k = getattr(m, name).shape[-1]
            if k % 32:
                raise ValueError(f"enable_expert_qat: {name} has reduction dim {k}, not a multiple "
                                 f"of the MX block size 32")
        m.weight_fake_quant = wq
        m.input_fake_quant = iq
    return len(mods)


def disable_expert_qat(model: nn.Module) -> int:
    mods = _routed_expert_modules(model)
    for m in mods:
        m.weight_fake_quant = None
        m.input_fake_quant = None
    return len(mods)


def qat_roundings(model: nn.Module) -> list[tuple[nn.Parameter, MXFakeQuant]]:
    """(weight, its fake quantizer) for every routed-expert stack with QAT on: how ``MainParams``
    makes their compute copies from the main weights."""
    return [(getattr(m, name), m.weight_fake_quant) for m in _routed_expert_modules(model)
            if m.weight_fake_quant is not None for name in ("w13", "w2")]
