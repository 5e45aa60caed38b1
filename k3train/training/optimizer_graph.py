"""The optimizer step captured in a CUDA graph and replayed (``train.optimizer_cuda_graph``).

K3Muon's step issues about 800 kernels from Python (two fused passes per Muon parameter, 15 per
Newton–Schulz call, AdamW's groups). On one H200 that takes the host longer (~32 ms) than the GPU
needs for the work, so the GPU idles through the step (docs/muon_notes.md). Captured once, the step
is one graph launch.

What makes the step capturable, and what this class relies on:

* fixed addresses: the parameters, their main gradients (``GradBuffers``' flat buffers) and the
  optimizer state, which the eager steps before the capture create;
* no host reads inside the step: K3Muon's own finiteness check is off (the trainer's guard checks
  the global norm before the step), and one rank, so no collectives;
* the learning rate read from device scalars (``K3Muon.lr_on_device``), refreshed by
  ``sync_device_lr()`` before every step, eager or replayed, so the schedule goes on.

Usage: ``step = CapturedOptimizerStep(optimizer)``, then ``step()`` wherever ``optimizer.step()``
was called. The first ``eager_steps`` calls run eagerly (the last one on the capture stream, which
also warms cuBLAS there); the next captures the step and replays it.
"""

from __future__ import annotations

import torch


class CapturedOptimizerStep:
    def __init__(self, optimizer, eager_steps: int = 2):
        if not hasattr(optimizer, "sync_device_lr"):
            raise TypeError(f"a captured optimizer step needs K3Muon (device learning rates), got "
                            f"{type(optimizer).__name__}")
        if eager_steps < 1:
            raise ValueError(f"eager_steps must be at least 1 (the state is created there), got {eager_steps}")
        optimizer.lr_on_device = True
        optimizer.check_finite = False  # a host read: the caller checks the gradients before the step
        self.optimizer = optimizer
        self.eager_steps = eager_steps
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> None:
        self.optimizer.sync_device_lr()
        if self.graph is None and self.steps >= self.eager_steps:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        elif self.steps == self.eager_steps - 1:  # the last eager step on the capture stream
            self._on_capture_stream(self.optimizer.step)
        else:
            self.optimizer.step()
        self.steps += 1

    def _on_capture_stream(self, fn) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            fn()
        torch.cuda.current_stream().wait_stream(self._stream)

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the data loader's and the checkpoint writer's threads may touch CUDA meanwhile
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            self.optimizer.step()
        self.graph = graph
