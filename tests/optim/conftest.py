import os
import sys

import pytest
import torch

# Let the test modules import the stand-ins and helpers beside them, also in forked ranks.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """These tests use tiny tensors: with 2 OpenMP threads on a busy 2-core CI machine each
    small op can spin for tens of ms (k3_tiny steps measured 10x slower), so use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
