"""Which module a profiled step's time belongs to, forward and backward.

``module_ranges(model)`` opens a profiler range ``model::<Class>`` around the forward of ``model`` and
``module::<Class>`` around that of every submodule (forward pre/post hooks; eager models only: a
compiled layer would trace the hooks). After a ``torch.profiler`` pass, ``time_by_module(events)``
charges each op's time to a module path: the classes of the nested submodule ranges, outermost
first, or the model's class for what ran in none of them:

* a forward op, or a forward replayed in the backward (activation recompute): the ranges it ran in;
* a backward op: the ranges of the forward op that recorded its autograd node, found by the node's
  sequence number (``autograd::engine::evaluate_function: …`` carries the forward's ``sequence_nr``),
  so that the backward of a module's GEMM is charged to that module;
* anything else (gradient hooks, the optimizer): ``(outside)``, or the innermost range whose name
  starts with one of ``labels`` (e.g. ``"Optimizer.step#"``, torch's range around optimizer steps).

The time of an op is its own: the CUDA kernels it launched (``device=True``: their durations and
count, what a host-bound step does not show in wall time), or its self CPU time (``device=False``).
Paths are cut at ``depth`` classes, so one row holds, e.g., all of ``KimiDeltaAttention``'s linears.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable, Iterator

import torch
from torch import nn

PREFIX = "module::"
ROOT_PREFIX = "model::"
BACKWARD = "autograd::engine::evaluate_function"
OUTSIDE = "(outside)"


@contextlib.contextmanager
def module_ranges(model: nn.Module) -> Iterator[None]:
    """A ``module::<Class>`` profiler range around the forward of ``model`` and of each submodule."""
    open_ranges: list = []

    def enter(module, args):
        r = torch.profiler.record_function((ROOT_PREFIX if module is model else PREFIX) + type(module).__name__)
        r.__enter__()
        open_ranges.append(r)

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for module in model.modules():
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def ancestors(event) -> Iterator:
    """The profiler ranges and ops ``event`` ran inside, innermost first."""
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _modules(event) -> list[str]:
    """Module classes of the submodule ranges ``event`` ran in (itself included: a kernel launched
    directly in a module's range, e.g. by Triton, is attached to the range), outermost first; else
    the model's class if it ran in the model's range; else []."""
    chain = (event, *ancestors(event))
    path = [a.name[len(PREFIX):] for a in chain if a.name.startswith(PREFIX)][::-1]
    return path or [a.name[len(ROOT_PREFIX):] for a in chain if a.name.startswith(ROOT_PREFIX)][:1]


def attribute(events: Iterable, labels: tuple[str, ...] = ()) -> Iterator[tuple[object, list[str], str]]:
    """(op event, module path, "fwd" or "bwd") for every CPU event of a profile (rules in the module
    docstring); "fwd" is anything outside the backward."""
    events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    forward_path: dict[tuple[int, int], list[str]] = {}  # (thread, sequence_nr) -> module path
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD):
            path = _modules(e)
            if path:
                forward_path.setdefault((e.thread, e.sequence_nr), path)
    for e in events:
        chain = list(ancestors(e))
        node = next((a for a in chain if a.name.startswith(BACKWARD)), e if e.name.startswith(BACKWARD) else None)
        path = _modules(e)
        if not path and node is not None:
            path = forward_path.get((node.fwd_thread, node.sequence_nr), [])
        if not path:
            label = next((a.name for a in [e, *chain] if a.name.startswith(labels)), None) if labels else None
            path = [label or OUTSIDE]
        yield e, path, "bwd" if node is not None else "fwd"


def time_by_module(events: Iterable, device: bool, depth: int = 3,
                   labels: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """{module path: {"fwd_ms", "bwd_ms", "fwd_n", "bwd_n"}} over ``events`` (a profiler's
    ``events()``); n counts kernels (``device``) or ops with their own CPU time. Sorted by total time."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"fwd_ms": 0.0, "bwd_ms": 0.0, "fwd_n": 0, "bwd_n": 0})
    for e, path, phase in attribute(events, labels):
        if device:
            ms, n = sum(k.duration for k in e.kernels) / 1e3, len(e.kernels)
        else:  # the ranges' own time is the hooks' Python, not the module's ops
            ms, n = e.self_cpu_time_total / 1e3, int(not e.name.startswith((PREFIX, ROOT_PREFIX)))
        if n == 0:
            continue
        row = out["/".join(path[:depth])]
        row[f"{phase}_ms"] += ms
        row[f"{phase}_n"] += n
    return dict(sorted(out.items(), key=lambda kv: -(kv[1]["fwd_ms"] + kv[1]["bwd_ms"])))


def format_table(rows: dict[str, dict[str, float]], device: bool, limit: int = 30) -> str:
    """The ``limit`` largest rows of ``time_by_module`` as text: ms forward (not in the backward) and
    backward, share of the total, and kernel (``device``) or op counts."""
    total = sum(r["fwd_ms"] + r["bwd_ms"] for r in rows.values()) or 1.0
    unit = "kernels" if device else "ops"
    lines = [f"by module ({'GPU' if device else 'CPU self'} time, {total:.1f} ms in all; fwd = outside the backward):",
             f"  {'module':<52} {'fwd ms':>8} {'bwd ms':>8} {'share':>6} {'fwd ' + unit:>12} {'bwd ' + unit:>12}"]
    for path, r in list(rows.items())[:limit]:
        lines.append(f"  {path[:52]:<52} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
                     f"{(r['fwd_ms'] + r['bwd_ms']) / total:6.1%} {r['fwd_n']:12.0f} {r['bwd_n']:12.0f}")
    return "\n".join(lines)
