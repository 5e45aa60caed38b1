"""Where a step's time goes: per-phase wall times, and torch profiler traces of chosen steps.

``PhaseTimer`` times one step and its phases:

    data         next micro-batch, copied to the device
    fwd_bwd      forward and backward of every micro-batch
    comm         gradient averaging over DP, the gradient norm (TP), the loss all-reduce
    optimizer    optimizer and scheduler step, QB bias update, QK-clip (their own collectives included)

The phases are disjoint parts of the step, so their sum is at most the step time (the rest: zeroing
gradients, metrics). On CPU the clock is ``time.perf_counter``. On CUDA, on the steps asked for (log
steps and profiled steps), a CUDA event on the current stream marks each boundary and the times are
the GPU timeline between them, read once at the end of the step: no host sync between phases, and a
step starts when the GPU reaches it, not when the host queued it behind the previous step's optimizer.
Other CUDA steps are not timed (their host clock would measure kernel launches only).

``StepProfiler`` (``train.profile_steps=[a, b]``) runs ``torch.profiler`` from step a to step b and
writes ``<out_dir>/profile/trace_rank<r>_steps<a>-<b>.json`` (Chrome trace format: chrome://tracing or
https://ui.perfetto.dev), with the phases as labelled ranges; on CUDA also the allocator's history
``memory_rank<r>_steps<a>-<b>.pickle`` (https://pytorch.org/memory_viz) and the kernels' per-step summary
``kernels_rank<r>_steps<a>-<b>.json`` (``kernel_time.py``: GPU busy time against the span the steps took on
the GPU, time by kind of kernel; rank 0 prints it). Given the (eager) model, it
also charges the window's time to modules, forward and backward (``module_time.py``: GPU kernel time
on CUDA, CPU self time otherwise), per step: ``by_module_rank<r>_steps<a>-<b>.json``, and rank 0
prints the largest rows.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from k3train.training.kernel_time import format_summary, kernel_summary
from k3train.training.module_time import format_table, module_ranges, time_by_module

PHASES = ("data", "fwd_bwd", "comm", "optimizer")


class PhaseTimer:
    """``with timer(phase): ...`` around each phase, then ``timer.finish()`` -> (step seconds or None,
    ``{"time_<phase>_s": seconds}``). ``timed`` false on CUDA: nothing is recorded and finish gives
    (None, {})."""

    def __init__(self, device: torch.device, timed: bool, label: bool = False):
        self.cuda = device.type == "cuda"
        self.timed = timed or not self.cuda  # the host clock costs nothing
        self.label = label  # a profiler range per phase (only while profiling)
        self.marks: list[tuple[str, object, object]] = []  # (phase, start, end): events or perf_counter
        self.start = self._now()

    def _now(self):
        if not self.timed:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = self._now()
        with torch.profiler.record_function(phase) if self.label else contextlib.nullcontext():
            yield
        self.marks.append((phase, start, self._now()))

    def finish(self) -> tuple[float | None, dict]:
        """The step's time from construction to now, and each phase's; on CUDA one wait for the GPU."""
        end = self._now()
        if not self.timed:
            return None, {}
        if self.cuda:
            end.synchronize()
        times = dict.fromkeys(PHASES, 0.0)
        for phase, a, b in self.marks:
            times[phase] += _seconds(a, b)
        return _seconds(self.start, end), {f"time_{p}_s": t for p, t in times.items()}


def _seconds(start, end) -> float:
    """Seconds between two CUDA events (on the GPU timeline) or two perf_counter readings."""
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


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
        if self.device.type == "cuda":
            self._write_kernels(name)
        if self.model is not None:
            self._write_by_module(name)
        self._prof = None
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory_{name}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write_kernels(self, name: str) -> None:
        summary = kernel_summary(self._prof.events(), self.last - self.first + 1)
        (self.out / f"kernels_{name}.json").write_text(json.dumps(summary, indent=1))
        if self.rank == 0:
            print(f"profiled steps {self.first}-{self.last}: " + format_summary(summary, top=15), flush=True)

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
