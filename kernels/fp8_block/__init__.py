"""DeepSeek-V3-style FP8 block scaling (E4M3): activations and gradients in 1×128 blocks along the
reduction dim, weights in 128×128 tiles, one fp32 scale per block (scale = amax/448).

* ``reference.py``: the quantizers, their inverses and the dequantize-then-matmul reference GEMM
  (plain torch, any device);
* ``scaled_mm.py``: the same GEMM on the GPU through ``torch._scaled_mm``'s blockwise scaling
  (cuBLAS, CUDA ≥ 12.9, sm_90+).

Every GEMM here is ``a · bᵀ`` with a [M, K], b [N, K]: both operands are reduced along their last dim.
"""

from .reference import (BLOCK, E4M3_MAX, dequantize_1x128, dequantize_128x128, fp8_block_matmul_reference,
                        quantize_1x128, quantize_128x128)
from .scaled_mm import fp8_block_matmul, fp8_block_unavailable

__all__ = ["BLOCK", "E4M3_MAX", "quantize_1x128", "quantize_128x128", "dequantize_1x128", "dequantize_128x128",
           "fp8_block_matmul_reference", "fp8_block_matmul", "fp8_block_unavailable"]
