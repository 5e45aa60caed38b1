"""Vectorized PyTorch port of the Triton kernels' bit-level algorithm (fp32 bit patterns,
integer ops). It is the fast path on CPU (QAT on the tiny models calls fake quant hundreds of
times per step; the float64 reference is written for clarity, not speed) and a fallback on GPU
without Triton. Tests check it bit for bit against ``reference.py``.
"""

from __future__ import annotations

import torch

from .formats import BLOCK, ElemFormat


def _max_mant(fmt: ElemFormat) -> int:
    return int(torch.tensor(fmt.max_value, dtype=torch.float32).view(torch.int32)) & 0x7FFFFF


def _widen(x: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 -> int32 fp32 bit patterns, [n_blocks, 32]."""
    if x.dtype == torch.bfloat16:
        b = x.reshape(-1, BLOCK).view(torch.int16).to(torch.int32) << 16
    else:
        b = x.reshape(-1, BLOCK).view(torch.int32)
    return b


def _codes_and_k(b: torch.Tensor, fmt: ElemFormat, rule: str):
    ab = b & 0x7FFFFFFF
    amax_b = ab.amax(dim=1)
    nonfinite = amax_b >= 0x7F800000
    ea = amax_b >> 23
    k = ea - 127 - fmt.emax
    if rule == "rceil":
        k = k + ((amax_b & 0x7FFFFF) > _max_mant(fmt)).to(torch.int32)
    k = torch.where(ea == 0, -127, k).clamp(-127, 127)
    k = torch.where(nonfinite, 0, k)
    inv = ((127 - k) << 23).view(torch.float32)
    ay = ab.view(torch.float32) * inv[:, None]
    ay_b = ay.view(torch.int32)
    ey_b = torch.clamp(ay_b >> 23, min=fmt.emin + 127)
    c_b = (ey_b + (23 - fmt.mbits)) << 23
    s_b = (ay + c_b.view(torch.float32)).view(torch.int32)
    code = ((ey_b - (fmt.emin + 127)) << fmt.mbits) + (s_b - c_b)
    code = torch.clamp(code, max=fmt.max_code)
    code = torch.where(nonfinite[:, None], fmt.nan_code, code)
    return code, k, nonfinite


def _decode(code: torch.Tensor, k: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Magnitude codes (int32, no sign) and k [n_blocks] -> fp32 magnitudes (finite codes)."""
    eb = code >> fmt.mbits
    mant = code & ((1 << fmt.mbits) - 1)
    mint = torch.where(eb > 0, mant + (1 << fmt.mbits), mant)
    ek = (torch.clamp(eb, min=1) + (fmt.emin - 1 - fmt.mbits) + k[:, None]).clamp(max=127)
    p2 = torch.where(ek >= -126, (ek + 127) << 23,
                     torch.ones_like(ek) << torch.clamp(ek + 149, 0, 30))
    return mint.to(torch.float32) * p2.view(torch.float32)


def _to_dtype(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return val.to(dtype)  # torch rounds fp32 -> bf16 RNE, subnormals included


def quantize(x: torch.Tensor, fmt: ElemFormat, rule: str):
    b = _widen(x.contiguous())
    code, k, nonfinite = _codes_and_k(b, fmt, rule)
    code = code | ((b < 0).to(torch.int32) << (fmt.bits - 1))
    code = code.to(torch.uint8).reshape(x.shape)
    if fmt.packed:
        c = code.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        data = c[..., 0] | (c[..., 1] << 4)
    else:
        data = code.view(fmt.torch_dtype)
    scale = torch.where(nonfinite, 255, k + 127).to(torch.uint8)
    return data, scale.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)


def fake_quantize(x: torch.Tensor, fmt: ElemFormat, rule: str) -> torch.Tensor:
    b = _widen(x.contiguous())
    code, k, nonfinite = _codes_and_k(b, fmt, rule)
    val = _decode(code, k, fmt)
    val = torch.where(b < 0, -val, val)
    val = torch.where(nonfinite[:, None], float("nan"), val)
    return _to_dtype(val, x.dtype).reshape(x.shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """codes: uint8 (packed for FP4); scale uint8 [..., K/32]."""
    c = codes.to(torch.int32)
    if fmt.packed:
        c = torch.stack((c & 0xF, c >> 4), dim=-1)
    c = c.reshape(-1, BLOCK)
    s = scale.reshape(-1).to(torch.int32)
    sbit = 1 << (fmt.bits - 1)
    mag = c & (sbit - 1)
    val = _decode(mag, s - 127, fmt)
    if fmt.has_inf:
        val = torch.where(mag == fmt.max_code + 1, float("inf"), val)
    val = torch.where((mag > fmt.max_code) & ~(fmt.has_inf & (mag == fmt.max_code + 1)),
                      float("nan"), val)
    val = torch.where((c & sbit) != 0, -val, val)
    val = torch.where((s == 255)[:, None], float("nan"), val)
    return _to_dtype(val, dtype).reshape(*scale.shape[:-1], k)
