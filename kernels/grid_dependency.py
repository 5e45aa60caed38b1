"""Programmatic dependent launch (PDL, sm_90+) for the MoE layer's chain of small Triton kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream is still running:
once every program of that kernel has signalled (``griddepcontrol.launch_dependents``) or exited. Its programs
then wait (``griddepcontrol.wait``) until that kernel has finished and its writes are visible. Every kernel here
signals and waits as its first two instructions (``wait_for_previous_kernel``), before it reads or writes any
memory, so:

* a kernel never sees a predecessor's partial results, nor overwrites what a predecessor still reads;
* the order is transitive: a kernel's wait returns only after its predecessor's own wait has returned;
* what overlaps is the launch and the scheduling of a kernel's first programs with its predecessor's last wave
  (a predecessor signals once all its programs have started, so none of its programs waits for a slot that a
  waiting dependent holds).

The CUTLASS expert-tiled products (``kernels.grouped_gemm_sm90``, built with ``CUTLASS_ENABLE_GDC_FOR_SM90``)
launch the same way: CUTLASS's kernels wait before their first loads and signal as their mainloops end, and the
expert tile scheduler waits before it reads ``tile_expert``. Kernels launched without the attribute (cuBLAS,
torch's, the other CUTLASS paths) keep the plain stream order on both sides. Stream capture keeps the dependency
as a programmatic edge of the CUDA graph.

Opt-in (``K3_PDL=1`` in the environment, read at each launch) until it is measured on a GPU: the CPU tests only
compile the kernels for sm_90 with it on (``tests/kernels/test_grid_dependency.py``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (no-ops without ``PDL``)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: ``K3_PDL=1`` and a CUDA device of compute capability 9.0 or
    newer (the interpreter runs no PTX)."""
    return os.environ.get("K3_PDL") == "1" and t.is_cuda and _hopper_or_newer(t.device.index)


def launch_options(t: torch.Tensor) -> dict:
    """The ``PDL`` constexpr and Triton's ``launch_pdl`` option for a Triton kernel on t's device (``enabled``)."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}


@functools.cache
def _hopper_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
