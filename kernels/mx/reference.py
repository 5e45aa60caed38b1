"""Plain PyTorch reference for the MX formats (float64 arithmetic, no bit tricks).

This is the ground truth the Triton kernels are tested against bit for bit. It
works on any device and favours clarity over speed. Codes are uint8 tensors
with one element per byte: the sign is bit ``bits - 1`` (bit 7 for FP8, bit 3
for FP4) and the magnitude code below it.
"""

from __future__ import annotations

import torch

from .formats import (BLOCK, E2M1_VALUES, SCALE_BIAS, SCALE_NAN, ElemFormat, check_encoded,
                      check_input, check_output_dtype, check_rule, get_format)


def _e2m1_lut(device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float64, device=device)


def block_scale_exponent(amax: torch.Tensor, fmt: ElemFormat, rule: str) -> torch.Tensor:
    """Unbiased shared exponent k (int64) for finite non-negative float64 block maxima."""
    check_rule(rule)
    pos = amax > 0
    safe = torch.where(pos, amax, torch.ones_like(amax))
    if rule == "floor":
        # frexp: safe = m * 2**e with m in [0.5, 1), so floor(log2(safe)) = e - 1 exactly.
        _, e = torch.frexp(safe)
        k = e.to(torch.int64) - 1 - fmt.emax
    else:
        # Smallest k with safe <= max * 2**k. Start from a log2 estimate, then fix it
        # with exact float64 comparisons (max * 2**k is exact in float64).
        k = torch.ceil(torch.log2(safe / fmt.max_value)).to(torch.int64)
        maxv = torch.full_like(safe, fmt.max_value)
        for _ in range(2):
            k = torch.where(torch.ldexp(maxv, k.to(torch.float64)) < safe, k + 1, k)
            k = torch.where(torch.ldexp(maxv, (k - 1).to(torch.float64)) >= safe, k - 1, k)
    k = torch.where(pos, k, torch.full_like(k, -SCALE_BIAS))
    return k.clamp(-SCALE_BIAS, SCALE_BIAS)


def round_to_format(y: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Round float64 magnitudes |y| to the element grid, RNE, saturating at max. Returns |q|."""
    ay = y.abs()
    _, e = torch.frexp(ay)  # ay = m * 2**e, m in [0.5, 1); e = 0 for ay == 0
    ey = torch.clamp(e.to(torch.float64) - 1, min=fmt.emin)  # binade, subnormals share emin
    ulp_exp = ey - fmt.mbits
    q = torch.ldexp(torch.round(torch.ldexp(ay, -ulp_exp)), ulp_exp)  # torch.round: ties to even
    return torch.clamp(q, max=fmt.max_value)


def _encode_magnitude(q: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Exact grid magnitudes (float64) -> magnitude codes (int64)."""
    if fmt.packed:
        lut = _e2m1_lut(q.device)
        idx = torch.searchsorted(lut, q.contiguous())
        assert bool((lut[idx.clamp(max=7)] == q).all()), "value not on the E2M1 grid"
        return idx
    return q.to(torch.float32).to(fmt.torch_dtype).view(torch.uint8).to(torch.int64)


def _decode_magnitude(code: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Magnitude codes (int64, sign removed) -> float64 magnitudes (NaN/Inf where the format says)."""
    if fmt.packed:
        return _e2m1_lut(code.device)[code]
    return code.to(torch.uint8).view(fmt.torch_dtype).to(torch.float64)


def quantize_codes(x: torch.Tensor, fmt, rule: str = "floor"):
    """Quantize ``x`` [..., K] to (codes uint8 [..., K], scale uint8 [..., K/32])."""
    fmt = get_format(fmt)
    check_rule(rule)
    check_input(x)
    shape = x.shape
    xf = x.detach().to(torch.float64).reshape(-1, BLOCK)
    finite_block = torch.isfinite(xf).all(dim=1)
    amax = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf)).amax(dim=1)
    k = block_scale_exponent(amax, fmt, rule)
    y = torch.ldexp(xf, (-k).to(torch.float64)[:, None])  # exact in float64
    q = round_to_format(torch.where(torch.isfinite(y), y, torch.zeros_like(y)), fmt)
    mag = _encode_magnitude(q, fmt)
    mag = torch.where(finite_block[:, None], mag, torch.full_like(mag, fmt.nan_code))
    sign = torch.signbit(xf).to(torch.int64) << (fmt.bits - 1)
    codes = (mag | sign).to(torch.uint8).reshape(shape)
    scale = torch.where(finite_block, k + SCALE_BIAS, torch.full_like(k, SCALE_NAN))
    scale = scale.to(torch.uint8).reshape(*shape[:-1], shape[-1] // BLOCK)
    return codes, scale


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, fmt,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_codes` (codes unpacked, one per byte)."""
    fmt = get_format(fmt)
    check_output_dtype(dtype)
    if codes.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError("codes and scale must be uint8")
    shape = codes.shape
    if shape[-1] % BLOCK or scale.shape != (*shape[:-1], shape[-1] // BLOCK):
        raise ValueError(f"codes {tuple(shape)} do not match scale {tuple(scale.shape)}")
    c = codes.reshape(-1, BLOCK).to(torch.int64)
    sbit = 1 << (fmt.bits - 1)
    mag = _decode_magnitude(c & (sbit - 1), fmt)
    val = torch.where((c & sbit) != 0, -mag, mag)
    s = scale.reshape(-1).to(torch.int64)
    out = torch.ldexp(val, (s - SCALE_BIAS).to(torch.float64)[:, None])
    out = torch.where((s == SCALE_NAN)[:, None], torch.full_like(out, float("nan")), out)
    # float64 -> float32 is exact here except for overflow (-> inf); then round to dtype.
    return out.to(torch.float32).to(dtype).reshape(shape)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: column 2i in the low nibble, column 2i+1 in the high nibble."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError("pack_fp4 needs uint8 codes with an even last dimension")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data must be uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize(x: torch.Tensor, fmt, rule: str = "floor"):
    """Return (data, scale): FP8 data as a float8 tensor, FP4 data packed into uint8."""
    fmt = get_format(fmt)
    codes, scale = quantize_codes(x, fmt, rule)
    if fmt.packed:
        return pack_fp4(codes), scale
    return codes.view(fmt.torch_dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, fmt,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    fmt = get_format(fmt)
    check_encoded(data, scale, fmt)
    codes = unpack_fp4(data) if fmt.packed else data.view(torch.uint8)
    return dequantize_codes(codes, scale, fmt, dtype)


def fake_quantize(x: torch.Tensor, fmt, rule: str = "floor") -> torch.Tensor:
    """quantize then dequantize, returned in x's dtype (no autograd)."""
    codes, scale = quantize_codes(x, fmt, rule)
    return dequantize_codes(codes, scale, fmt, x.dtype)
