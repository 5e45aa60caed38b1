"""Megatron-Core ``dist_checkpointing`` save strategy that also runs on CPU-only hosts.

Megatron-Core 0.16's ``torch_dist`` writer assumes CUDA in two places: it stages tensors
with a non-blocking copy followed by ``torch.cuda.synchronize()``, and its finalize step
broadcasts a failure flag held in a CUDA tensor. On a host without CUDA this strategy
stages with a blocking copy (the tensors are already in host memory) and broadcasts the
flag from a CPU tensor over gloo. Everything else, including the on-disk ``torch_dist``
format, is Megatron-Core's, so checkpoints move freely between CPU and GPU runs. On CUDA
hosts the parent strategy runs unchanged.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.state_dict_saver import _get_failure_dict
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint import CheckpointException


def _finalize_on_host(storage_writer, global_metadata, dist_wrapper) -> None:
    """Gather write results, write the metadata on the coordinator, and raise everywhere on failure."""
    results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
    failures = {}
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(results)
        if not failures:
            storage_writer.finish(global_metadata, results)
    flag = torch.tensor([int(bool(failures))], dtype=torch.int)
    dist.broadcast(flag, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
    if flag.item():
        raise CheckpointException("write", failures)


class HostSafeTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    def __init__(self):
        super().__init__("torch_dist", 1)

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
        if torch.cuda.is_available():
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        if preload_fn is not None:  # partial(preload_tensors, write_buckets, non_blocking=True)
            preload_fn = partial(preload_fn.func, preload_fn.args[0], False)
        return AsyncRequest(save_fn, save_args, [partial(_finalize_on_host, *save_state_dict_ret)],
                            preload_fn=preload_fn)


def save_strategy() -> HostSafeTorchDistSaveStrategy:
    return HostSafeTorchDistSaveStrategy()
