"""The one-rank reference run the multi-rank training tests compare against (k3_tiny, 6 steps,
checkpoints at 3 and 6), trained once per test process."""

from __future__ import annotations

import pytest

from parallel_runs import STEPS
from test_training_helpers import train


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train(out, *STEPS)
    return out
