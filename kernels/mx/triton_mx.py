"""Triton kernels for MX quantize / dequantize / fake-quantize.

The tensor is viewed as [n_blocks, 32] (blocks run along the contiguous last
dimension), and each program handles ``BLOCK_B`` blocks. Elements travel in
pairs (columns 2i, 2i+1): inputs are read as int32 (bf16) or int64 (fp32)
words, FP4 codes as one byte, FP8 codes as one int16, outputs written as pair
words. Both halves of every output unit sit in one thread, so no kernel needs a
split/join layout change. All decisions that must be exact are made on the fp32
bit patterns with integer ops, and no float op ever takes or makes an fp32
subnormal that matters, so flush-to-zero cannot change a result. The only float
arithmetic is

* ``y = x * 2**-k`` for normal ``x`` (exact: the multiplier is a normal power
  of two; a product below 2**-126 is far below half the element format's
  smallest step, so it rounds to zero whether or not it is flushed). fp32
  subnormal inputs matter only in programs with a block of k < LOW_K, which
  take an integer path for them (``float(m)`` with its exponent moved);
* the round-to-nearest-even step ``|y| + C`` with ``C = 2**(e + 23 - M)``: the
  fp32 adder rounds ``|y|`` to a multiple of ``2**(e - M)``, ties to even, and
  ``bits(|y| + C) - bits(C)`` is then the rounded integer mantissa;
* decoding in programs whose blocks all have LOW_K <= k <= HIGH_K (every value
  is then a normal fp32): ``(|y| + C) - C`` and ``* 2**k`` (fake quant), and
  ``float(mant) * 2**(emin - M + k)`` for subnormal codes (dequantize; normal
  codes are a shift and an integer add). There, bf16 outputs are the top half of
  the fp32 bits (values have at most 4 significant bits: exact).

Other programs decode with integer ops only (subnormal results included) and
round bf16 outputs with integer ops (RNE).

The rules are the same as the float64 reference (see ``formats.py``) and tests
check the two bit for bit. On CPU the kernels run through Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before triton is imported).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .formats import BLOCK, ElemFormat


@triton.jit
def _rne_bf16(bits):
    """fp32 bit patterns -> bf16 bit patterns (low 16 bits) with integer ops: RNE, subnormals
    kept, NaN -> 0x7FC0 (the interpreter flushes bf16 subnormals; this agrees with torch)."""
    r = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)


@triton.jit
def _split_pairs(w, IN_BF16: tl.constexpr):
    """A loaded pair word -> fp32 bit patterns (int32) of its even and odd element."""
    if IN_BF16:  # int32 word, even element in the low half
        return w << 16, w & -65536
    else:  # int64 word
        return w.to(tl.int32), (w >> 32).to(tl.int32)


@triton.jit
def _join_pairs(lo, hi, OUT_BF16: tl.constexpr):
    """Inverse of _split_pairs; for bf16 ``lo``/``hi`` hold bf16 bit patterns in their low half."""
    if OUT_BF16:
        return (lo & 0xFFFF) | (hi << 16)
    else:
        return (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)


@triton.jit
def _subnormal_inputs(ab, ay, k):
    """|x| * 2**-k for fp32-subnormal |x| without a float op on a subnormal: float(m) is exact
    and normal, so add (-149 - k) to its exponent; results below 2**-126 round to zero in every
    element format anyway. Other elements keep ``ay``."""
    sub_e = tl.maximum(-149 - k, -160)  # clamp keeps the shift in int32 range
    ys = ab.to(tl.float32).to(tl.int32, bitcast=True) + (sub_e << 23)[:, None]
    ys = tl.where(ys >= 0x00800000, ys, 0).to(tl.float32, bitcast=True)
    return tl.where(ab < 0x00800000, ys, ay)


@triton.jit
def _rne_step(ay, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE of |y| to the element grid: returns (bits(|y| + C), bits(C), biased binade)."""
    ey_b = tl.maximum(ay.to(tl.int32, bitcast=True) >> 23, EMIN + 127)  # subnormals share emin
    c_b = (ey_b + (23 - MBITS)) << 23
    s_b = (ay + c_b.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return s_b, c_b, ey_b


@triton.jit
def _code(ay, sat, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Saturated magnitude code. ``sat`` (per row, unsigned) is max_code, or the NaN code for
    non-finite blocks, whose Inf/NaN elements leave huge unsigned garbage that the min drops."""
    s_b, c_b, ey_b = _rne_step(ay, MBITS, EMIN)
    code = ((ey_b - (EMIN + 127)) << MBITS) + (s_b - c_b)
    return tl.minimum(code.to(tl.uint32, bitcast=True), sat[:, None]).to(tl.int32, bitcast=True)


@triton.jit
def _fake_fast(ay, b, p2, MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_VALUE: tl.constexpr):
    """Rounded value * 2**k as fp32 bits with the input's sign: (|y| + C) - C is the rounded
    magnitude exactly; for k >= LOW_K every operand and result is normal (or zero or Inf)."""
    s_b, c_b, ey_b = _rne_step(ay, MBITS, EMIN)
    q = s_b.to(tl.float32, bitcast=True) - c_b.to(tl.float32, bitcast=True)
    q = tl.minimum(q, MAX_VALUE)
    return (q * p2[:, None]).to(tl.int32, bitcast=True) | (b & -2147483648)


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


@triton.jit
def _decode_fast(mag, k, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Like _decode_bits for LOW_K <= k <= HIGH_K, where every value is a normal fp32: normal
    codes are a shift and an add of the row's exponent; subnormal codes are float(mant) times a
    normal power of two (for E2M1 the one subnormal code is 2**(k-1), its bits times mant)."""
    rowc = ((127 + EMIN - 1 + k) << 23)[:, None]  # bits of 2**(EMIN - 1 + k)
    nb = (mag << (23 - MBITS)) + rowc
    if MBITS == 1:
        sb = mag * rowc
    else:
        sub = ((127 + EMIN - MBITS + k) << 23).to(tl.float32, bitcast=True)
        sb = (mag.to(tl.float32) * sub[:, None]).to(tl.int32, bitcast=True)
    return tl.where(mag < (1 << MBITS), sb, nb)


@triton.jit
def _finish_decode(bits, mag, sgn, nanrow, MBITS: tl.constexpr, MAX_CODE: tl.constexpr,
                   INF_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """Inf/NaN codes and NaN scale rows (one compare against a per-row threshold), then the
    sign: bit 31 of ``sgn``."""
    if MAX_CODE < (1 << SIGN_SHIFT) - 1:  # the format has Inf/NaN codes
        thr = tl.where(nanrow, 0, MAX_CODE + 1)[:, None]
        if INF_CODE > 0:  # E5M2: 0x7C -> Inf, 0x7D-0x7F -> NaN (nonzero mantissa)
            spc = tl.where(nanrow, 0x7FC00000, 0x7F800000 - (INF_CODE << (23 - MBITS)))
            special = (mag << (23 - MBITS)) | spc[:, None]
        else:
            special = 0x7FC00000
        bits = tl.where(mag >= thr, special, bits)
    else:
        bits = tl.where(nanrow[:, None], 0x7FC00000, bits)
    return bits | (sgn & -2147483648)


def _mx_quantize_kernel(
    x_ptr, out_ptr, scale_ptr, n_blocks,
    MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    MAX_CODE: tl.constexpr, MAX_MANT: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGN_SHIFT: tl.constexpr, PACK: tl.constexpr, RCEIL: tl.constexpr,
    FAKE: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_B: tl.constexpr,
    MAX_VALUE: tl.constexpr, LOW_K: tl.constexpr,
):
    """x is read as pair words (int32 for bf16, int64 for fp32), so the even and odd element of
    every output byte (FP4), int16 (FP8) or pair word (fake) sit in one thread: no split/join."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * BLOCK_B  # 64-bit base once, 32-bit offsets per element
    rows = tl.arange(0, BLOCK_B)
    rmask = rows < n_blocks - first
    offs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]  # pair index
    w = tl.load(x_ptr + first * 16 + offs, mask=rmask[:, None], other=0, eviction_policy="evict_first")
    lo, hi = _split_pairs(w, IN_BF16)
    ab_lo = lo & 0x7FFFFFFF
    ab_hi = hi & 0x7FFFFFFF

    # ---- per-block shared exponent k (integer ops on amax's bits) ----
    amax_b = tl.max(tl.maximum(ab_lo, ab_hi), axis=1)  # non-negative floats order like ints
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
    ay_lo = ab_lo.to(tl.float32, bitcast=True) * inv[:, None]
    ay_hi = ab_hi.to(tl.float32, bitcast=True) * inv[:, None]
    lowk = tl.min(k, axis=0) < LOW_K  # rare: a block so small that subnormals matter
    if lowk:
        # for k >= LOW_K an fp32-subnormal input gives |y| < 2**-17, below half of any step
        ay_lo = _subnormal_inputs(ab_lo, ay_lo, k)
        ay_hi = _subnormal_inputs(ab_hi, ay_hi, k)

    if FAKE:
        if lowk:
            sat = tl.full([BLOCK_B], MAX_CODE, tl.uint32)
            b_lo = _decode_bits(_code(ay_lo, sat, MBITS, EMIN), k[:, None], MBITS, EMIN)
            b_hi = _decode_bits(_code(ay_hi, sat, MBITS, EMIN), k[:, None], MBITS, EMIN)
            b_lo = b_lo | (lo & -2147483648)
            b_hi = b_hi | (hi & -2147483648)
        else:
            p2 = ((k + 127) << 23).to(tl.float32, bitcast=True)
            b_lo = _fake_fast(ay_lo, lo, p2, MBITS, EMIN, MAX_VALUE)
            b_hi = _fake_fast(ay_hi, hi, p2, MBITS, EMIN, MAX_VALUE)
        b_lo = tl.where(nonfinite[:, None], 0x7FC00000, b_lo)
        b_hi = tl.where(nonfinite[:, None], 0x7FC00000, b_hi)
        if IN_BF16:
            if lowk:  # bf16 subnormal results need rounding
                b_lo = _rne_bf16(b_lo)
                b_hi = _rne_bf16(b_hi)
            else:  # <= 4 significant bits, normal or Inf: truncation is exact
                b_lo = b_lo >> 16
                b_hi = b_hi >> 16
        tl.store(out_ptr + first * 16 + offs, _join_pairs(b_lo, b_hi, IN_BF16),
                 mask=rmask[:, None], cache_modifier=".cs")
    else:
        sat = tl.where(nonfinite, NAN_CODE, MAX_CODE).to(tl.uint32)
        c_lo = _code(ay_lo, sat, MBITS, EMIN)
        c_hi = _code(ay_hi, sat, MBITS, EMIN)
        if NAN_CODE > MAX_CODE:  # FP8: every code of a non-finite block is the NaN code
            nan_or = tl.where(nonfinite, NAN_CODE, 0)[:, None]
            c_lo = c_lo | nan_or
            c_hi = c_hi | nan_or
        # sign bit 31 -> bit SIGN_SHIFT (arithmetic shift)
        c_lo = c_lo | ((lo >> (31 - SIGN_SHIFT)) & (1 << SIGN_SHIFT))
        c_hi = c_hi | ((hi >> (31 - SIGN_SHIFT)) & (1 << SIGN_SHIFT))
        if PACK:  # byte: column 2i in the low nibble
            tl.store(out_ptr + first * 16 + offs, (c_lo | (c_hi << 4)).to(tl.uint8),
                     mask=rmask[:, None], cache_modifier=".cs")
        else:  # int16: column 2i in the low byte
            tl.store(out_ptr + first * 16 + offs, (c_lo | (c_hi << 8)).to(tl.int16),
                     mask=rmask[:, None], cache_modifier=".cs")
        sbyte = tl.where(nonfinite, 255, k + 127).to(tl.uint8)
        tl.store(scale_ptr + first + rows, sbyte, mask=rmask)


def _mx_dequantize_kernel(
    data_ptr, scale_ptr, out_ptr, n_blocks,
    MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, INF_CODE: tl.constexpr,
    SIGN_SHIFT: tl.constexpr, PACK: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_B: tl.constexpr,
    LOW_K: tl.constexpr, HIGH_K: tl.constexpr,
):
    """Codes are read in signed pairs (an int8 for FP4, an int16 for FP8) and written as pair
    words (int32 for bf16, int64 for fp32)."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * BLOCK_B
    rows = tl.arange(0, BLOCK_B)
    rmask = rows < n_blocks - first
    offs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]
    # a sign-extended pair: bit 31 is the sign of the odd column's code
    v = tl.load(data_ptr + first * 16 + offs, mask=rmask[:, None], other=0, eviction_policy="evict_first").to(tl.int32)
    c_lo = v << (31 - SIGN_SHIFT)  # bit 31: the even column's sign
    if PACK:
        mag_lo = v & 0x7
        mag_hi = (v >> 4) & 0x7
    else:
        mag_lo = v & 0x7F
        mag_hi = (v >> 8) & 0x7F
    s = tl.load(scale_ptr + first + rows, mask=rmask, other=127).to(tl.int32)
    k = s - 127
    nanrow = s == 255
    # rare: some block's values leave the normal fp32 range (k = 128 is the NaN scale)
    slow = tl.max(((k < LOW_K) | ((k > HIGH_K) & (s != 255))).to(tl.int32), axis=0) > 0
    if slow:
        b_lo = _decode_bits(mag_lo, k[:, None], MBITS, EMIN)
        b_hi = _decode_bits(mag_hi, k[:, None], MBITS, EMIN)
    else:
        b_lo = _decode_fast(mag_lo, k, MBITS, EMIN)
        b_hi = _decode_fast(mag_hi, k, MBITS, EMIN)
    b_lo = _finish_decode(b_lo, mag_lo, c_lo, nanrow, MBITS, MAX_CODE, INF_CODE, SIGN_SHIFT)
    b_hi = _finish_decode(b_hi, mag_hi, v, nanrow, MBITS, MAX_CODE, INF_CODE, SIGN_SHIFT)
    if OUT_BF16:
        if slow:
            b_lo = _rne_bf16(b_lo)
            b_hi = _rne_bf16(b_hi)
        else:  # normal values with <= 4 significant bits, Inf or NaN: truncation is exact
            b_lo = b_lo >> 16
            b_hi = b_hi >> 16
    tl.store(out_ptr + first * 16 + offs, _join_pairs(b_lo, b_hi, OUT_BF16),
             mask=rmask[:, None], cache_modifier=".cs")


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
# Dequantize's fast path also needs k <= HIGH_K = 127 - emax (passed per format): the largest
# value stays finite, so the integer exponent add cannot carry out of the exponent field.
LOW_K = -109

# (blocks of 32 per program, warps) on GPU; benchmarks/mx.py --sweep tunes these. From the H200
# sweep of 14 configs, 2026-12-01 (docs/results/mx_sweep_h200_2026-12-01.json): the best worst
# case over bf16/fp32 x E4M3/E2M1 at 8192x8192. Small programs win (16-32 elements a thread,
# many resident programs per SM); loads are evict-first and stores streaming (.cs): every byte
# is touched once.
GPU_CONFIG = {"quantize": (32, 1), "dequantize": (64, 1)}


def _launch_cfg(x: torch.Tensor, op: str):
    _check_device(x)
    interpret = not x.is_cuda
    if interpret:  # big programs keep the interpreter fast
        return True, 256, 4
    bb, warps = GPU_CONFIG[op]
    return False, bb, warps


def _pairs(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a contiguous tensor (even last dim) as words of two elements."""
    if t.storage_offset() % 2:  # a view must start on a word boundary
        t = t.clone()
    return t.view(dtype)


_PAIR = {torch.bfloat16: torch.int32, torch.float32: torch.int64}


def quantize(x: torch.Tensor, fmt: ElemFormat, rule: str, fake: bool = False):
    """x: contiguous [..., K] float32/bfloat16 with K % 32 == 0 (checked by the caller)."""
    n_blocks = x.numel() // BLOCK
    if fake:
        out = torch.empty_like(x)
        out_arg, scale = out.view(_PAIR[x.dtype]), out  # (scale unused)
    else:
        k = x.shape[-1]
        out = torch.empty(*x.shape[:-1], k // 2 if fmt.packed else k, dtype=torch.uint8,
                          device=x.device)
        out_arg = out if fmt.packed else out.view(torch.int16)
        scale = torch.empty(*x.shape[:-1], k // BLOCK, dtype=torch.uint8, device=x.device)
    if n_blocks:
        interpret, bb, warps = _launch_cfg(x, "quantize")
        kern = _kernel("quantize")
        grid = (triton.cdiv(n_blocks, bb),)
        kern[grid](_pairs(x, _PAIR[x.dtype]), out_arg, scale, n_blocks,
                   MBITS=fmt.mbits, EMIN=fmt.emin, EMAX=fmt.emax, MAX_CODE=fmt.max_code,
                   MAX_MANT=_max_mant(fmt), NAN_CODE=fmt.nan_code, SIGN_SHIFT=fmt.bits - 1,
                   PACK=fmt.packed, RCEIL=(rule == "rceil"), FAKE=fake,
                   IN_BF16=(x.dtype == torch.bfloat16), BLOCK_B=bb,
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
        kern[grid](codes.view(torch.int8) if fmt.packed else _pairs(codes, torch.int16), scale,
                   out.view(_PAIR[dtype]), n_blocks,
                   MBITS=fmt.mbits, EMIN=fmt.emin, MAX_CODE=fmt.max_code, INF_CODE=inf_code,
                   SIGN_SHIFT=fmt.bits - 1, PACK=fmt.packed, OUT_BF16=(dtype == torch.bfloat16),
                   BLOCK_B=bb, LOW_K=LOW_K, HIGH_K=127 - fmt.emax,
                   **({} if interpret else {"num_warps": warps}))
    return out
