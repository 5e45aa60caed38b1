"""Where each expert's token copies are computed under expert parallelism: at home, or balanced
with replicas of hot experts (MoonEP, K3 report §5.2.1 and App. E; PARALLEL_NOTES.md §1).

R ranks, E experts, E_l = E/R of them homed on each rank (expert e on rank e // E_l). Every rank
routes S tokens to K experts each, so the R ranks hold R·S·K copies and T_e of them go to expert e.

``home_plan``: every copy of e is computed on home(e); rank h computes Σ_{e∈h} T_e copies.

``balanced_plan``: every rank computes exactly S·K copies. With bal[h] = Σ_{e∈h} T_e − S·K
(Σ_h bal[h] = 0), repeat while some bal[h] > 0:

    h = argmax bal, u = argmin bal          (most over- and most under-loaded rank)
    move −bal[u] copies from h's experts to u, largest remaining expert first
    bal[h] += bal[u];  bal[u] = 0

h keeps more than S·K copies whenever it is picked, so it always holds −bal[u] ≤ S·K of them.
Each receiving rank is filled once, from one home rank, so it holds replicas of at most E_l
experts (the report's bound E/R). A rank that sent more than its surplus becomes a receiver later.

A plan is ``alloc`` [E, R] int64: alloc[e, d] copies of e are computed on rank d (rows sum to
T_e). Copy i of expert e (i counts e's copies in source-rank order) goes to the first rank d with
cumsum_d alloc[e, d] > i. Plans are made on the host from the counts all ranks share, so every
rank makes the same one.
"""

from __future__ import annotations

import torch


def home_plan(tokens_per_expert: torch.Tensor, ranks: int) -> torch.Tensor:
    """tokens_per_expert [E] (summed over ranks) → alloc [E, R] with every copy at home."""
    E = tokens_per_expert.numel()
    alloc = torch.zeros(E, ranks, dtype=torch.int64)
    alloc[torch.arange(E), torch.arange(E) // (E // ranks)] = tokens_per_expert.cpu().long()
    return alloc


def balanced_plan(tokens_per_expert: torch.Tensor, ranks: int) -> torch.Tensor:
    """tokens_per_expert [E] (summed over ranks, a multiple of R in total) → alloc [E, R] with
    exactly Σ T / R copies on every rank."""
    T = tokens_per_expert.cpu().long()
    E = T.numel()
    E_l = E // ranks
    total = int(T.sum())
    if total % ranks:
        raise ValueError(f"{total} token copies do not split evenly over {ranks} ranks")
    target = total // ranks
    alloc = home_plan(T, ranks)
    bal = alloc.sum(0) - target  # [R]
    while int(bal.max()) > 0:
        h, u = int(bal.argmax()), int(bal.argmin())
        need = int(-bal[u])
        experts = range(h * E_l, (h + 1) * E_l)
        for e in sorted(experts, key=lambda e: (-int(alloc[e, h]), e)):
            if need == 0:
                break
            moved = min(need, int(alloc[e, h]))
            alloc[e, h] -= moved
            alloc[e, u] += moved
            need -= moved
        bal[h] += bal[u]
        bal[u] = 0
    return alloc


def replica_slots(alloc: torch.Tensor) -> torch.Tensor:
    """slot [E, R] int64: the replica slot of expert e on rank d (experts computed away from home,
    numbered in expert order on each rank), −1 where e has no replica on d."""
    E, R = alloc.shape
    home = torch.arange(E) // (E // R)
    away = (alloc > 0) & (home[:, None] != torch.arange(R)[None, :])
    return torch.where(away, away.long().cumsum(0) - 1, torch.full_like(alloc, -1))
