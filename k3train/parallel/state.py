"""Process groups and the device: the one place that knows CPU from GPU.

``init_parallel`` starts ``torch.distributed`` (from torchrun's environment, or as a
single process), picks gloo on CPU and NCCL on GPU, and asks Megatron-Core's
``parallel_state`` for the TP/PP/CP/EP/DP groups. Everything downstream receives a
``ParallelGroups`` object explicitly; no module reaches for a global.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3train.config.schema import ParallelConfig


@dataclass
class ParallelGroups:
    """Explicit process groups of one rank. The groups are None in a single process.

    ``dp`` spans the ranks that read different micro-batches (world / (TP·CP)); ``cp`` the ranks
    that share one sequence (each holds 2 of its 2·CP chunks, ``k3train.parallel.cp_layout``).
    ``dp_cp`` is their product: the ranks that hold the same dense weights, over which gradients,
    losses and statistics are reduced. Expert parallelism splits ``dp_cp``: ``ep`` holds the ranks
    that share out the experts (a token's copies go to them by all-to-all), and ``expert_dp`` the
    ranks that hold the same experts (``dp_cp_size = ep_size · expert_dp_size``). ``pp`` holds the
    pipeline stages of one model replica (``k3train.parallel.pipeline``): they share no parameters.
    ``tp_ep_pp`` holds the ranks of one whole copy of the model: every TP shard, every expert and every
    stage, the dense weights replicated over its EP ranks (Megatron's expert-tensor-model-pipeline group).
    """

    tp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    world_size: int = 1
    rank: int = 0
    ep: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_rank: int = 0
    expert_dp: dist.ProcessGroup | None = None
    expert_dp_size: int = 1
    expert_dp_rank: int = 0
    cp: dist.ProcessGroup | None = None
    cp_size: int = 1
    cp_rank: int = 0
    dp_cp: dist.ProcessGroup | None = None
    dp_cp_size: int = 1
    dp_cp_rank: int = 0
    pp: dist.ProcessGroup | None = None
    pp_size: int = 1
    pp_rank: int = 0
    tp_ep_pp: dist.ProcessGroup | None = None
    tp_ep_pp_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str = "auto") -> torch.device:
    """``auto`` is CUDA (the local rank's GPU) when available, else CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(cfg: ParallelConfig, device: torch.device) -> ParallelGroups:
    """Initialise torch.distributed and Megatron-Core's model-parallel groups."""
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python -m k3train.train`: one process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, **kwargs)

    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor,
            pipeline_model_parallel_size=cfg.pipeline,
            context_parallel_size=cfg.context,
            expert_model_parallel_size=cfg.expert,
            expert_tensor_parallel_size=cfg.expert_tensor,
        )
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        ep=ps.get_expert_model_parallel_group(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        expert_dp=ps.get_expert_data_parallel_group(),
        expert_dp_size=ps.get_expert_data_parallel_world_size(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
        cp=ps.get_context_parallel_group(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        pp=ps.get_pipeline_model_parallel_group(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        tp_ep_pp=ps.get_expert_tensor_model_pipeline_parallel_group(),
        tp_ep_pp_size=dist.get_world_size(ps.get_expert_tensor_model_pipeline_parallel_group()),
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
