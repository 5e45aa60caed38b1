"""The expert-parallel dispatcher refuses padded rows."""

from __future__ import annotations

import pytest
import torch


def test_expert_parallel_refuses_padded_rows():
    """The expert-tiled GEMMs' padded layout is local only: the EP dispatcher says so before any collective."""
    from types import SimpleNamespace

    from k3train.parallel.token_dispatcher import ExpertParallelDispatcher

    with pytest.raises(ValueError, match="parallel.expert=1"):
        ExpertParallelDispatcher.dispatch(SimpleNamespace(), torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), 64)
