"""Fused batched Newton–Schulz in Triton: one program per matrix, all steps in one launch.

For a wide block X [M, N] (M <= 128) a program keeps the Gram matrix A = X Xᵀ [M, M] and
B = b A + c A² in registers and streams X through column tiles twice per step:

    pass 1: A  = Σ_k X[:, k] X[:, k]ᵀ                (fp32 accumulate)
    pass 2: X' = a X[:, n] + B X[:, n]   for each n   (written to the other buffer)

so one step reads X twice and writes it once, with no [B, M, M] intermediates in global
memory and one launch for all steps (torch: 3 GEMM launches per step). The ping-pong
buffers are private to the program; a barrier orders one step's writes before the
next step's reads.

Dots take bf16 operands on GPU (fp32 accumulate); under ``TRITON_INTERPRET=1`` they take
fp32 (bf16 ``tl.dot`` is wrong in the interpreter, DESIGN.md §7).
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.newton_schulz.torch_ns import NS_COEFFS, NS_STEPS, newton_schulz, unwide, wide_batch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing
    triton = None

MAX_ROWS = 128


def _interpret() -> bool:
    """Whether the kernel below was built for Triton's interpreter (decided at import)."""
    if triton is None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_ns_fused_kernel, InterpretedFunction)


def triton_supports(G: torch.Tensor) -> bool:
    if triton is None or G.ndim not in (2, 3):
        return False
    m = min(G.shape[-2], G.shape[-1])
    return m <= MAX_ROWS and (G.is_cuda or (_interpret() and G.device.type == "cpu"))


if triton is not None:

    @triton.jit
    def _ns_fused_kernel(
        X, Y, M, N, stride_b, stride_m,
        a, b, c, scale_last,
        STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        rm = tl.arange(0, BM)
        rn = tl.arange(0, BN)
        row_ok = rm < M
        src = X + pid * stride_b
        dst = Y + pid * stride_b
        for step in tl.static_range(STEPS):
            acc = tl.zeros((BM, BM), dtype=tl.float32)
            for k0 in range(0, N, BN):
                cols = k0 + rn
                msk = row_ok[:, None] & (cols[None, :] < N)
                x = tl.load(src + rm[:, None] * stride_m + cols[None, :], mask=msk, other=0.0)
                if DOT_FP32:
                    x = x.to(tl.float32)
                acc = tl.dot(x, tl.trans(x), acc)
            if DOT_FP32:
                Ad = acc
            else:
                Ad = acc.to(tl.bfloat16)
            # B = b A + c A A, with A as the dot's accumulator (fewer live [BM, BM] tiles)
            Bm = tl.dot(Ad, Ad, acc * (b / c)) * c
            if DOT_FP32:
                Bd = Bm
            else:
                Bd = Bm.to(tl.bfloat16)
            if step == STEPS - 1:  # static: step is a constexpr of static_range
                s = scale_last
            else:
                s = 1.0
            for n0 in range(0, N, BN):
                cols = n0 + rn
                msk = row_ok[:, None] & (cols[None, :] < N)
                offs = rm[:, None] * stride_m + cols[None, :]
                x = tl.load(src + offs, mask=msk, other=0.0)
                if DOT_FP32:
                    xd = x.to(tl.float32)
                else:
                    xd = x
                out = tl.dot(Bd, xd, a * x.to(tl.float32)) * s
                tl.store(dst + offs, out.to(dst.dtype.element_ty), mask=msk)
            tl.debug_barrier()
            src, dst = dst, src


def newton_schulz_triton(
    G: torch.Tensor,
    steps: int = NS_STEPS,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    eps: float = 1e-7,
    scale: float = 1.0,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Same contract as ``newton_schulz``; unsupported inputs fall back to it."""
    if not triton_supports(G):
        return newton_schulz(G, steps=steps, coeffs=coeffs, eps=eps, scale=scale, dtype=dtype)
    G, squeeze, tall, dtype = wide_batch(G, steps, dtype)
    Bsz, M, N = G.shape
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(G.dtype, torch.float32))
    X = torch.empty((Bsz, M, N), dtype=dtype, device=G.device)
    torch.div(G, norm.add_(eps), out=X)
    Y = torch.empty_like(X)
    BM = max(16, triton.next_power_of_2(M))
    # tiles chosen with ptxas -v for sm_90a: no or negligible spills (docs/muon_notes.md)
    BN = 64 if BM >= 64 else 128
    BN = min(BN, max(16, triton.next_power_of_2(N)))
    num_warps = 8 if BM >= 64 else 4
    a, b, c = coeffs
    interp = _interpret()
    _ns_fused_kernel[(Bsz,)](
        X, Y, M, N, X.stride(0), X.stride(1),
        float(a), float(b), float(c), float(scale),
        STEPS=steps, BM=BM, BN=BN, DOT_FP32=interp or dtype == torch.float32,
        num_warps=num_warps,
    )
    return unwide(Y if steps % 2 == 1 else X, squeeze, tall)
