"""Streaming conversion between our checkpoints and the HF Kimi K3 layout.

``export_hf``: our checkpoint → safetensors shards + ``model.safetensors.index.json`` +
``config.json``. Tensors are read one at a time, mapped by ``hf_layout`` and written in plan
order; peak memory is one of our tensors (the largest is one layer's stacked experts).
``import_hf``: the reverse, into a weights-only checkpoint (``train.init_from`` loads it at any
parallel layout). Both write into ``<out>.tmp-<pid>`` and rename it to ``out`` only when complete.
Tensors we do not own (``vision_tower.*``, ``mm_projector.*``) are kept in
``hf_passthrough.safetensors`` on import and written back unchanged on export. The tokenizer files
(``tokenizer.json``, ``tiktoken.model``, ``tokenizer_config.json``) travel both ways when present.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from k3train.config.schema import ModelConfig
from k3train.convert.dist_checkpoint import DistCheckpoint, write_model_checkpoint
from k3train.convert.hf_config import (HFConfigError, experts_format, hf_config, model_config_from_hf,
                                       read_hf_config)
from k3train.convert.hf_layout import (LayoutError, Mapping, TensorSpec, build_mappings, check_spec, from_hf,
                                       is_passthrough, our_tensor_shapes, to_hf)
from k3train.convert.safetensors_io import (HFFolder, ShardWriter, chunk_by_bytes, plan_shards, read_header,
                                            shard_name, write_index)
from k3train.data.tokenizer import HF_TOKENIZER_FILES, HF_TOKENIZER_SIDECARS

PASSTHROUGH_FILE = "hf_passthrough.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30
DEFAULT_READ_BYTES = 2**30  # our tensors read per checkpoint access (a larger one is read alone)


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; rename it to ``out`` on success, remove it on failure."""
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new --out folder or delete it first")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_tokenizer_files(sources: list[Path], dst: Path) -> None:
    """Copy the tokenizer files (``HF_TOKENIZER_FILES`` and their sidecars) of the first folder in
    ``sources`` that has any into ``dst``."""
    names = HF_TOKENIZER_FILES + HF_TOKENIZER_SIDECARS
    for src in sources:
        found = [src / n for n in names if (src / n).is_file()]
        if found:
            for f in found:
                shutil.copyfile(f, dst / f.name)
            return


def hf_plan(cfg: ModelConfig, experts: str, dtype: torch.dtype = torch.bfloat16) -> list[Mapping]:
    return build_mappings(our_tensor_shapes(cfg), cfg, experts, dtype)


def _progress(total: int, desc: str, show: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not show, mininterval=1.0)


def export_hf(checkpoint: Path, out: Path, experts: str = "bf16", dtype: torch.dtype = torch.bfloat16,
              shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True) -> list[TensorSpec]:
    """Our checkpoint → HF folder ``out``; returns the written tensor specs in file order."""
    ckpt = DistCheckpoint(checkpoint)
    cfg = ckpt.config
    mappings = hf_plan(cfg, experts, dtype)
    passthrough = ckpt.path / PASSTHROUGH_FILE
    extra = list(read_header(passthrough).values()) if passthrough.is_file() else []
    specs = [s for m in mappings for s in m.hf] + extra
    shards = plan_shards(specs, shard_bytes)
    with atomic_dir(out) as tmp, _progress(sum(s.nbytes for s in specs), "to-hf", progress) as bar:
        stream = _hf_tensors(ckpt, mappings, passthrough if extra else None)
        for i, shard in enumerate(shards):
            writer = ShardWriter(tmp / shard_name(i, len(shards)), shard)
            for _ in shard:
                spec, t = next(stream)
                writer.write(spec, t)
                bar.update(spec.nbytes)
            writer.close()
        write_index(tmp, shards)
        config = hf_config(cfg, experts, "bfloat16" if dtype == torch.bfloat16 else "float32")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer_files([ckpt.path, checkpoint], tmp)
    return specs


def _hf_tensors(ckpt: DistCheckpoint, mappings: list[Mapping], passthrough: Path | None,
                read_bytes: int = DEFAULT_READ_BYTES) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    for batch in chunk_by_bytes(mappings, lambda m: 4 * torch.Size(m.our_shape).numel(), read_bytes):
        tensors = ckpt.read_many([(m.ours, m.our_shape) for m in batch])
        for m in batch:
            yield from to_hf(m, tensors.pop(m.ours))
    if passthrough is not None:
        from safetensors import safe_open

        with safe_open(str(passthrough), framework="pt") as f:
            for spec in read_header(passthrough).values():
                yield spec, f.get_tensor(spec.name)


def import_hf(hf: Path, out: Path, progress: bool = True) -> ModelConfig:
    """HF folder → weights-only checkpoint ``out`` (fp32 tensors, any parallel layout loads it)."""
    config = read_hf_config(hf)
    cfg = model_config_from_hf(config, hf / "config.json")
    experts = experts_format(config)
    folder = HFFolder(hf)
    mappings = hf_plan(cfg, experts)
    expected = {s.name: s for m in mappings for s in m.hf}
    unknown = [n for n in folder.specs if n not in expected and not is_passthrough(n)]
    if unknown:
        raise LayoutError(f"{hf}: tensor {unknown[0]} (and {len(unknown) - 1} more) is not part of the K3 layout "
                          f"for config.json ({cfg.num_layers} layers, {cfg.num_experts} experts, experts={experts}); "
                          f"the config does not match the weights")
    for name, spec in expected.items():
        if name not in folder.specs:
            raise LayoutError(f"{hf}: tensor {name} is missing (K3_SPEC §4); the checkpoint is incomplete or "
                              f"config.json describes another model")
        check_spec(spec, torch.empty(folder.specs[name].shape, dtype=folder.specs[name].dtype, device="meta"),
                   str(folder.file_of[name]))

    def get(spec: TensorSpec) -> torch.Tensor:
        t = folder.get(spec.name)
        check_spec(spec, t, str(folder.file_of[spec.name]))
        bar.update(spec.nbytes)
        return t

    tensors = {m.ours: (m.our_shape, torch.float32, lambda m=m: from_hf(m, get)) for m in mappings}
    total = sum(s.nbytes for s in expected.values())
    with atomic_dir(out) as tmp, _progress(total, "from-hf", progress) as bar:
        write_model_checkpoint(tmp, cfg, tensors, {"source": f"hf:{hf.resolve()}"})
        extra = [folder.specs[n] for n in folder.specs if is_passthrough(n)]
        if extra:
            writer = ShardWriter(tmp / PASSTHROUGH_FILE, extra)
            for spec in extra:
                writer.write(spec, folder.get(spec.name))
            writer.close()
        copy_tokenizer_files([hf], tmp)
    return cfg


def load_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, our state dict in fp32) of an HF folder or one of our checkpoints, in memory
    (for generation and tests; the converters stream instead)."""
    if (path / "config.json").is_file():
        config = read_hf_config(path)
        cfg = model_config_from_hf(config, path / "config.json")
        folder = HFFolder(path)

        def get(spec: TensorSpec) -> torch.Tensor:
            t = folder.get(spec.name)
            check_spec(spec, t, str(folder.file_of.get(spec.name, path)))
            return t

        return cfg, {m.ours: from_hf(m, get) for m in hf_plan(cfg, experts_format(config))}
    ckpt = DistCheckpoint(path)
    shapes = our_tensor_shapes(ckpt.config)
    return ckpt.config, {n: t.float() for n, t in ckpt.read_many(list(shapes.items())).items()}


def inspect_path(path: Path) -> tuple[str, list[TensorSpec]]:
    """("hf" | "k3train", tensor specs) of an HF folder or one of our checkpoints."""
    if (path / "config.json").is_file():
        return "hf", list(HFFolder(path).specs.values())
    ckpt = DistCheckpoint(path)
    return "k3train", [TensorSpec(n, shape, dtype) for n, (shape, dtype) in ckpt.stored.items()]


def listing_of_config(cfg: ModelConfig, experts: str, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """The HF tensors ``to-hf`` would write for ``cfg`` (meta device: no memory, any size)."""
    return [s for m in hf_plan(cfg, experts, dtype) for s in m.hf]


__all__ = ["export_hf", "import_hf", "inspect_path", "listing_of_config", "atomic_dir", "HFConfigError"]
