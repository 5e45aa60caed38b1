"""Backend choice shared by the elementwise/permute kernel folders (``situ``, ``moe_permute``)."""

from __future__ import annotations

import torch

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_triton(x: torch.Tensor, backend: str, op: str) -> bool:
    """True for ``"triton"``, and for ``"auto"`` on a CUDA tensor; ``op`` names the kernels in errors."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; expected one of {BACKENDS}")
    use = backend == "triton" or (backend == "auto" and x.is_cuda)
    if use and x.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton {op} kernels take {TRITON_DTYPES}, got {x.dtype}")
    return use
