"""Timing and memory of one autograd op, shared by the kernel benchmarks (attn_res, short_conv,
cross_entropy).

``median_ms``: on CUDA ``triton.testing.do_bench``'s median (``warmup`` and ``rep`` in ms, its
convention); on CPU ``warmup`` untimed calls, then the median of ``rep`` timed ones.
``held_mib``: what autograd keeps alive after one forward, beyond the output itself (CUDA only).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: str, warmup: int, rep: int) -> float:
    """Median ms of fn()."""
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    times = []
    for i in range(warmup + rep):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def held_mib(forward: Callable[[], torch.Tensor], device: str) -> float | None:
    """MiB allocated by one call of ``forward`` that outlive it, minus its output; None off CUDA."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    held = (torch.cuda.memory_allocated() - before - out.numel() * out.element_size()) / 2**20
    del out
    return held
