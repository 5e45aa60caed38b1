"""Batched quintic Newton–Schulz: a fused Triton kernel and its plain-torch reference.

``newton_schulz_triton`` has the signature of ``k3train.optim.newton_schulz.newton_schulz``
and can be passed to ``K3Muon(ns_fn=...)``; batches it cannot take (blocks with more than
128 rows after making them wide, or no CUDA and no interpreter) go to the torch version.
"""

from kernels.newton_schulz.reference import newton_schulz_reference  # noqa: F401
from kernels.newton_schulz.triton_ns import newton_schulz_triton, triton_supports  # noqa: F401
