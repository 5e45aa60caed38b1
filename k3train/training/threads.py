"""Intra-op thread count around checkpoint I/O.

Checkpoint save and load run gloo object collectives on a gloo worker thread. If that thread
runs an OpenMP region while torch uses several intra-op threads, libgomp starts a second
thread pool; with more OpenMP threads than cores libgomp shortens its spin-wait, and every
later parallel region of the training pool sleeps and wakes (k3_tiny CPU steps measured 2x
slower, 10x more context switches, issue 14). One intra-op thread during the I/O avoids it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def single_intra_op_thread() -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(1)``; restore the previous count afterwards.

    Also usable as a decorator (``@single_intra_op_thread()``).
    """
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
