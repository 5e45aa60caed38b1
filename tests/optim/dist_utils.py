"""Run a function on N local processes over gloo (CPU), as the multi-rank tests need."""

from __future__ import annotations

import os
import socket

import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: ~5 s, pay it once before forking)
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Start ``world`` gloo ranks running ``fn(rank, world, *args)``; a failure on any rank raises.

    Ranks are forked, not spawned: a spawned child re-imports torch, which costs 10+ s on
    a loaded 2-core CI machine, while a forked one starts in milliseconds.
    """
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="fork")
