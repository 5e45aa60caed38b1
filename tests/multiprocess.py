"""Run a function on N local processes over gloo (CPU): the multi-rank tests use this."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from warm_trainer import preload_forkserver


def _entry(rank: int, world: int, store: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # Rendezvous through a file, not a port picked beforehand: a free port can be taken by another test's
    # socket between the pick and the bind (EADDRINUSE, seen in CI).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Start ``world`` gloo ranks running ``fn(rank, world, *args)``; a failure on any rank raises. The ranks
    are forked from the warm server of ``warm_trainer`` (torch and Megatron-Core already imported), not
    spawned: a spawned rank spends seconds importing them again."""
    preload_forkserver()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True,
                           start_method="forkserver")
