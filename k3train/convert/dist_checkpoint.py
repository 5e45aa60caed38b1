"""Our Megatron-Core ``torch_dist`` checkpoints, one tensor at a time, without process groups.

``k3train.training.checkpoint`` stores every model tensor as ``model.<name>`` with its *global*
shape, so a tensor reads the same whatever TP/DP layout wrote it: ``DistCheckpoint.read`` loads
one through ``torch.distributed.checkpoint`` (``no_dist``) and returns it in the model's shape.

``write_model_checkpoint`` writes a weights-only checkpoint in the same format: the tensors are
produced lazily, one at a time, while the writer streams them to disk (bounded memory), and
``common.pt`` records ``step`` 0, the model config and ``weights_only``. Training loads it
with ``train.init_from`` at any parallel layout (resharding on load).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from k3train.config.schema import ModelConfig

COMMON = "common.pt"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                     "common_backend_version": 1}
KEY_PREFIX = "model."


class DistCheckpointError(ValueError):
    """Not one of our checkpoints, or a tensor that does not fit the model."""


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory / ``checkpoints`` folder whose ``latest`` names one."""
    for candidate in (path, path / "checkpoints"):
        pointer = candidate / "latest"
        if pointer.is_file():
            return candidate / pointer.read_text().strip()
    return path


def is_dist_checkpoint(path: Path) -> bool:
    return (path / "metadata.json").is_file() and (path / ".metadata").is_file()


def load_model_config(saved: dict) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in known})


class DistCheckpoint:
    """Read-only view of one of our checkpoints: ``config``, ``shapes`` (stored), ``read(name)``."""

    def __init__(self, path: Path):
        path = resolve_checkpoint(path)
        if not is_dist_checkpoint(path):
            raise DistCheckpointError(f"{path} is not a k3train checkpoint (no metadata.json/.metadata); pass a "
                                      f"step_XXXXXXXX folder or a run directory with checkpoints/latest")
        self.path = path
        self.common = torch.load(path / COMMON, map_location="cpu", weights_only=False)
        self.config = load_model_config(self.common["model_config"])
        self._reader = FileSystemReader(str(path))
        md = self._reader.read_metadata().state_dict_metadata
        self.stored = {k[len(KEY_PREFIX):]: (tuple(v.size), v.properties.dtype)
                       for k, v in md.items() if k.startswith(KEY_PREFIX) and hasattr(v, "size")}

    def read_many(self, items: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Tensors ``name`` (state-dict names) as [shape] in their stored dtype, in one read."""
        out = {}
        for name, shape in items:
            if name not in self.stored:
                raise DistCheckpointError(f"{self.path}: no tensor model.{name}; the checkpoint does not match its "
                                          f"own model_config (written by another k3train version?)")
            stored_shape, dtype = self.stored[name]
            if torch.Size(stored_shape).numel() != torch.Size(shape).numel():
                raise DistCheckpointError(f"{self.path}: model.{name} is stored as {list(stored_shape)}, which does "
                                          f"not fit the model's {list(shape)}")
            out[KEY_PREFIX + name] = torch.empty(stored_shape, dtype=dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=self._reader, no_dist=True)
        return {name: out[KEY_PREFIX + name].view(shape) for name, shape in items}

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.read_many([(name, shape)])[name]


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; ``resolve_data`` asks the producer for the real tensor only when
    the writer reaches it (one tensor in memory at a time)."""

    def __init__(self, producers: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self.producers = producers

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if fqn in self.producers:
            meta = self.state_dict[fqn]
            t = self.producers[fqn]()
            if tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype:
                raise DistCheckpointError(f"{fqn}: produced {t.dtype} {list(t.shape)}, planned {meta.dtype} "
                                          f"{list(meta.shape)}")
            return t.contiguous()
        return super().resolve_data(write_item)


def write_model_checkpoint(out: Path, cfg: ModelConfig, tensors: dict[str, tuple[tuple[int, ...], torch.dtype,
                                                                                   Callable[[], torch.Tensor]]],
                           extra_common: dict | None = None) -> None:
    """Weights-only checkpoint into the empty folder ``out``; ``tensors``: name → (the model's shape, dtype,
    producer of the tensor in that shape and the model's layout)."""
    meta = {KEY_PREFIX + n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype, _) in tensors.items()}
    producers = {KEY_PREFIX + n: f for n, (_, _, f) in tensors.items()}
    with warnings.catch_warnings():  # no process group: intended
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.save(meta, storage_writer=FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1),
                     planner=_LazySavePlanner(producers), no_dist=True)
        except CheckpointException as err:  # a producer's error (bad input) surfaces as itself
            original = next(iter(err.failures.values()))[0]
            raise original from None
    common = {"step": 0, "world_size": 1, "weights_only": True, "model_config": dataclasses.asdict(cfg),
              **(extra_common or {})}
    torch.save(common, out / COMMON)
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
