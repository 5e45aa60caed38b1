"""Timing and memory of one autograd op, shared by the kernel benchmarks (attn_res, short_conv,
cross_entropy).

``median_ms``: on CUDA ``triton.testing.do_bench``'s median (``warmup`` and ``rep`` in ms, its
convention); on CPU ``warmup`` untimed calls, then the median of ``rep`` timed ones.
``graph_ms``: the median of replays of ``fn`` captured in a CUDA graph: GPU time alone, without the host's
autograd and launch overhead that ``do_bench`` includes once the host, not the GPU, sets the pace.
``held_mib``: what autograd keeps alive after one forward, beyond the output itself (CUDA only).
``kernel_ms``: each CUDA kernel's time per call of ``fn`` (torch.profiler), to see where a row's time goes.
"""

from __future__ import annotations

import hashlib
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


def kernel_key(name: str, name_chars: int = 80) -> str:
    """A kernel's name cut to ``name_chars``, with a short hash of the whole name where it was cut: template
    kernels (CUTLASS's mangled names) share long prefixes, and cut bare they would be summed as one kernel."""
    if len(name) <= name_chars:
        return name
    return f"{name[:name_chars]} #{hashlib.sha1(name.encode()).hexdigest()[:6]}"


def kernel_ms(fn: Callable[[], object], iters: int = 5, name_chars: int = 80) -> dict[str, float]:
    """{kernel name (``kernel_key``): GPU ms per call of fn}, largest first, from torch.profiler over ``iters``
    calls after two untimed ones. Eager launches, so the sum can exceed a CUDA-graph replay's time only by
    gaps, not by host overhead (the profiler times kernels on the device)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0:
            key = kernel_key(e.key, name_chars)
            out[key] = out.get(key, 0.0) + t / 1e3 / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
