"""The MoonEP-style planner (k3train/parallel/expert_balance.py) on random and adversarial loads."""

from __future__ import annotations

import pytest
import torch

from k3train.parallel.expert_balance import balanced_plan, home_plan, replica_slots


def random_counts(g, R, E, S, K, skew):
    """[R, E] token copies per source rank and expert: S tokens a rank, K distinct experts a token."""
    counts = torch.zeros(R, E, dtype=torch.long)
    for r in range(R):
        p = torch.rand(E, generator=g) ** skew + 1e-9
        for _ in range(S):
            counts[r, torch.multinomial(p, K, replacement=False, generator=g)] += 1
    return counts


@pytest.mark.parametrize("R,E_l", [(2, 1), (2, 4), (4, 2), (8, 16)])
def test_every_rank_computes_S_times_K_with_at_most_E_over_R_replicas(R, E_l):
    g = torch.Generator().manual_seed(R * 100 + E_l)
    E = R * E_l
    for trial in range(60):
        S, K = int(torch.randint(1, 24, (1,), generator=g)), min(E - 1, 1 + trial % 4) or 1
        T = random_counts(g, R, E, S, K, skew=[1.0, 8.0, 30.0][trial % 3]).sum(0)
        alloc = balanced_plan(T, R)
        assert (alloc >= 0).all() and torch.equal(alloc.sum(1), T)
        assert (alloc.sum(0) == S * K).all()
        slots = replica_slots(alloc)
        assert int(slots.max()) < E_l  # the report's bound: E/R replica slots per rank suffice
        assert torch.equal(home_plan(T, R).sum(1), T)


def test_all_copies_on_one_expert_spread_over_every_rank():
    """The planner's worst case: every copy of every rank goes to expert 0."""
    R, E = 4, 8
    T = torch.zeros(E, dtype=torch.long)
    T[0] = 40
    alloc = balanced_plan(T, R)
    assert alloc[0].tolist() == [10, 10, 10, 10]
    assert replica_slots(alloc)[0].tolist() == [-1, 0, 0, 0]


def test_a_balanced_load_stays_at_home():
    T = torch.full((8,), 5, dtype=torch.long)
    assert torch.equal(balanced_plan(T, 4), home_plan(T, 4))
    assert int(replica_slots(balanced_plan(T, 4)).max()) == -1


def test_uneven_totals_are_refused():
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_plan(torch.tensor([3, 0, 0, 0]), 2)
