"""K3 Kimi Delta Attention (KDA) operator.

``kda(...)`` is the one entry point the model calls.  CUDA tensors go to the Triton
chunkwise kernels (``kernels.kda.chunk``); CPU tensors, or a machine without
Triton/CUDA, go to the plain-PyTorch chunked reference (``kernels.kda.reference``).
See docs/kda_notes.md for the design and measured numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..backend import triton_device
from .memo import TensorMemo
from .reference import kda_chunked, kda_recurrent

__all__ = ["kda", "kda_chunked", "kda_recurrent", "validate_inputs", "MAX_K", "MAX_V",
           "MIN_LOWER_BOUND"]

# Limits of the Triton kernel (register tiles); the CPU path enforces the same contract.
MAX_K = 128
MAX_V = 256
# The kernel's 32-token chunk uses one reference point at its middle, so the per-tile
# rescale is at most exp(16 * |lower_bound|) = exp(80) at -5: inside fp32/bf16 range.
MIN_LOWER_BOUND = -5.0

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError("kda: " + msg)


_CHECKED = TensorMemo()  # cu_seqlens → its checked values (tuple)


def _checked(cu: Sequence[int], T: int) -> tuple[int, ...]:
    _check(cu[0] == 0, f"cu_seqlens must start at 0, got {cu[0]}")
    _check(cu[-1] == T, f"cu_seqlens must end at T = {T}, got {cu[-1]}")
    last = cu.index(T)  # the end of the last document; empty ones may follow
    _check(all(b > a for a, b in zip(cu[:last], cu[1:last + 1])),
           "cu_seqlens must be strictly increasing up to T (empty documents only at the end)")
    return tuple(cu)


def _checked_offsets(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """The values of ``cu_seqlens`` (0 = c_0 < c_1 < … < c_N = T; empty documents, c_n = c_{n+1}, only
    at the end, where callers pad to a fixed length) as a list, checked. Read back once per tensor and
    version (a host sync for a device tensor; the model passes one tensor to all its KDA layers), then
    remembered, unless ``known_offsets`` gave them first."""
    return list(_CHECKED.get(cu_seqlens, T, lambda: _checked(cu_seqlens.tolist(), T)))


def known_offsets(cu_seqlens: torch.Tensor, values: Sequence[int]) -> None:
    """The values of ``cu_seqlens`` (a device tensor) that the caller also holds on the host, e.g. counted
    on the host copy of the batch: checked now, so that checking the tensor later reads nothing back."""
    values = [int(v) for v in values]
    _check(len(values) == cu_seqlens.numel() >= 2,
           f"known_offsets: {len(values)} values for a cu_seqlens of {cu_seqlens.numel()} entries")
    _CHECKED.get(cu_seqlens, values[-1], lambda: _checked(values, values[-1]))


def validate_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                    cu_seqlens):
    """Raise ValueError on anything the kernels would get silently wrong.

    Returns the number of sequences N and the cu_seqlens as a Python list (or None). Inside
    ``torch.compile`` the values of cu_seqlens are not read back to the host (that would be a
    sync and a graph break): only their shape and dtype are checked, and the list is None."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor")
    _check(q.dim() == 4, f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    _check(k.shape == q.shape, f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    _check(g.shape == q.shape, f"g shape {tuple(g.shape)} != q shape {tuple(q.shape)}")
    _check(v.dim() == 4 and v.shape[:3] == q.shape[:3],
           f"v must be [B, T, H, V] matching q's [B, T, H], got {tuple(v.shape)}")
    V = v.shape[-1]
    _check(beta.shape == (B, T, H), f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    _check(T >= 1 and B >= 1 and H >= 1, f"empty input shape {tuple(q.shape)}")
    _check(1 <= K <= MAX_K, f"K = {K} is above the supported maximum {MAX_K}")
    _check(1 <= V <= MAX_V, f"V = {V} is above the supported maximum {MAX_V}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check(t.dtype in _FLOATS, f"{name} has unsupported dtype {t.dtype}")
    _check(q.dtype == k.dtype == v.dtype,
           f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check(A_log.dtype == torch.float32 and A_log.shape == (H,),
           f"A_log must be fp32 [H] = [{H}], got {A_log.dtype} {tuple(A_log.shape)}")
    _check(dt_bias.dtype == torch.float32 and dt_bias.shape == (H * K,),
           f"dt_bias must be fp32 [H*K] = [{H * K}], got {dt_bias.dtype} {tuple(dt_bias.shape)}")
    dev = q.device
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        _check(t.is_contiguous(), f"{name} must be contiguous")
        _check(t.device == dev, f"{name} is on {t.device}, q is on {dev}")
    lb = float(lower_bound)
    _check(math.isfinite(lb) and MIN_LOWER_BOUND <= lb < 0.0,
           f"lower_bound = {lower_bound} outside [{MIN_LOWER_BOUND}, 0), where the kernel is exact")
    if scale is not None:
        _check(math.isfinite(float(scale)), f"scale = {scale} is not finite")
    cu = None
    if cu_seqlens is not None:
        _check(isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
               and cu_seqlens.dtype in (torch.int32, torch.int64),
               "cu_seqlens must be a 1-D int32/int64 tensor")
        _check(B == 1, f"cu_seqlens needs B == 1 (packed documents), got B = {B}")
        _check(cu_seqlens.numel() >= 2, "cu_seqlens needs at least 2 entries")
        N = cu_seqlens.numel() - 1
        if not torch.compiler.is_compiling():  # a compiled graph never reads values back
            cu = _checked_offsets(cu_seqlens, T)
    else:
        N = B
    if initial_state is not None:
        _check(isinstance(initial_state, torch.Tensor)
               and initial_state.shape == (N, H, K, V) and initial_state.dtype == torch.float32,
               f"initial_state must be fp32 [N, H, K, V] = {(N, H, K, V)}, got "
               f"{getattr(initial_state, 'dtype', None)} {tuple(getattr(initial_state, 'shape', ()))}")
        _check(initial_state.is_contiguous(), "initial_state must be contiguous")
        _check(initial_state.device == dev, "initial_state is on another device")
    return N, cu


def _triton_ok(q: torch.Tensor) -> bool:
    if not triton_device(q):
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


def kda(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None,
        initial_state=None, output_final_state=False, cu_seqlens=None,
        use_qk_l2norm=True):
    """K3 KDA.  Returns (o [B,T,H,V] in v's dtype, final_state [N,H,K,V] fp32 or None).

    q, k: [B,T,H,K]; v: [B,T,H,V]; g: raw gate input [B,T,H,K]; beta: raw logits [B,T,H];
    A_log: fp32 [H]; dt_bias: fp32 [H*K].  gate = lower_bound*sigmoid(exp(A_log)*(g+dt_bias)),
    beta = sigmoid(beta), q/k L2-normalised when use_qk_l2norm, scale = 1/sqrt(K) by default.
    cu_seqlens (B == 1): packed documents, the state resets to initial_state[n] (or 0)."""
    validate_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                    cu_seqlens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if _triton_ok(q):
        from .chunk import kda_triton
        return kda_triton(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound,
                          scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          use_qk_l2norm=use_qk_l2norm, validate=False)
    return kda_chunked(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, scale=scale,
                       initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
