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
  ``sync_device_lr()`` before every step, eager or replayed, so the schedule goes on;
* a cuBLAS workspace of its own. cuBLAS keeps one workspace per handle and stream, allocated at the first
  GEMM on that stream; a graph captured with it replays into that memory. Inductor's CUDA graph trees
  (``train.compile_mode=reduce-overhead``) free every workspace before and after each recording
  (``torch._C._cuda_clearCublasWorkspaces``), so a workspace made outside the capture became free memory
  at the layers' first new recording, and the replay then wrote into whatever took it, or faulted once it
  was released (the bench-1B trainer, session 14: ``unspecified launch failure`` in the replay at step 17,
  under ``CUDA_LAUNCH_BLOCKING=1``). The capture therefore starts and ends by clearing the workspaces, as
  the graph trees do: cuBLAS allocates a fresh one inside the capture, in the graph's private pool, which
  the graph keeps for its lifetime.

Usage: ``step = CapturedOptimizerStep(optimizer)``, then ``step()`` wherever ``optimizer.step()``
was called; ``captures_optimizer_step`` resolves ``train.optimizer_cuda_graph``. The first
``eager_steps`` calls run eagerly (the last one on the capture stream, so that lazy initialisation on
that stream happens outside the capture); the next captures the step and replays it.
"""

from __future__ import annotations

import torch


def captures_optimizer_step(setting: bool | None, device_type: str, optim_name: str, world_size: int) -> bool:
    """``train.optimizer_cuda_graph`` resolved: ``setting`` when given (true was validated at start-up), else
    on wherever the captured step applies: K3Muon (``optim=muon``) on one CUDA rank."""
    if setting is not None:
        return setting
    return device_type == "cuda" and optim_name == "muon" and world_size == 1


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
        torch._C._cuda_clearCublasWorkspaces()  # the capture's GEMMs get a workspace in the graph's pool
        # thread_local: the data loader's and the checkpoint writer's threads may touch CUDA meanwhile
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            self.optimizer.step()
        torch._C._cuda_clearCublasWorkspaces()  # and no later eager GEMM on this stream reuses it
        self.graph = graph
