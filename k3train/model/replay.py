"""Forward replays of activation recompute (``k3train.training.recompute``).

A recomputed region runs its forward a second time, during backward, to rebuild the activations it
did not save. Forward side effects that describe the micro-batch must happen once per micro-batch,
so the modules that have them skip them while ``replaying()`` is true:

- ``LatentMoE``: expert-load counts (``ExpertLoad``), Quantile Balancing observations
  (``QuantileBalancer.observe``) and the router inputs kept for re-scoring;
- ``GatedMLA``: the running max logit of QK-clip (a max, so a replay would not change it; skipped
  to save the work).

What the replay computes is the original forward's: the inputs, the weights and the router bias
are the same (nothing updates them between a micro-batch's forward and its backward: the bias
moves after the backward, ``LatentMoE.update_bias``), so it routes every token to the same experts.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

_depth = 0  # replays in progress; global, not thread-local: CUDA backward runs on autograd's own thread


def replaying() -> bool:
    """True inside a recomputed forward."""
    return _depth > 0


@contextlib.contextmanager
def replay() -> Iterator[None]:
    """Mark the forward run inside as a replay of one that already ran."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
