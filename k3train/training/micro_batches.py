"""The micro-batch loop of one step when the model is not pipelined: the trainer's schedule for
parallel.pipeline = 1 (``k3train.parallel.pipeline.runtime.PipelineSchedule`` is the other one).

    for i, batch in enumerate(batches): loss_i = forward(batch); (loss_i / m).backward()
    after every m/U micro-batches but the last: after_window(windows left)   (U windows a step)

``before_last_backward`` runs just before the last backward (the gradient buffers start their
data-parallel all-reduces during it: ``GradBuffers.last_backward``).
"""

from __future__ import annotations

from typing import Callable

import torch


def windows_left_after(micro: int, n: int, windows: int) -> int | None:
    """After micro-batch ``micro`` (1-based) of a step's ``n`` in ``windows`` equal windows: the windows still to
    route when one ends there (not after the step's last micro-batch), else None."""
    window = n // windows
    return windows - micro // window if micro % window == 0 and micro < n else None


class MicroBatchLoop:
    def __init__(self, forward: Callable[[dict], torch.Tensor], device: torch.device,
                 windows: int = 1, after_window: Callable[[int], None] = lambda windows_left: None,
                 before_last_backward: Callable[[], None] = lambda: None):
        self.forward, self.device, self.windows, self.after_window = forward, device, windows, after_window
        self.before_last_backward = before_last_backward

    def train(self, batches: list[dict]) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns Σ_i loss_i."""
        n = len(batches)
        loss_sum = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches, 1):
            loss = self.forward(batch)
            if micro == n:
                self.before_last_backward()
            (loss / n).backward()
            loss_sum += loss.detach()
            left = windows_left_after(micro, n, self.windows)
            if left:
                self.after_window(left)
        return loss_sum

    @torch.no_grad()
    def evaluate(self, batches: list[dict]) -> torch.Tensor:
        return torch.stack([self.forward(b).float() for b in batches]).mean()
