"""``stable_order``: the narrow-key sort gives int64 argsort's stable order for every key width."""

from __future__ import annotations

import pytest
import torch

from k3train.parallel.token_dispatcher import stable_order


@pytest.mark.parametrize("bound", [2, 128, 256, 257, 896, 2**15, 2**15 + 1])
def test_stable_order_equals_int64_argsort(bound):
    g = torch.Generator().manual_seed(bound)
    keys = torch.randint(0, bound, (5000,), generator=g)
    keys[:50] = bound - 1  # the largest key, and many ties
    order = stable_order(keys, bound)
    assert order.dtype == torch.int64
    assert torch.equal(order, keys.argsort(stable=True))
