"""Triton kernels for MX quantize / dequantize / fake-quantize.

The tensor is viewed as [n_blocks, 32] (blocks run along the contiguous last
dimension), and each program handles ``BLOCK_B`` blocks. All decisions that
must be exact are made on the fp32 bit patterns with integer ops; the only
float arithmetic is

* ``y = x * 2**-k`` (exact: the multiplier is a normal power of two, and a
  product that underflows is far below half the element format's smallest
  step, so it rounds to zero either way);
* the round-to-nearest-even step ``|y| + C`` with ``C = 2**(e + 23 - M)``: the
  fp32 adder rounds ``|y|`` to a multiple of ``2**(e - M)``, ties to even, and
  ``bits(|y| + C) - bits(C)`` is then the rounded integer mantissa;
* decoding: a code's exponent/mantissa bits shifted into an fp32 bit pattern read as a
  float are the element value times ``2**(bias - 127)``; two exact power-of-two multiplies
  give ``value * 2**k`` (at most 4 significant bits, results >= 2**-149, so exact; this needs
  IEEE subnormals, which plain fp32 multiplies in Triton keep: nothing here is flushed);
* fake quant: ``(|y| + C) - C`` is the rounded magnitude exactly, then ``min(., max)`` and
  ``* 2**k``.

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
def _round_out(val, OUT_BF16: tl.constexpr):
    """fp32 -> output dtype. bf16 is rounded here with integer ops (RNE, subnormals kept),
    so the interpreter and the GPU agree with torch's conversion bit for bit."""
    if OUT_BF16:
        vb = val.to(tl.int32, bitcast=True)
        r = ((vb + (0x7FFF + ((vb >> 16) & 1))) >> 16) & 0xFFFF
        r = tl.where(val != val, 0x7FC0, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return val


def _mx_quantize_kernel(
    x_ptr, out_ptr, scale_ptr, n_blocks,
    MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    MAX_CODE: tl.constexpr, MAX_MANT: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGN_SHIFT: tl.constexpr, PACK: tl.constexpr, RCEIL: tl.constexpr,
    FAKE: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_B: tl.constexpr,
    MAX_VALUE: tl.constexpr,
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
    k = tl.where(nonfinite, 0, k)

    # ---- y = x * 2**-k ; -k in [-127, 126] so the multiplier is a normal float ----
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    ay = tl.abs(x) * inv[:, None]

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
        # the rounded magnitude in units of 2**k: (|y| + C) - C is exact; saturate; * 2**k
        q = s_b.to(tl.float32, bitcast=True) - c_b.to(tl.float32, bitcast=True)
        q = tl.minimum(q, MAX_VALUE)
        # 2**k: normal for k >= -126, the subnormal 2**-127 otherwise (the product is exact)
        p2 = tl.where(k >= -126, (k + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)
        val = q * p2[:, None]
        val = tl.where(neg, -val, val)
        val = tl.where(nonfinite[:, None], float("nan"), val)
        tl.store(out_ptr + first * 32 + offs, _round_out(val, OUT_BF16), mask=rmask[:, None])
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
    BIAS_POW: tl.constexpr,
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

    neg = ((code >> SIGN_SHIFT) & 1) != 0
    mag = code & ((1 << SIGN_SHIFT) - 1)
    # the code's bits placed in an fp32 exponent/mantissa field read as a float are the element
    # value times 2**(bias - 127) (element subnormals become fp32 subnormals): rescale exactly
    val = (mag << (23 - MBITS)).to(tl.float32, bitcast=True) * BIAS_POW
    # * 2**k: normal for k >= -126, the subnormal 2**-127 for k = -127, Inf for the NaN scale
    p2 = tl.where(k >= -126, (k + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)
    val = val * p2[:, None]
    if MAX_CODE < (1 << SIGN_SHIFT) - 1:  # the format has Inf/NaN codes
        val = tl.where(mag > MAX_CODE, float("nan"), val)
        val = tl.where(mag == INF_CODE, float("inf"), val)
    val = tl.where(neg, -val, val)
    val = tl.where((s == 255)[:, None], float("nan"), val)
    tl.store(out_ptr + offs, _round_out(val, OUT_BF16), mask=rmask[:, None])


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


# (blocks of 32 per program, warps) on GPU; benchmarks/mx.py --sweep tunes these.
GPU_CONFIG = {"quantize": (64, 4), "dequantize": (64, 4)}


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
                   MAX_VALUE=fmt.max_value,
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
                   BLOCK_B=bb, BIAS_POW=2.0 ** (127 - fmt.bias),
                   **({} if interpret else {"num_warps": warps}))
    return out
