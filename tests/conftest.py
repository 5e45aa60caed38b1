import glob
import os
import sys
import warnings

# Tests import helpers that sit beside them (tests/multiprocess.py), also in spawned ranks.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)
os.environ.setdefault("PYTHONPATH", "")
if _here not in os.environ["PYTHONPATH"].split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_here, os.environ["PYTHONPATH"]) if p)
# No GPU: Triton kernels run under the interpreter (must be set before triton is imported).
if not glob.glob("/dev/nvidia[0-9]*") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tests use tiny tensors and run two pytest workers on a 2-core CI machine: with 2 OpenMP
    threads each small op can spin for tens of ms (k3_tiny steps measured 10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
