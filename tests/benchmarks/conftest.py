"""Fixtures for benchmark smoke tests that run a benchmark's main() in the test process."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def one_rank(monkeypatch):
    """A single-process torch.distributed environment on a free port, restored afterwards (so that
    training subprocesses started later by other tests in this worker do not inherit it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                            LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
