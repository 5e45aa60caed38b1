"""The order in which one pipeline stage runs its forward and backward passes.

An action is F or B of one chunk (virtual stage) c on one micro-batch i. F(c, i) needs F(c−1, i);
B(c, i) needs B(c+1, i) (and its own F). Stage p runs chunks p, p+P, …, p+(V−1)P.

1F1B (V = 1): stage p runs P−1−p warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards; at most P−p micro-batches are in flight.

Interleaved 1F1B (V > 1, m a multiple of P): the k-th forward of a stage is micro-batch
(k // PV)·P + k mod P of its virtual stage (k mod PV) // P, so each group of P micro-batches passes
through all V chunks of the stage before the next group starts; backwards go the same way with
the virtual stages reversed. Warm-up: 2(P−1−p) + (V−1)P forwards (Megatron-LM's count), then
1F1B, then the drain. The idle fraction of a stage is (P−1)/(m·V + P−1) against (P−1)/(m + P−1).

Forward-only (evaluation): each micro-batch through the stage's chunks in order.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" or "B"
    chunk: int
    micro: int


def _nth(k: int, P: int, V: int, stage: int, backward: bool) -> Action:
    group, within = divmod(k, P * V)
    v = within // P
    if backward:
        v = V - 1 - v
    return Action("B" if backward else "F", v * P + stage, group * P + within % P)


def train_actions(P: int, V: int, m: int, stage: int) -> list[Action]:
    """The stage's F and B actions for m micro-batches (1F1B, interleaved when V > 1)."""
    if V > 1 and m % P:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of the stages ({P})")
    total = m * V
    warmup = P - 1 - stage if V == 1 else 2 * (P - 1 - stage) + (V - 1) * P
    warmup = min(warmup, total)
    actions = [_nth(k, P, V, stage, False) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [_nth(warmup + k, P, V, stage, False), _nth(k, P, V, stage, True)]
    actions += [_nth(k, P, V, stage, True) for k in range(total - warmup, total)]
    return actions


def forward_actions(P: int, V: int, m: int, stage: int) -> list[Action]:
    """Forward only: micro-batch by micro-batch through the stage's chunks."""
    return [Action("F", v * P + stage, i) for i in range(m) for v in range(V)]


def ideal_bubble(P: int, V: int, m: int) -> float:
    """Idle fraction of a stage when every chunk pass takes the same time: (P−1)/(m·V + P−1)."""
    return (P - 1) / (m * V + P - 1)
