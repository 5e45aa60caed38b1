"""The FP8 block GEMM on the GPU: ``torch._scaled_mm`` with blockwise scales (cuBLAS ≥ 12.9, sm_90+).

    fp8_block_matmul(a, b, b_tiles) ≈ fp8_block_matmul_reference(a, b, b_tiles)   (fp32 accumulation)

cuBLAS reads the scales in fixed layouts (torch's ``is_blockwise_1x128_scaling`` /
``is_blockwise_128x128_scaling``), for A [M, K] row-major and B = bᵀ [K, N] column-major:

* A, 1×128: scale [M, K/128] with strides (1, M) (M-major);
* B, 1×128: the scale of bᵀ's rows, [N, K/128] with strides (1, N), passed transposed;
* B, 128×128: [N/128, K/128] row-major with its row stride rounded up to a multiple of 4
  (torch ≥ 2.10 checks the padded stride, older versions the unpadded one).

K is zero-padded to a multiple of 512, so K/128 is a multiple of 4 and both 128×128 layouts agree;
M and N are zero-padded to multiples of 16 (``_scaled_mm`` requires it). Zero padding adds zero
blocks only and is cropped from the result.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .reference import BLOCK, quantize_1x128, quantize_128x128

_K_MULTIPLE = 4 * BLOCK
_MN_MULTIPLE = 16


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pr, pc = -x.shape[0] % rows, -x.shape[1] % cols
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


def fp8_block_matmul(a: torch.Tensor, b: torch.Tensor, b_tiles: bool,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K] quantized 1×128, b [N, K] quantized 128×128 (``b_tiles``) or 1×128 → a·bᵀ [M, N]."""
    m, n = a.shape[0], b.shape[0]
    qa, sa = quantize_1x128(_pad(a, _MN_MULTIPLE, _K_MULTIPLE))
    qb, sb = (quantize_128x128 if b_tiles else quantize_1x128)(_pad(b, _MN_MULTIPLE, _K_MULTIPLE))
    scale_a = sa.t().contiguous().t()
    scale_b = sb.t() if b_tiles else sb.t().contiguous()
    y = torch._scaled_mm(qa.contiguous(), qb.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                         out_dtype=torch.bfloat16)
    return y[:m, :n].to(out_dtype)


@functools.cache
def fp8_block_unavailable() -> str | None:
    """None when :func:`fp8_block_matmul` runs on this machine, else the reason it does not."""
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU (sm_90+) and none is visible"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"it needs sm_90+, this GPU is sm_{major}{minor}"
    try:
        a = torch.randn(16, _K_MULTIPLE, device="cuda")
        fp8_block_matmul(a, torch.randn(BLOCK, _K_MULTIPLE, device="cuda"), b_tiles=True)
        fp8_block_matmul(a, torch.randn(BLOCK, _K_MULTIPLE, device="cuda"), b_tiles=False)
    except (RuntimeError, ValueError) as e:
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) has no blockwise torch._scaled_mm: {e}"
    return None
