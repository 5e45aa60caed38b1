"""MX block formats (OCP Microscaling): MXFP8 (E4M3, E5M2) and MXFP4 (E2M1).

Blocks of 32 run along the last (reduction) dimension, each with one E8M0 scale
byte. Numerics are documented in ``kernels/mx/formats.py`` and
``docs/mx_notes.md``.

Functional API. ``backend``:

* ``"auto"``: Triton for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the Triton kernels (on CPU through Triton's interpreter, which needs
  ``TRITON_INTERPRET=1`` before triton is imported);
* ``"torch"``: a vectorized PyTorch port of the kernels' bit-level algorithm (fast on CPU);
* ``"reference"``: the float64 reference, written for clarity.

All four give identical bits (tests check it)::

    data, scale = mx_quantize(x, "e4m3", rule="floor")    # data: float8_e4m3fn [..., K]
    data, scale = mx_quantize(w, "e2m1", rule="rceil")    # data: uint8 [..., K/2] (packed)
    y = mx_dequantize(data, scale, "e2m1", dtype=torch.bfloat16)
    xq = mx_fake_quantize(x, "e4m3", rule="rceil")        # same dtype and shape as x

Scales are uint8 [..., K/32].
"""

from __future__ import annotations

import torch

from ..backend import triton_device
from . import reference, torch_impl
from .formats import (BLOCK, E2M1, E4M3, E5M2, FORMATS, SCALE_NAN, SCALE_RULES, ElemFormat,
                      check_encoded, check_input, check_output_dtype, check_rule, get_format)

__all__ = [
    "BLOCK", "E2M1", "E4M3", "E5M2", "FORMATS", "SCALE_NAN", "SCALE_RULES", "ElemFormat",
    "get_format", "mx_quantize", "mx_dequantize", "mx_fake_quantize", "pack_fp4", "unpack_fp4",
]

_BACKENDS = ("auto", "triton", "torch", "reference")

pack_fp4 = reference.pack_fp4
unpack_fp4 = reference.unpack_fp4


def _backend(t: torch.Tensor, backend: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown MX backend {backend!r}; expected one of {_BACKENDS}")
    if backend == "auto":
        return "triton" if triton_device(t) else "torch"
    if backend == "triton" and not (t.is_cuda or t.device.type == "cpu"):
        raise ValueError(f"the Triton MX kernels need a CUDA or CPU tensor, got {t.device}")
    return backend


def mx_quantize(x: torch.Tensor, fmt="e4m3", rule: str = "floor", backend: str = "auto"):
    """Quantize ``x`` [..., K] (fp32/bf16, K % 32 == 0) to (data, scale).

    FP8 data comes back as a ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensor
    of x's shape; FP4 data as uint8 [..., K/2] with column 2i in the low nibble.
    """
    fmt = get_format(fmt)
    check_rule(rule)
    check_input(x)
    be = _backend(x, backend)
    if be == "triton":
        from . import triton_mx
        data, scale = triton_mx.quantize(x.detach().contiguous(), fmt, rule)
        if not fmt.packed:
            data = data.view(fmt.torch_dtype)
        return data, scale
    if be == "torch":
        return torch_impl.quantize(x.detach(), fmt, rule)
    return reference.quantize(x, fmt, rule)


def mx_dequantize(data: torch.Tensor, scale: torch.Tensor, fmt="e4m3",
                  dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """Decode (data, scale) from :func:`mx_quantize` to ``dtype`` (fp32 or bf16)."""
    fmt = get_format(fmt)
    check_output_dtype(dtype)
    k = check_encoded(data, scale, fmt)
    be = _backend(data, backend)
    if be == "triton":
        from . import triton_mx
        return triton_mx.dequantize(data.contiguous().view(torch.uint8), scale.contiguous(),
                                    fmt, k, dtype)
    if be == "torch":
        return torch_impl.dequantize(data.view(torch.uint8), scale, fmt, k, dtype)
    return reference.dequantize(data, scale, fmt, dtype)


def mx_fake_quantize(x: torch.Tensor, fmt="e4m3", rule: str = "floor",
                     backend: str = "auto") -> torch.Tensor:
    """Quantize and dequantize in one pass; returns x's dtype and shape. No autograd:
    see ``k3train.precision.mx_qat`` for the straight-through version."""
    fmt = get_format(fmt)
    check_rule(rule)
    check_input(x)
    be = _backend(x, backend)
    if be == "triton":
        from . import triton_mx
        return triton_mx.quantize(x.detach().contiguous(), fmt, rule, fake=True)
    if be == "torch":
        return torch_impl.fake_quantize(x.detach(), fmt, rule)
    return reference.fake_quantize(x.detach(), fmt, rule)
