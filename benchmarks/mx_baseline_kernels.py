"""FROZEN copy of ``kernels/mx/triton_mx.py`` before issue 15 (commit 9590812), imported only by
``benchmarks/mx.py --sweep`` to time the old kernels beside the new ones in one process.
Delete this file (and the sweep's ``old`` variant) once the H200 run has compared them."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.mx.formats import BLOCK, ElemFormat


@triton.jit
def _store_bits(ptr, bits, mask, OUT_BF16: tl.constexpr):
    """Store fp32 values given as int32 bit patterns. bf16 is rounded with integer ops (RNE,
    subnormals kept), so the interpreter and any GPU agree with torch's conversion bit for bit."""
    if OUT_BF16:
        r = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) & 0xFFFF
        r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(ptr, r.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, bits.to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def _decode_bits(mag, k, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Finite magnitude code (int32) times 2**k -> fp32 bit pattern, with integer ops only
    (no float op sees or makes a subnormal, so flush-to-zero settings cannot matter).
    The value is sig * 2**(e - 23) with sig's leading bit at bit 23."""
    eb = mag >> MBITS
    mant = mag & ((1 << MBITS) - 1)
    # normal code: implicit bit; subnormal code: normalize the (<= 3-bit) mantissa
    p = (mant >= 2).to(tl.int32) + (mant >= 4).to(tl.int32)  # floor(log2(mant)), MBITS <= 3
    sig = tl.where(eb > 0, (mant | (1 << MBITS)) << (23 - MBITS), mant << (23 - p))
    e = tl.where(eb > 0, eb + (EMIN - 1), p + (EMIN - MBITS)) + k
    normal = ((e + 127) << 23) | (sig & 0x7FFFFF)
    sub = sig >> tl.minimum(tl.maximum(-126 - e, 0), 31)  # exact: few significant bits
    bits = tl.where(e >= -126, normal, sub)
    bits = tl.where(e > 127, 0x7F800000, bits)
    return tl.where(mag == 0, 0, bits)


def _mx_quantize_kernel(
    x_ptr, out_ptr, scale_ptr, n_blocks,
    MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    MAX_CODE: tl.constexpr, MAX_MANT: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGN_SHIFT: tl.constexpr, PACK: tl.constexpr, RCEIL: tl.constexpr,
    FAKE: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_B: tl.constexpr,
    MAX_VALUE: tl.constexpr, LOW_K: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * BLOCK_B  # 64-bit base once, 32-bit offsets per element
    x_ptr += first * 32
    rows = tl.arange(0, BLOCK_B)
    rmask = rows < n_blocks - first
    cols = tl.arange(0, 32)
    offs = rows[:, None] * 32 + cols[None, :]
    xin = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0)
    if IN_BF16:
        # widen with integer ops: exact for bf16 subnormals too (the interpreter flushes them)
        b = xin.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        b = xin.to(tl.int32, bitcast=True)
    x = b.to(tl.float32, bitcast=True)
    ab = b & 0x7FFFFFFF
    neg = b < 0

    # ---- per-block shared exponent k (integer ops on amax's bits) ----
    amax_b = tl.max(ab, axis=1)  # non-negative floats order like their bit patterns
    nonfinite = amax_b >= 0x7F800000  # any Inf or NaN in the block
    ea = amax_b >> 23
    if RCEIL:
        # smallest k with amax <= max_elem * 2**k; exact mantissa comparison
        k = ea - 127 - EMAX + ((amax_b & 0x7FFFFF) > MAX_MANT).to(tl.int32)
    else:
        k = ea - 127 - EMAX
    k = tl.where(ea == 0, -127, k)  # zero or fp32-subnormal amax
    k = tl.minimum(tl.maximum(k, -127), 127)
    k = tl.where(nonfinite | (rows >= n_blocks - first), 0, k)  # (masked rows: any normal k)

    # ---- y = x * 2**-k ; -k in [-127, 126] so the multiplier is a normal float ----
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    ay = tl.abs(x) * inv[:, None]
    lowk = tl.min(k, axis=0) < LOW_K  # rare: a block so small that subnormals matter
    if lowk:
        # fp32-subnormal inputs never enter a float op (exact under any flush-to-zero
        # setting): |x| = m * 2**-149, float(m) is exact and normal, so add (-149 - k) to its
        # exponent; a result below 2**-126 rounds to zero in every element format anyway.
        # For k >= LOW_K such inputs give |y| < 2**-17, below half of any format's step.
        sub_e = tl.maximum(-149 - k, -160)  # clamp keeps the shift in int32 range
        ys = (ab.to(tl.float32).to(tl.int32, bitcast=True) + (sub_e << 23)[:, None])
        ys = tl.where(ys >= 0x00800000, ys, 0).to(tl.float32, bitcast=True)
        ay = tl.where(ab < 0x00800000, ys, ay)

    # ---- RNE to the element grid ----
    ay_b = ay.to(tl.int32, bitcast=True)
    ey_b = tl.maximum(ay_b >> 23, EMIN + 127)  # biased binade; subnormals share emin
    c_b = (ey_b + (23 - MBITS)) << 23
    s_b = (ay + c_b.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    qi = s_b - c_b  # rounded mantissa count in units of 2**(e - M)
    code = ((ey_b - (EMIN + 127)) << MBITS) + qi
    code = tl.minimum(code, MAX_CODE)  # saturate
    code = tl.where(nonfinite[:, None], NAN_CODE, code)

    if FAKE:
        if lowk:
            bits = _decode_bits(code, k[:, None], MBITS, EMIN)
        else:
            # (|y| + C) - C is the rounded magnitude exactly; saturate; * 2**k. For
            # k >= LOW_K every operand and result is a normal float (or zero or Inf).
            q = s_b.to(tl.float32, bitcast=True) - c_b.to(tl.float32, bitcast=True)
            q = tl.minimum(q, MAX_VALUE)
            p2 = ((k + 127) << 23).to(tl.float32, bitcast=True)
            bits = (q * p2[:, None]).to(tl.int32, bitcast=True)
        bits = bits | (neg.to(tl.int32) << 31)
        bits = tl.where(nonfinite[:, None], 0x7FC00000, bits)
        _store_bits(out_ptr + first * 32 + offs, bits, rmask[:, None], OUT_BF16)
    else:
        code = code | (neg.to(tl.int32) << SIGN_SHIFT)
        if PACK:
            pairs = tl.reshape(code, (BLOCK_B, 16, 2))
            lo, hi = tl.split(pairs)
            byte = (lo | (hi << 4)).to(tl.uint8)
            poffs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]
            tl.store(out_ptr + first * 16 + poffs, byte, mask=rmask[:, None])
        else:
            tl.store(out_ptr + first * 32 + offs, code.to(tl.uint8), mask=rmask[:, None])
        sbyte = tl.where(nonfinite, 255, k + 127).to(tl.uint8)
        tl.store(scale_ptr + first + rows, sbyte, mask=rmask)


def _mx_dequantize_kernel(
    data_ptr, scale_ptr, out_ptr, n_blocks,
    MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, INF_CODE: tl.constexpr,
    SIGN_SHIFT: tl.constexpr, PACK: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_B: tl.constexpr,
    SUB_UNIT: tl.constexpr, LOW_K: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * BLOCK_B
    rows = tl.arange(0, BLOCK_B)
    rmask = rows < n_blocks - first
    cols = tl.arange(0, 32)
    offs = rows[:, None] * 32 + cols[None, :]
    out_ptr += first * 32
    scale_ptr += first
    if PACK:
        data_ptr += first * 16
        poffs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]
        byte = tl.load(data_ptr + poffs, mask=rmask[:, None], other=0).to(tl.int32)
        code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_B, 32))
    else:
        data_ptr += first * 32
        code = tl.load(data_ptr + offs, mask=rmask[:, None], other=0).to(tl.int32)
    s = tl.load(scale_ptr + rows, mask=rmask, other=127).to(tl.int32)
    k = s - 127

    neg = (code >> SIGN_SHIFT) & 1
    mag = code & ((1 << SIGN_SHIFT) - 1)
    if tl.min(k, axis=0) < LOW_K:
        bits = _decode_bits(mag, k[:, None], MBITS, EMIN)
    else:
        # element value as a normal fp32 (normal codes: move the bits into place; subnormal
        # codes: float(mant) * 2**(emin - M)), then * 2**k. For k >= LOW_K every product is
        # a normal float (or zero or Inf), so this is exact under any flush-to-zero setting.
        vn = ((mag << (23 - MBITS)) + ((127 + EMIN - 1) << 23)).to(tl.float32, bitcast=True)
        vs = mag.to(tl.float32) * SUB_UNIT
        v = tl.where(mag < (1 << MBITS), vs, vn)
        p2 = ((k + 127) << 23).to(tl.float32, bitcast=True)  # k = 128 (NaN scale) gives Inf
        bits = (v * p2[:, None]).to(tl.int32, bitcast=True)
    if MAX_CODE < (1 << SIGN_SHIFT) - 1:  # the format has Inf/NaN codes
        bits = tl.where(mag > MAX_CODE, 0x7FC00000, bits)
        bits = tl.where(mag == INF_CODE, 0x7F800000, bits)
    bits = bits | (neg << 31)
    bits = tl.where((s == 255)[:, None], 0x7FC00000, bits)
    _store_bits(out_ptr + offs, bits, rmask[:, None], OUT_BF16)


def interpreter_active() -> bool:
    """True when Triton was imported with TRITON_INTERPRET=1 (its standard library is then
    built for the interpreter; it cannot be switched on after import)."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton
        import os
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    fn = {"quantize": _mx_quantize_kernel, "dequantize": _mx_dequantize_kernel}[name]
    return triton.jit(fn)  # an InterpretedFunction when the interpreter is active


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not interpreter_active():
        raise RuntimeError(
            "the Triton MX kernels got a CPU tensor, but Triton's interpreter is off: set "
            "TRITON_INTERPRET=1 in the environment before anything imports triton, or use "
            "backend='reference'")


def _max_mant(fmt: ElemFormat) -> int:
    """fp32 mantissa field of max_elem (for the exact RCEIL comparison)."""
    return int(torch.tensor(fmt.max_value, dtype=torch.float32).view(torch.int32)) & 0x7FFFFF


# Programs whose blocks all have k >= LOW_K take the fast float paths, in which no operand or
# result can be an fp32 subnormal: the smallest nonzero element value is 2**-16 (E5M2) and
# 2**-16 * 2**-109 is normal; an fp32-subnormal input gives |y| < 2**(-126 - k) <= 2**-17,
# below half of any format's smallest step. Other programs take exact integer paths.
LOW_K = -109

# (blocks of 32 per program, warps) on GPU; benchmarks/mx.py --sweep tunes these.
GPU_CONFIG = {"quantize": (128, 8), "dequantize": (128, 8)}  # H200 sweep, 2026-11-29


def _launch_cfg(x: torch.Tensor, op: str):
    _check_device(x)
    interpret = not x.is_cuda
    if interpret:  # big programs keep the interpreter fast
        return True, 256, 4
    bb, warps = GPU_CONFIG[op]
    return False, bb, warps


def quantize(x: torch.Tensor, fmt: ElemFormat, rule: str, fake: bool = False):
    """x: contiguous [..., K] float32/bfloat16 with K % 32 == 0 (checked by the caller)."""
    n_blocks = x.numel() // BLOCK
    if fake:
        out = torch.empty_like(x)
        scale = out  # unused
    else:
        k = x.shape[-1]
        out = torch.empty(*x.shape[:-1], k // 2 if fmt.packed else k, dtype=torch.uint8,
                          device=x.device)
        scale = torch.empty(*x.shape[:-1], k // BLOCK, dtype=torch.uint8, device=x.device)
    if n_blocks:
        interpret, bb, warps = _launch_cfg(x, "quantize")
        kern = _kernel("quantize")
        grid = (triton.cdiv(n_blocks, bb),)
        kern[grid](x, out, scale, n_blocks,
                   MBITS=fmt.mbits, EMIN=fmt.emin, EMAX=fmt.emax, MAX_CODE=fmt.max_code,
                   MAX_MANT=_max_mant(fmt), NAN_CODE=fmt.nan_code, SIGN_SHIFT=fmt.bits - 1,
                   PACK=fmt.packed, RCEIL=(rule == "rceil"), FAKE=fake,
                   IN_BF16=(x.dtype == torch.bfloat16),
                   OUT_BF16=(fake and x.dtype == torch.bfloat16), BLOCK_B=bb,
                   MAX_VALUE=fmt.max_value, LOW_K=LOW_K,
                   **({} if interpret else {"num_warps": warps}))
    return out if fake else (out, scale)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """codes: contiguous uint8 (packed for FP4); scale: contiguous uint8 [..., K/32]."""
    out = torch.empty(*scale.shape[:-1], k, dtype=dtype, device=codes.device)
    n_blocks = scale.numel()
    if n_blocks:
        interpret, bb, warps = _launch_cfg(codes, "dequantize")
        kern = _kernel("dequantize")
        inf_code = fmt.max_code + 1 if fmt.has_inf else -1
        grid = (triton.cdiv(n_blocks, bb),)
        kern[grid](codes, scale, out, n_blocks,
                   MBITS=fmt.mbits, EMIN=fmt.emin, MAX_CODE=fmt.max_code, INF_CODE=inf_code,
                   SIGN_SHIFT=fmt.bits - 1, PACK=fmt.packed, OUT_BF16=(dtype == torch.bfloat16),
                   BLOCK_B=bb, SUB_UNIT=2.0 ** (fmt.emin - fmt.mbits), LOW_K=LOW_K,
                   **({} if interpret else {"num_warps": warps}))
    return out
