"""Plain-torch FP8 block quantizers and the reference GEMM.

For a block X_b (1×128 along a row, or a 128×128 tile):

    s_b = amax(|X_b|) / 448   (1 for an all-zero block),   Q_b = E4M3_RNE(X_b / s_b) ∈ [-448, 448]

so each block's largest element maps to ±448. Dimensions that are not multiples of 128 are
padded with zeros for the scale computation; data keeps the input's shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3_MAX = 448.0


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(x, (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))


def _encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] → (q float8_e4m3fn [R, C], s fp32 [R, ⌈C/128⌉]), blocks of 128 along each row."""
    r, c = x.shape
    xb = _pad_to(x.float(), 1, BLOCK).view(r, -1, BLOCK)
    s = _scale(xb.abs().amax(-1))
    return _encode(xb, s.unsqueeze(-1)).view(r, -1)[:, :c], s


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] → (q float8_e4m3fn [R, C], s fp32 [⌈R/128⌉, ⌈C/128⌉]), one scale per 128×128 tile."""
    r, c = w.shape
    wp = _pad_to(w.float(), BLOCK, BLOCK)
    tiles = wp.view(wp.shape[0] // BLOCK, BLOCK, wp.shape[1] // BLOCK, BLOCK)
    s = _scale(tiles.abs().amax(dim=(1, 3)))
    return _encode(tiles, s[:, None, :, None]).view(wp.shape)[:r, :c], s


def dequantize_1x128(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_1x128` up to the E4M3 rounding → fp32 [R, C]."""
    return q.float() * s.repeat_interleave(BLOCK, dim=1)[:, :q.shape[1]]


def dequantize_128x128(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_128x128` up to the E4M3 rounding → fp32 [R, C]."""
    full = s.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def fp8_block_matmul_reference(a: torch.Tensor, b: torch.Tensor, b_tiles: bool) -> torch.Tensor:
    """a [M, K] (1×128 blocks), b [N, K] (128×128 tiles if ``b_tiles`` else 1×128 blocks) →
    dequantize(Q(a)) · dequantize(Q(b))ᵀ [M, N], fp32."""
    a_dq = dequantize_1x128(*quantize_1x128(a))
    b_dq = dequantize_128x128(*quantize_128x128(b)) if b_tiles else dequantize_1x128(*quantize_1x128(b))
    return a_dq @ b_dq.t()
