"""Batched quintic Newton–Schulz: the torch iteration, a fused Triton kernel and a float64 reference.

``newton_schulz_triton`` has the signature of ``newton_schulz`` and can be passed to
``K3Muon(ns_fn=...)``; batches it cannot take (blocks with more than 128 rows after making
them wide, or no CUDA and no interpreter) go to the torch version. The Triton module (and
triton itself) is imported on first use of its names.
"""

from kernels.newton_schulz.reference import newton_schulz_reference  # noqa: F401
from kernels.newton_schulz.torch_ns import NS_COEFFS, NS_STEPS, default_ns_dtype, newton_schulz  # noqa: F401

_TRITON_NAMES = ("newton_schulz_triton", "triton_supports")


def __getattr__(name: str):
    if name in _TRITON_NAMES:
        from kernels.newton_schulz import triton_ns

        return getattr(triton_ns, name)
    raise AttributeError(f"module 'kernels.newton_schulz' has no attribute {name!r}")
