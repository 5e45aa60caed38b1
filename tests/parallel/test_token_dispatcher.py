"""``stable_sort``: the narrow-key sort gives int64 argsort's stable order for every key width, and
``counts_of_sorted`` gives bincount's counts; the expert-parallel dispatcher refuses padded rows."""

from __future__ import annotations

import pytest
import torch

from k3train.parallel.token_dispatcher import counts_of_sorted, stable_sort


@pytest.mark.parametrize("bound", [2, 128, 256, 257, 896, 2**15, 2**15 + 1])
def test_stable_sort_equals_int64_argsort_and_counts_equal_bincount(bound):
    g = torch.Generator().manual_seed(bound)
    keys = torch.randint(0, min(bound, 200), (5000,), generator=g)  # values above 200 never occur: zero counts
    keys[:50] = bound - 1  # the largest key, and many ties
    sorted_keys, order = stable_sort(keys, bound)
    assert order.dtype == torch.int64
    assert torch.equal(order, keys.argsort(stable=True))
    assert torch.equal(sorted_keys.long(), keys[order])
    counts = counts_of_sorted(sorted_keys, bound)
    assert counts.dtype == torch.int64 and torch.equal(counts, torch.bincount(keys, minlength=bound))


def test_expert_parallel_refuses_padded_rows():
    """The expert-tiled GEMMs' padded layout is local only: the EP dispatcher says so before any collective."""
    from types import SimpleNamespace

    from k3train.parallel.token_dispatcher import ExpertParallelDispatcher

    with pytest.raises(ValueError, match="parallel.expert=1"):
        ExpertParallelDispatcher.dispatch(SimpleNamespace(), torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), 64)
