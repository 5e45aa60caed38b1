"""MXFP8 GEMM, emulated: both operands quantized to E4M3 with 1×32 E8M0 block scales along the
reduction dim, then multiplied in ordinary floating point with fp32 accumulation.

    mxfp8_matmul(a, b) = Q(a) · Q(b)ᵀ,   a [M, K], b [N, K] → [M, N]

Q quantizes each row in blocks of 32 along K with the ``rceil`` scale rule (the block's amax
rounded up to a power of two times 448, as Transformer Engine's MXFP8 quantizer does) and
returns the decoded values. Every decoded value e·2^s has 4 significant bits, so it is exact in
bf16 and fp32, and every product of two is exact in fp32: the result differs from the true
MXFP8 GEMM (:func:`mxfp8_matmul_reference`, all in float64) only by the fp32 accumulation order.
A K that is not a multiple of 32 is padded with zeros (zeros never change a block's scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import mx_fake_quantize, reference
from .formats import BLOCK, E4M3

RULE = "rceil"


def _padded(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[-1] % BLOCK
    return F.pad(x, (0, pad)) if pad else x


def mxfp8_fake_quantize(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Q(x): x [..., K] (fp32/bf16, any K) quantized to MXFP8 E4M3 along K and decoded, x's dtype."""
    k = x.shape[-1]
    return mx_fake_quantize(_padded(x), E4M3, RULE, backend)[..., :k]


def mxfp8_matmul(a: torch.Tensor, b: torch.Tensor, compute_dtype: torch.dtype = torch.float32,
                 backend: str = "auto") -> torch.Tensor:
    """Q(a) · Q(b)ᵀ for a [M, K], b [N, K] → [M, N] in ``compute_dtype`` (fp32 or bf16 operands;
    bf16 is exact for the decoded values and runs on tensor cores with fp32 accumulation)."""
    return mxfp8_fake_quantize(a, backend).to(compute_dtype) @ mxfp8_fake_quantize(b, backend).to(compute_dtype).t()


def mxfp8_matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The MXFP8 GEMM in float64: the float64 reference quantizer on both operands, float64 matmul."""
    def q(x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        codes, scale = reference.quantize_codes(_padded(x.float()), E4M3, RULE)
        return reference.dequantize_codes(codes, scale, E4M3, torch.float32).double()[..., :k]

    return q(a) @ q(b).t()
