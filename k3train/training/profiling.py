"""Where a step's time goes: per-phase wall times, and torch profiler traces of chosen steps.

``PhaseTimer`` adds up ``time.perf_counter`` intervals per phase of one step:

    data         next micro-batch, copied to the device
    fwd_bwd      forward and backward of every micro-batch
    comm         gradient averaging over DP, the gradient norm (TP), the loss all-reduce
    optimizer    optimizer and scheduler step, QB bias update, QK-clip (their own collectives included)

The phases are disjoint parts of the step, so their sum is at most the step time (the rest: zeroing
gradients, metrics). On CUDA the device is synchronized at each phase boundary only when asked
(log steps and profiled steps), so other steps get no extra host syncs; unsynchronized CUDA phase
times would measure kernel launches only, so they are not reported.

``StepProfiler`` (``train.profile_steps=[a, b]``) runs ``torch.profiler`` from step a to step b and
writes ``<out_dir>/profile/trace_rank<r>_steps<a>-<b>.json`` (Chrome trace format: chrome://tracing or
https://ui.perfetto.dev), with the phases as labelled ranges; on CUDA also the allocator's history
``memory_rank<r>_steps<a>-<b>.pickle`` (https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import torch

PHASES = ("data", "fwd_bwd", "comm", "optimizer")


class PhaseTimer:
    def __init__(self, device: torch.device, synchronize: bool, label: bool = False):
        self.sync = synchronize and device.type == "cuda"
        self.device = device
        self.label = label  # a profiler range per phase (only while profiling)
        self.times: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.profiler.record_function(phase) if self.label else contextlib.nullcontext():
            yield
        if self.sync:
            torch.cuda.synchronize(self.device)
        self.times[phase] += time.perf_counter() - start

    def record(self) -> dict:
        """``time_<phase>_s`` for every phase; empty when CUDA phases were not synchronized."""
        if self.device.type == "cuda" and not self.sync:
            return {}
        return {f"time_{p}_s": self.times.get(p, 0.0) for p in PHASES}


class StepProfiler:
    """torch.profiler over steps ``first..last`` (1-based, inclusive) of this process."""

    def __init__(self, run_dir: Path, steps: list[int], device: torch.device, rank: int):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.device, self.rank = device, rank
        self.out = run_dir / "profile"
        self._prof: Optional[torch.profiler.profile] = None

    def active(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.last:
            return
        self._prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self.first}-{self.last}"
        self._prof.export_chrome_trace(str(self.out / f"trace_{name}.json"))
        self._prof = None
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory_{name}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        """Stop a profiler left running (the run ended inside the window); writes nothing."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
