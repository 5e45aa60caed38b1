"""Our Megatron-Core ``torch_dist`` checkpoints, one tensor at a time, without process groups.

``k3train.training.checkpoint`` stores every model tensor as ``model.<name>`` with its *global*
shape, so a tensor reads the same whatever TP/DP layout wrote it: ``DistCheckpoint.read`` loads
one through ``torch.distributed.checkpoint`` (``no_dist``) and returns it in the model's shape.

Row-interleaved tensors (``ParamRole.row_interleave`` s > 1: the experts' ``w13``, rows gate_0,
up_0, gate_1, ...) are stored as the parameter holds them, and ``common.pt`` says so
(``ROW_LAYOUT_KEY``). Checkpoints written before held them blocked, as [.., s, rows/s, cols]
(all gate rows, then all up rows); those are interleaved on read (``interleave_rows``).

``write_model_checkpoint`` writes a weights-only checkpoint in the same format: the tensors are
produced lazily, one at a time, while the writer streams them to disk (bounded memory), and
``common.pt`` records ``step`` 0, the model config and ``weights_only``. Training loads it
with ``train.init_from`` at any parallel layout (resharding on load).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from k3train.config.schema import ModelConfig
from k3train.model.roles import interleave_rows

COMMON = "common.pt"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                     "common_backend_version": 1}
KEY_PREFIX = "model."
# common-state entry: row-interleaved tensors are stored interleaved (absent: blocked, [.., s, rows/s, cols])
ROW_LAYOUT_KEY, ROW_LAYOUT = "row_interleave_layout", "interleaved"


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


def has_blocked_rows(common: dict) -> bool:
    """Whether a checkpoint's common state predates ``ROW_LAYOUT_KEY`` (row-interleaved tensors stored blocked)."""
    return common.get(ROW_LAYOUT_KEY) != ROW_LAYOUT


def blocked_rows_note(path: Path, names: list[str]) -> str:
    """The line that says an older checkpoint's blocked tensors are being interleaved."""
    return (f"k3train: {path} predates interleaved expert rows (no '{ROW_LAYOUT_KEY}' in its common state): "
            f"converting {len(names)} blocked tensor(s) ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''}; "
            f"all gate rows, then all up rows) to interleaved (gate_j, up_j) rows on load")


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
        self.blocked_rows = has_blocked_rows(self.common)
        self._noted = False

    def read_many(self, items: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Tensors ``name`` (state-dict names) as [shape] in their stored dtype, in one read; in a checkpoint
        with blocked rows, one stored with an extra axis [.., s, n, cols] for [.., s·n, cols] is interleaved."""
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
        blocked = [name for name, shape in items if self.blocked_rows and len(self.stored[name][0]) == len(shape) + 1]
        if blocked and not self._noted:
            print(blocked_rows_note(self.path, blocked), file=sys.stderr, flush=True)
            self._noted = True
        return {name: interleave_rows(out[KEY_PREFIX + name]) if name in blocked else out[KEY_PREFIX + name].view(shape)
                for name, shape in items}

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
              ROW_LAYOUT_KEY: ROW_LAYOUT, **(extra_common or {})}
    torch.save(common, out / COMMON)
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
