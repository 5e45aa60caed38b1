"""MX element formats, scale rules and input checks shared by the reference and the Triton path.

An MX tensor splits the last (reduction) dimension into blocks of ``BLOCK`` = 32
elements. Each block stores one E8M0 scale byte ``s`` (value ``2**(s - 127)``,
``s = 255`` is NaN) and 32 element codes in one of the formats below.

The numeric policy is written down in ``docs/mx_notes.md``; in short:

* scale rule ``"floor"`` (OCP MX v1.0): ``k = floor(log2(amax)) - emax_elem``;
* scale rule ``"rceil"``: the smallest ``k`` with ``amax <= max_elem * 2**k``,
  i.e. ``amax / max_elem`` rounded up to a power of two, computed exactly;
* ``k`` is clamped to [-127, 127]; an all-zero block gets ``k = -127`` (byte 0);
* elements ``x / 2**k`` are rounded to nearest, ties to even, and saturate at
  ``±max_elem``; the sign of the input is kept, so ``-0.0`` and small negative
  values that round to zero give a negative zero code;
* a block holding any NaN or ±Inf gets the NaN scale byte 255; its element codes
  are the format's NaN code with the input's sign (E4M3/E5M2: ``0x7F``) or a
  signed zero (E2M1, which has no NaN). Every element of such a block
  dequantizes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
SCALE_BIAS = 127
SCALE_NAN = 255

SCALE_RULES = ("floor", "rceil")


@dataclass(frozen=True)
class ElemFormat:
    name: str
    ebits: int
    mbits: int  # explicit mantissa bits (M)
    bias: int
    max_value: float
    max_code: int  # magnitude code of max_value (sign bit excluded)
    nan_code: int  # magnitude code used for NaN blocks (0 for E2M1: it has no NaN)
    has_inf: bool
    torch_dtype: torch.dtype | None  # storage dtype for the unpacked codes (None: packed uint8)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest normal number (floor(log2(max)))."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def packed(self) -> bool:
        return self.bits == 4


E4M3 = ElemFormat("e4m3", 4, 3, 7, 448.0, 0x7E, 0x7F, False, torch.float8_e4m3fn)
E5M2 = ElemFormat("e5m2", 5, 2, 15, 57344.0, 0x7B, 0x7F, True, torch.float8_e5m2)
E2M1 = ElemFormat("e2m1", 2, 1, 1, 6.0, 0x7, 0x0, False, None)

FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}
_ALIASES = {
    "mxfp8": "e4m3",
    "mxfp8_e4m3": "e4m3",
    "mxfp8_e5m2": "e5m2",
    "mxfp4": "e2m1",
    "mxfp4_e2m1": "e2m1",
    "fp4": "e2m1",
}

INPUT_DTYPES = (torch.float32, torch.bfloat16)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16)

# E2M1 magnitudes by 3-bit code, K3_SPEC.md §4.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def get_format(fmt) -> ElemFormat:
    if isinstance(fmt, ElemFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"MX format must be a string or ElemFormat, got {type(fmt).__name__}")
    key = _ALIASES.get(fmt.lower(), fmt.lower())
    if key not in FORMATS:
        raise ValueError(f"unknown MX element format {fmt!r}; expected one of "
                         f"{sorted(FORMATS) + sorted(_ALIASES)}")
    return FORMATS[key]


def check_rule(rule: str) -> str:
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown MX scale rule {rule!r}; expected one of {SCALE_RULES}")
    return rule


def check_input(x: torch.Tensor, what: str = "input") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"MX {what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"MX {what} dtype {x.dtype} is not supported; expected one of "
                        f"{INPUT_DTYPES} (cast first)")
    if x.dim() == 0:
        raise ValueError(f"MX {what} must have at least one dimension (the reduction dim)")
    if x.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"MX {what}: the last (reduction) dimension is {x.shape[-1]}, which is not a multiple "
            f"of the block size {BLOCK}. Pad it with zeros to a multiple of {BLOCK} first "
            f"(zeros never change a block's scale) and crop after dequantizing.")


def check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"MX dequantize output dtype {dtype} is not supported; expected one of "
                        f"{OUTPUT_DTYPES}")


def check_encoded(data: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat) -> int:
    """Validate (data, scale) of an encoded MX tensor; return the logical last-dim size K."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"MX scale must be uint8 (E8M0), got {scale.dtype}")
    if fmt.packed:
        if data.dtype != torch.uint8:
            raise TypeError(f"packed MXFP4 data must be uint8, got {data.dtype}")
        k = data.shape[-1] * 2 if data.dim() else 0
    else:
        if data.dtype not in (fmt.torch_dtype, torch.uint8):
            raise TypeError(f"MXFP8 {fmt.name} data must be {fmt.torch_dtype} or uint8 codes, "
                            f"got {data.dtype}")
        k = data.shape[-1] if data.dim() else 0
    if data.dim() == 0 or data.dim() != scale.dim() or data.shape[:-1] != scale.shape[:-1] \
            or k % BLOCK != 0 or scale.shape[-1] != k // BLOCK:
        per = "cols/2 bytes" if fmt.packed else "cols"
        raise ValueError(
            f"MX {fmt.name}: data shape {tuple(data.shape)} ({per}) does not match scale shape "
            f"{tuple(scale.shape)}; expected scale [..., cols/{BLOCK}] with the same leading dims")
    return k
