"""Newton–Schulz orthogonalization for Muon: the iteration lives in ``kernels/newton_schulz`` (torch,
reference and Triton); this module re-exports it and adds Muon's update scale.

Imports only torch, so benchmarks can import it on machines without megatron-core.
"""

from __future__ import annotations

from kernels.newton_schulz.reference import newton_schulz_reference  # noqa: F401
from kernels.newton_schulz.torch_ns import NS_COEFFS, NS_STEPS, default_ns_dtype, newton_schulz  # noqa: F401


def muon_update_scale(rows: int, cols: int) -> float:
    """RMS-matching scale 0.2*sqrt(max(rows, cols)) for an orthogonalized [rows, cols] block.

    An exactly semi-orthogonal [m, n] matrix has RMS 1/sqrt(max(m, n)); this scale gives
    every Muon update an RMS of 0.2, about that of an AdamW update, so Muon and AdamW
    groups can share one learning rate (Moonlight's recipe).
    """
    return 0.2 * max(rows, cols) ** 0.5
