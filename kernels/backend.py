"""Backend choice shared by the kernel folders (``use_triton``), and the eager/compiled call split of
their Triton paths (``eager_or_compiled``)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_triton_on_cpu = False  # true within ``triton_on_cpu()``


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Within it, "auto" picks the Triton paths for CPU tensors too. They run through Triton's
    interpreter, which ``TRITON_INTERPRET=1`` must have switched on before triton was imported: CPU
    tests of whole models on the kernels, and the launch census."""
    global _triton_on_cpu
    before, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = before


def triton_device(x: torch.Tensor) -> bool:
    """Whether "auto" sends ``x`` to the Triton kernels: a CUDA tensor, or any within ``triton_on_cpu()``."""
    return x.is_cuda or _triton_on_cpu


def use_triton(x: torch.Tensor, backend: str, op: str) -> bool:
    """True for ``"triton"``, and for ``"auto"`` on a ``triton_device``; ``op`` names the kernels in errors."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; expected one of {BACKENDS}")
    use = backend == "triton" or (backend == "auto" and triton_device(x))
    if use and x.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton {op} kernels take {TRITON_DTYPES}, got {x.dtype}")
    return use


def eager_or_compiled(eager, compiled):
    """One entry point over two implementations of a kernel call that take the same arguments:
    ``eager`` (the ``torch.autograd.Function``'s ``apply``, a direct Triton launch) outside
    ``torch.compile``, ``compiled`` (the ``torch.library`` custom op with fake shapes, which
    inductor keeps inside its graphs) while dynamo traces. Custom-op dispatch costs tens of µs a
    call in eager mode; a run that does not compile never pays it. The choice is made at trace
    time (``torch.compiler.is_compiling`` is a constant to dynamo), so a compiled graph holds the
    op and no check."""

    def call(*args):
        if torch.compiler.is_compiling():
            return compiled(*args)
        return eager(*args)

    call.eager, call.compiled = eager, compiled
    return call
