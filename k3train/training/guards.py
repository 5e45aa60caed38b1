"""Step guards: decide which optimizer steps to skip, and when a run cannot go on.

A step is skipped (no optimizer update) when its loss or gradient norm is not finite, or when its
loss spikes above ``train.loss_spike_factor`` x the median loss of the last ``train.loss_spike_window``
healthy steps (with ``train.loss_spike_action=skip``; ``stop`` ends the run instead). More than
``train.max_consecutive_skips`` skipped steps in a row end the run with ``TrainingStopped``.
While a streak of skipped steps lasts the guard is not ``healthy``, and the trainer writes no
checkpoint, so ``latest`` never names a model from after the run went bad.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

NON_FINITE_LOSS = "non-finite loss"
NON_FINITE_GRADS = "non-finite gradients"
LOSS_SPIKE = "loss spike"

ADVICE = "lower optim.lr, raise optim.warmup_fraction or inspect the data"


class TrainingStopped(RuntimeError):
    """The run cannot go on (the message is one line naming the setting and the way out)."""


class StepGuard:
    def __init__(self, max_consecutive_skips: int, spike_factor: float, spike_window: int, spike_action: str):
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_factor = spike_factor
        self.spike_action = spike_action
        self.history: deque[float] = deque(maxlen=spike_window)  # losses of recent healthy steps
        self.consecutive = 0
        self.streak_start: Optional[int] = None
        self.streak_reasons: set[str] = set()

    @classmethod
    def from_config(cls, t) -> "StepGuard":
        return cls(t.max_consecutive_skips, t.loss_spike_factor, t.loss_spike_window, t.loss_spike_action)

    @property
    def healthy(self) -> bool:
        """No skipped step since the last healthy one: safe to checkpoint."""
        return self.consecutive == 0

    def check(self, loss: float, grad_norm: float) -> Optional[str]:
        """Why this step must be skipped, or None. Same inputs on every rank give the same answer."""
        if not math.isfinite(loss):
            return NON_FINITE_LOSS
        if not math.isfinite(grad_norm):
            return NON_FINITE_GRADS
        if self.spike_factor and len(self.history) == self.history.maxlen:
            if loss > self.spike_factor * statistics.median(self.history):
                return LOSS_SPIKE
        return None

    def update(self, step: int, reason: Optional[str], loss: Optional[float] = None) -> None:
        """Record step ``step``'s outcome; raise ``TrainingStopped`` when the run cannot go on."""
        if reason is None:
            self.consecutive, self.streak_start, self.streak_reasons = 0, None, set()
            if loss is not None:
                self.history.append(float(loss))
            return
        if self.consecutive == 0:
            self.streak_start = step
        self.consecutive += 1
        self.streak_reasons.add(reason)
        if reason == LOSS_SPIKE and self.spike_action == "stop":
            median = statistics.median(self.history)
            raise TrainingStopped(f"loss spike at step {step}: {loss} > train.loss_spike_factor={self.spike_factor} "
                                  f"x {median:.4g} (median of the last {len(self.history)} steps) and "
                                  f"train.loss_spike_action=stop; {ADVICE}, or resume from the latest checkpoint")
        if self.consecutive > self.max_consecutive_skips:
            raise TrainingStopped(self.streak_message(step, f"more than train.max_consecutive_skips="
                                                            f"{self.max_consecutive_skips}"))

    def streak_message(self, step: int, why: str) -> str:
        reasons = ", ".join(sorted(self.streak_reasons))
        return (f"{self.consecutive} steps in a row were skipped (steps {self.streak_start}-{step}: {reasons}), "
                f"{why}; no checkpoint was written after step {self.streak_start - 1}; {ADVICE}, then resume "
                f"from the latest checkpoint")

    def state_dict(self) -> dict:
        return {"history": list(self.history), "consecutive": self.consecutive, "streak_start": self.streak_start}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in state.get("history", []))
        self.consecutive = int(state.get("consecutive", 0))
        self.streak_start = state.get("streak_start")
