"""The GPU kernels of profiled steps: busy time against the GPU timeline they spanned, and time by kind.

``kernel_summary(events, steps)`` reads a ``torch.profiler`` pass's events (its CUDA kernels, memsets and
copies; not the ranges the profiler mirrors onto the GPU) and gives, per step:

* ``gpu_busy_ms``: the sum of the kernels' durations;
* ``gpu_span_ms``: from the first kernel's start to the last one's end. Where span exceeds busy the GPU
  sat idle between kernels: waiting for the host to launch them (a host-bound step), or for a host sync;
* ``kernels_per_step``, ``by_kind_ms`` (``kernel_kind``: inductor's fused kernels, then by library, our
  Triton kernels by name) and ``kernels_ms_launches`` (name → [ms, launches], largest first).

Used by ``benchmarks/train_step.py --profile`` and by the trainer's ``train.profile_steps``.
"""

from __future__ import annotations

from typing import Iterable

import torch

# Kinds by substring of the kernel's name, first match wins: inductor's generated kernels first
# (triton_poi/per/red_*: mostly fused adds and casts; their names quote the ops they fuse), then attention and
# the optimizer, whose names can hold "cutlass" or "gemm" (flash-attention's templates, Muon's
# _ns_gemm_kernel), then by library, the project's own Triton kernels by their names (kernels/).
KINDS = (("inductor fused", ("triton_poi_", "triton_per_", "triton_red_")),
         ("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
         ("optimizer", ("adam", "_ns_fused_kernel", "_ns_gemm_kernel", "_nesterov_kernel", "_apply_kernel")),
         ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "grouped_mm", "matmul", "_grouped_wgrad_")),
         ("kda", ("kda", "chunk_")), ("nccl", ("nccl",)),
         ("attn_res", ("_attn_res_",)), ("situ", ("_situ_",)), ("cross-entropy", ("_ce_",)),
         ("rms_norm", ("_rms_norm_",)), ("short conv", ("_short_conv_",)),
         ("moe glue", ("_dispatch_", "_combine_", "_route_", "_histogram_")),
         ("grad accumulate", ("_accumulate_kernel",)), ("qk-clip max logit", ("_max_logit_",)),
         ("triton (other)", ("triton",)), ("copy/cast", ("copy", "cast", "convert")),
         ("reduce", ("reduce", "norm", "softmax")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "elementwise/other")


def kernel_summary(events: Iterable, steps: int) -> dict:
    """Per-step GPU figures of the profiled ``events`` over ``steps`` steps (module docstring)."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    if not kernels:
        return {"gpu_busy_ms": 0.0, "gpu_span_ms": 0.0, "kernels_per_step": 0, "by_kind_ms": {},
                "kernels_ms_launches": {}}
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3 / steps
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        entry = by_name.setdefault(e.name, [0.0, 0.0])
        entry[0] += ms
        entry[1] += 1 / steps
    span_us = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    return {"gpu_busy_ms": sum(by_kind.values()), "gpu_span_ms": span_us / 1e3 / steps,
            "kernels_per_step": round(len(kernels) / steps),
            "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernels_ms_launches": dict(sorted(by_name.items(), key=lambda kv: -kv[1][0]))}


def format_summary(summary: dict, top: int = 30) -> str:
    """The summary as printed lines: busy against span, the kinds, the ``top`` kernels."""
    busy, span = summary["gpu_busy_ms"], summary["gpu_span_ms"]
    lines = [f"GPU busy {busy:.1f} ms a step of a {span:.1f} ms span ({busy / max(span, 1e-9):.0%}), "
             f"{summary['kernels_per_step']} kernels a step"]
    lines += [f"  {kind:<18} {ms:8.2f} ms {ms / max(busy, 1e-9):6.1%}" for kind, ms in summary["by_kind_ms"].items()]
    lines.append("top kernels (ms and launches a step):")
    lines += [f"  {ms:8.2f} {n:6.0f}x  {name[:110]}"
              for name, (ms, n) in list(summary["kernels_ms_launches"].items())[:top]]
    return "\n".join(lines)
