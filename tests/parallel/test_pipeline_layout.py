"""Pipeline layout, schedules and AttnRes bank plan: pure functions, no processes.

The schedules are executed by a step simulator (every stage runs its next action once its inputs
are done) that must finish every F and B of every (chunk, micro-batch) exactly once on its stage,
without deadlock; its measured idle fraction must equal (P−1)/(mV+P−1) for unit-time actions
with B as long as F (interleaved: chunk passes V times shorter).
"""

from __future__ import annotations

import pytest

from k3train.parallel.pipeline.layout import build_chunks, layout_error
from k3train.parallel.pipeline.schedule import forward_actions, ideal_bubble, train_actions


def simulate(P: int, V: int, m: int, actions_of) -> int:
    """Ticks to run every stage's action list; raises on deadlock."""
    C = P * V
    queues = [list(actions_of(P, V, m, s)) for s in range(P)]
    for s, q in enumerate(queues):
        assert all(a.chunk % P == s for a in q)
    done: set = set()
    ticks = 0
    while any(queues):
        ready = []
        for q in queues:
            if not q:
                continue
            kind, c, i = q[0]
            need = [("F", c - 1, i)] if kind == "F" and c > 0 else []
            if kind == "B":
                need = [("F", c, i)] + ([("B", c + 1, i)] if c < C - 1 else [])
            if all(n in done for n in need):
                ready.append(q)
        assert ready, f"deadlock at P={P} V={V} m={m}: next {[q[0] for q in queues if q]}"
        for q in ready:
            done.add(tuple(q.pop(0)))
        ticks += 1
    return ticks, done


@pytest.mark.parametrize("P,V,m", [(2, 1, 1), (2, 1, 2), (2, 1, 5), (3, 1, 4), (4, 1, 8), (2, 2, 2), (2, 2, 6),
                                   (3, 2, 3), (4, 2, 8), (2, 3, 4), (4, 3, 4)])
def test_schedules_run_every_pass_once_without_deadlock(P, V, m):
    ticks, done = simulate(P, V, m, train_actions)
    C = P * V
    assert done == {(k, c, i) for k in "FB" for c in range(C) for i in range(m)}
    per_stage = 2 * m * V
    assert sum(len(train_actions(P, V, m, s)) for s in range(P)) == P * per_stage
    # unit-time F and B: 2(mV + P − 1) ticks, idle (P−1)/(mV+P−1) on every stage
    assert ticks == 2 * (m * V + P - 1)
    assert 1 - per_stage / ticks == pytest.approx(ideal_bubble(P, V, m))
    _, fwd_done = simulate(P, V, m, forward_actions)
    assert fwd_done == {("F", c, i) for c in range(C) for i in range(m)}


def test_layout_split_and_errors():
    chunks = build_chunks(9, 2, 2, [3, 2, 2, 2])
    assert [list(c.layers) for c in chunks] == [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
    assert [c.stage for c in chunks] == [0, 1, 0, 1] and chunks[0].first and chunks[-1].last
    assert [len(c.layers) for c in build_chunks(8, 2, 2)] == [2, 2, 2, 2]
    head_alone = build_chunks(9, 2, 1, [9, 0])
    assert list(head_alone[1].layers) == [] and head_alone[1].last
    assert "parallel.pipeline_layout=[5, 4]" in layout_error(9, 2, 1, [])
    assert "lower parallel.virtual_stages to at most 2" in layout_error(4, 2, 3, [])
    assert "has 3 entries" in layout_error(9, 2, 1, [3, 3, 3])
    assert "covers 8 layers" in layout_error(9, 2, 1, [4, 4])
    assert "empty chunk at [1]" in layout_error(9, 2, 2, [5, 0, 2, 2])
    assert "needs parallel.pipeline > 1" in layout_error(9, 1, 2, [])
    assert layout_error(9, 2, 1, [0, 9]) is None
