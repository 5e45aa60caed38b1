"""Timing and memory of one autograd op, shared by the kernel benchmarks (attn_res, short_conv,
cross_entropy).

``median_ms``: on CUDA ``triton.testing.do_bench``'s median (``warmup`` and ``rep`` in ms, its
convention); on CPU ``warmup`` untimed calls, then the median of ``rep`` timed ones.
``graph_ms``: the median of replays of ``fn`` captured in a CUDA graph: GPU time alone, without the host's
autograd and launch overhead that ``do_bench`` includes once the host, not the GPU, sets the pace.
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


def graph_ms(fn: Callable[[], object], rep: int = 100) -> float | None:
    """Median ms of ``fn``'s CUDA-graph replays (``triton.testing.do_bench_cudagraph``), or None, said on
    stdout, when ``fn`` cannot be captured (e.g. it reads a value back to the host)."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as err:  # noqa: BLE001 - the caller times it another way
        print(f"  (no CUDA graph: {type(err).__name__}: {str(err)[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


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
