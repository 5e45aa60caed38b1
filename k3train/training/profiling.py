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
``memory_rank<r>_steps<a>-<b>.pickle`` (https://pytorch.org/memory_viz). Given the (eager) model, it
also charges the window's time to modules, forward and backward (``module_time.py``: GPU kernel time
on CUDA, CPU self time otherwise), per step: ``by_module_rank<r>_steps<a>-<b>.json``, and rank 0
prints the largest rows.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from k3train.training.module_time import format_table, module_ranges, time_by_module

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

    def __init__(self, run_dir: Path, steps: list[int], device: torch.device, rank: int,
                 model: nn.Module | None = None):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.device, self.rank, self.model = device, rank, model
        self.out = run_dir / "profile"
        self._prof: Optional[torch.profiler.profile] = None
        self._ranges = contextlib.ExitStack()

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
        if self.model is not None:
            self._ranges.enter_context(module_ranges(self.model))

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.last:
            return
        self._ranges.close()
        self._prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self.first}-{self.last}"
        self._prof.export_chrome_trace(str(self.out / f"trace_{name}.json"))
        if self.model is not None:
            self._write_by_module(name)
        self._prof = None
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory_{name}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write_by_module(self, name: str) -> None:
        device = self.device.type == "cuda"
        steps = self.last - self.first + 1
        rows = {path: {k: v / steps for k, v in row.items()}
                for path, row in time_by_module(self._prof.events(), device, labels=PHASES + ("Optimizer.step#",)).items()}
        (self.out / f"by_module_{name}.json").write_text(json.dumps(rows, indent=1))
        if self.rank == 0:
            print(f"profiled steps {self.first}-{self.last}, per step, " + format_table(rows, device, limit=15),
                  flush=True)

    def close(self) -> None:
        """Stop a profiler left running (the run ended inside the window); writes nothing."""
        self._ranges.close()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
