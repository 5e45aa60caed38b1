"""Streaming safetensors shards: write tensor by tensor from a known plan, read with checks.

A safetensors file is ``u64 header length N | N bytes of JSON header | raw tensor bytes``; the
header maps each name to ``{dtype, shape, data_offsets}``. Because every shape and dtype is
known before any data exists (the conversion plan), ``ShardWriter`` writes the header first and
then the tensors one at a time, so memory stays at one tensor. The header keys keep plan order
and the JSON is compact, so the same tensors always give the same bytes.

Sharded checkpoints add ``model.safetensors.index.json`` (``weight_map``: name → shard file).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import torch

from k3train.convert.hf_layout import TensorSpec

INDEX = "model.safetensors.index.json"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
           torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.float64: "F64", torch.bool: "BOOL",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
T = TypeVar("T")


class SafetensorsError(ValueError):
    """A shard or the index is missing, truncated or inconsistent."""


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def chunk_by_bytes(items: list[T], size_of: Callable[[T], int], max_bytes: int) -> list[list[T]]:
    """Consecutive runs of ``items`` of at most ``max_bytes`` each (a larger item gets its own run)."""
    chunks: list[list[T]] = [[]]
    size = 0
    for item in items:
        n = size_of(item)
        if chunks[-1] and size + n > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += n
    return [c for c in chunks if c]


def plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` (in order) into shards of at most ``max_bytes``."""
    return chunk_by_bytes(specs, lambda s: s.nbytes, max_bytes)


def _header(specs: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": _DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class ShardWriter:
    """Writes one shard: ``write(spec, tensor)`` must follow ``specs`` order exactly."""

    path: Path
    specs: list[TensorSpec]
    _next: int = 0
    _file: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._file = open(self.path, "wb")
        self._file.write(_header(self.specs))

    def write(self, spec: TensorSpec, t: torch.Tensor) -> None:
        want = self.specs[self._next]
        if spec != want or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise SafetensorsError(f"{self.path}: got {spec.name} {t.dtype} {list(t.shape)}, expected "
                                   f"{want.name} {want.dtype} {list(want.shape)} (plan order)")
        self._file.write(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.specs):
            raise SafetensorsError(f"{self.path}: {len(self.specs) - self._next} planned tensors were not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def write_index(folder: Path, shards: list[list[TensorSpec]], metadata: dict | None = None) -> None:
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    weight_map = {s.name: names[i] for i, shard in enumerate(shards) for s in shard}
    total = sum(s.nbytes for shard in shards for s in shard)
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def read_header(path: Path) -> dict[str, TensorSpec]:
    """Name → spec of one safetensors file; checks the file is complete."""
    if not path.is_file():
        raise SafetensorsError(f"shard {path} is missing; download it again or fix {INDEX}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path} is truncated ({size} bytes): not a safetensors file; download it again")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise SafetensorsError(f"{path} is truncated (header of {n} bytes, file {size}); download it again")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise SafetensorsError(f"{path} has a corrupt header; download it again") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end != size:
        raise SafetensorsError(f"{path} is truncated or padded: the header needs {8 + n + end} bytes, the file has "
                               f"{size}; download it again")
    out = {}
    for name, v in header.items():
        if v["dtype"] not in _FROM_NAME:
            raise SafetensorsError(f"{path}: tensor {name} has dtype {v['dtype']}, which k3train does not read")
        out[name] = TensorSpec(name, tuple(v["shape"]), _FROM_NAME[v["dtype"]])
    return out


class HFFolder:
    """Read-only view of an HF checkpoint folder: one ``model.safetensors`` or shards with an index."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError):
                raise SafetensorsError(f"{index} is not a valid index (no weight_map); regenerate it") from None
        elif (folder / "model.safetensors").is_file():
            weight_map = None
        else:
            raise SafetensorsError(f"{folder} has neither {INDEX} nor model.safetensors; point at an HF "
                                   f"checkpoint folder")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.specs: dict[str, TensorSpec] = {}
        self.file_of: dict[str, Path] = {}
        for fname in files:
            for name, spec in read_header(folder / fname).items():
                self.specs[name] = spec
                self.file_of[name] = folder / fname
        if weight_map:
            for name, fname in weight_map.items():
                if self.file_of.get(name) != folder / fname:
                    raise SafetensorsError(f"{index} puts {name} in {fname}, but that shard does not hold it; "
                                           f"regenerate the index or re-download the shard")
        self._open: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.file_of:
            raise SafetensorsError(f"{self.folder}: tensor {name} is missing from every shard (K3_SPEC §4); the "
                                   f"checkpoint is incomplete or config.json describes another model")
        path = self.file_of[name]
        if path not in self._open:
            self._open.clear()  # one open shard at a time
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name)
