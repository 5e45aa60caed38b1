"""Precision recipes for the linear layers (``precision.recipe``; docs/precision.md).

A recipe decides the format of the GEMMs of the linears that ``TPSpec`` builds (every linear but
the LM head, which stays in the autocast dtype as in DeepSeek-V3 and Megatron's FP8 recipes).
Model code never sees it: ``TPSpec`` asks :func:`linear_gemm` once and builds its linears around
the answer.

* ``bf16``: plain linears (bf16 autocast on GPU, fp32 on CPU; ``precision.dtype``).
* ``mxfp8``: MXFP8 (E4M3, 1×32 E8M0 scales) GEMMs. Transformer Engine's ``MXFP8BlockScaling`` where
  TE imports and the GPU is sm_100+ (:func:`te_mxfp8_native`); elsewhere the exact emulation of
  ``kernels.mx.gemm`` (quantize, then a bf16/fp32 GEMM with fp32 accumulation).
* ``fp8_block``: DeepSeek-V3 FP8 (E4M3) with 1×128 activation/gradient blocks and 128×128 weight
  tiles through ``torch._scaled_mm`` (``kernels.fp8_block``); GPU only.

For y = x Wᵀ (x [M, K], W [N, K]) each recipe runs three GEMMs ``gemm(a, b, weight) = Q(a)·Q(b)ᵀ``,
every operand quantized along its reduction dim, as Transformer Engine does (a transposed use
of a tensor is quantized again from the high-precision copy, never transposed in FP8):

    fprop  y  = gemm(x,  W,  weight=True)    x along K, W along K
    dgrad  dx = gemm(dy, Wᵀ, weight=True)    dy along N, W along N
    wgrad  dW = gemm(dyᵀ, xᵀ, weight=False)  dy and x along M (the tokens)

``weight`` tells fp8_block to tile b 128×128 (tiles are their own transposes' tiles); MXFP8
quantizes every operand in 1×32 blocks.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from k3train.config.schema import PRECISION_RECIPES as RECIPES
from kernels.fp8_block import fp8_block_matmul, fp8_block_unavailable
from kernels.mx.gemm import mxfp8_matmul


class RecipeGemm(Protocol):
    def __call__(self, a: torch.Tensor, b: torch.Tensor, weight: bool) -> torch.Tensor:
        """Q(a) · Q(b)ᵀ for a [M, K], b [N, K] → [M, N]."""


def mxfp8_gemm(a: torch.Tensor, b: torch.Tensor, weight: bool) -> torch.Tensor:
    """Emulated MXFP8: bf16 tensor-core GEMM on CUDA, fp32 on CPU (both exact products, fp32 sums)."""
    return mxfp8_matmul(a, b, torch.bfloat16 if a.is_cuda else torch.float32)


def fp8_block_gemm(a: torch.Tensor, b: torch.Tensor, weight: bool) -> torch.Tensor:
    return fp8_block_matmul(a, b, b_tiles=weight, out_dtype=torch.float32)


class _RecipeLinearFn(torch.autograd.Function):
    """y = x Wᵀ with the fprop, dgrad and wgrad GEMMs of a recipe (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, gemm: RecipeGemm) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        ctx.save_for_backward(x, w)
        ctx.gemm = gemm
        with torch.autocast(dev, enabled=False):
            y = gemm(x.reshape(-1, x.shape[-1]), w, weight=True)
        return y.to(out_dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = ctx.gemm(dy2, w.t(), weight=True).to(x.dtype).view(x.shape)
            if ctx.needs_input_grad[1]:
                dw = ctx.gemm(dy2.t(), x2.t(), weight=False).to(w.dtype)
        return dx, dw, None


def recipe_linear(x: torch.Tensor, w: torch.Tensor, gemm: RecipeGemm) -> torch.Tensor:
    """x [..., K], W [N, K] → [..., N] in the autocast dtype (else x's), through ``gemm``."""
    if x.numel() == 0:
        return F.linear(x, w)
    return _RecipeLinearFn.apply(x, w, gemm)


class RecipeLinear(nn.Linear):
    """Bias-free ``nn.Linear`` whose GEMMs are a recipe's (the single-process ``torch`` backend)."""

    def __init__(self, in_features: int, out_features: int, gemm: RecipeGemm):
        super().__init__(in_features, out_features, bias=False)
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recipe_linear(x, self.weight, self.gemm)


def te_mxfp8_native() -> bool:
    """Transformer Engine imports and the GPU is sm_100+ (TE's MXFP8 recipe raises on Hopper)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def linear_gemm(recipe: str, te_native: bool = False) -> Callable | None:
    """The GEMM for ``precision.recipe``: None for plain linears (``bf16``, or ``mxfp8`` when TE runs
    it natively, ``te_native``). Raises ValueError, naming the field, when the recipe cannot run here."""
    if recipe not in RECIPES:
        raise ValueError(f"precision.recipe={recipe!r}: use one of {', '.join(RECIPES)}")
    if recipe == "bf16" or (recipe == "mxfp8" and te_native):
        return None
    if recipe == "mxfp8":
        return mxfp8_gemm
    reason = fp8_block_unavailable()
    if reason:
        raise ValueError(f"precision.recipe=fp8_block cannot run here: {reason}. Use precision.recipe=mxfp8 "
                         f"(emulated anywhere) or bf16")
    return fp8_block_gemm


def te_mxfp8_forward(module: nn.Module) -> nn.Module:
    """UNTESTED HERE (needs TE on sm_100+): run a TE linear's forward under TE's MXFP8 recipe."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import MXFP8BlockScaling

    recipe, forward = MXFP8BlockScaling(), module.forward

    def mxfp8_forward(*args, **kwargs):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            return forward(*args, **kwargs)

    module.forward = mxfp8_forward
    return module
