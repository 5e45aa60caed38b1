"""Checkpoints through Megatron-Core ``dist_checkpointing``.

What is saved:
- the main weights of the model's parameters (``k3train.precision.main_params.main_param``: fp32,
  also under bf16 parameters) and its buffers (QB router biases included) as ``ShardedTensor``s with
  their global shapes, so a checkpoint written at one TP size loads at another, and a checkpoint
  loads whatever ``precision.params`` wrote or reads it. Loading writes the main weights; under bf16
  parameters the caller then refreshes the compute copies (``MainParams.sync_model``);
- optimizer state tensors shaped like their parameter, sharded the same way; the rest of the
  optimizer state (step counters, hyper-parameters, and any extra top-level entries of the
  optimizer's state dict, e.g. K3Muon's ``k3_muon`` skipped-step counter) as common state;
- scheduler, data position, step and the model config as common state, and ``ROW_LAYOUT_KEY``
  (``k3train.convert.dist_checkpoint``): row-interleaved tensors (the experts' ``w13``) are stored as
  the parameters hold them. A checkpoint without it holds them blocked ([.., s, rows/s, cols]; older
  checkpoints) and loads through that layout, interleaved on the way in, with a line saying so;
- each rank's RNG states as a per-rank ``ShardedObject`` (restored when the world size is unchanged).

Layout: ``<run>/checkpoints/step_00000010/``; ``<run>/checkpoints/latest`` names the newest.
Writes are atomic: a temporary directory is filled, renamed, and only then is ``latest``
replaced, so a crash at any point leaves the previous checkpoint intact. The shards are written by a
``CheckpointWriter`` (``k3train.training.checkpoint_writer``): in the call, or in the background with
``train.async_save`` (then the rename and ``latest`` wait for the writer).
Each checkpoint holds ``checksums.json`` (``k3train.training.integrity``), checked before a resume.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from k3train.config.schema import ModelConfig
from k3train.convert.dist_checkpoint import ROW_LAYOUT, ROW_LAYOUT_KEY, blocked_rows_note, has_blocked_rows
from k3train.model.roles import get_role, interleave_rows
from k3train.parallel.checkpoint_io import save_strategy
from k3train.parallel.state import ParallelGroups
from k3train.precision.main_params import main_param
from k3train.training.checkpoint_writer import CheckpointWriter, use_in_process_results_queue
from k3train.training.threads import single_intra_op_thread

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def _is_blocked(role, blocked_rows: bool) -> bool:
    """Whether a tensor of ``role`` is stored blocked: row-interleaved, in a checkpoint that predates the marker."""
    return blocked_rows and role is not None and role.row_interleave > 1


def _template(t: torch.Tensor, role, blocked_rows: bool) -> torch.Tensor:
    """An empty buffer for loading ``t``: its shape, or the blocked [.., s, rows/s, cols] of an older checkpoint."""
    if not _is_blocked(role, blocked_rows):
        return torch.empty_like(t)
    s = role.row_interleave
    return t.new_empty(*t.shape[:-2], s, t.shape[-2] // s, t.shape[-1])


def _as_model_layout(loaded: torch.Tensor, like: torch.Tensor, role, blocked_rows: bool) -> torch.Tensor:
    """A loaded tensor in the layout of ``like`` (an older checkpoint's blocked rows interleaved)."""
    return interleave_rows(loaded) if _is_blocked(role, blocked_rows) else loaded.view(like.shape)


def _sharded(key: str, t: torch.Tensor, role, groups: ParallelGroups, blocked_rows: bool = False):
    """A ShardedTensor with the global shape, so checkpoints reshard across TP and EP sizes.

    Expert stacks are also sharded along their expert dim over EP; their replicas are the expert-DP ranks.
    Row-interleaved tensors are sharded as they are (a TP shard is a contiguous run of whole row groups). In
    an older checkpoint (``blocked_rows``) they are [.., s, rows/s, cols] (``_template``'s buffer), each of
    the s matrices' rows sharded over TP on its own, so every dim from the rows on moves one to the right.
    """
    from megatron.core.dist_checkpointing import ShardedTensor

    dim = role.tp_partition_dim if role is not None else None
    ep_dim = role.ep_partition_dim if role is not None else None
    if _is_blocked(role, blocked_rows):
        rows = t.ndim - 3  # of the model's tensor, before the matrix axis was inserted
        dim, ep_dim = (d if d is None or d < rows else d + 1 for d in (dim, ep_dim))
    offsets = []
    if ep_dim is not None and groups.ep_size > 1:
        offsets.append((ep_dim, groups.ep_rank, groups.ep_size))
    tp_sharded = dim is not None and groups.tp_size > 1
    if tp_sharded:
        offsets.append((dim, groups.tp_rank, groups.tp_size))
    expert_parallel = ep_dim is not None and groups.ep_size > 1
    replica = groups.expert_dp_rank if expert_parallel else groups.dp_cp_rank
    replica_id = replica if tp_sharded else (groups.tp_rank, replica)
    return ShardedTensor.from_rank_offsets(key, t, *offsets, replica_id=replica_id)


def _main_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The main weight of every parameter, by parameter name: what the optimizer steps and checkpoints hold."""
    return {n: main_param(p) for n, p in model.named_parameters()}


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = _main_weights(model)
    tensors.update({n: b for n, b in model.named_buffers() if n in model.state_dict()})
    return tensors


def _optimizer_split(optimizer: torch.optim.Optimizer, names: dict[int, str]):
    """Param-shaped state tensors by (param name, key), and everything else as plain state."""
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tensors, other = {}, {}
    for idx, state in sd["state"].items():
        p = params[idx]
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0:
                tensors[(names[id(p)], k)] = v
            else:
                other.setdefault(idx, {})[k] = v
    return sd, params, tensors, other


def _group_key(group: dict, index: int):
    """A param group's identity across layouts: its name (Muon's groups), else its position."""
    return group.get("group_name", index)


def _optimizer_common(optimizer: torch.optim.Optimizer, names: dict[int, str], groups: ParallelGroups) -> dict:
    """The optimizer's non-tensor state for the common state dict, merged over the pipeline stages
    (each holds its own parameters): tensor keys, each parameter's group, its plain state, and the
    groups' hyper-parameters by group key."""
    opt_sd, params, opt_tensors, opt_other = _optimizer_split(optimizer, names)
    local = {
        "optimizer_tensor_keys": sorted(opt_tensors),
        "optimizer_param_names": [names[id(p)] for p in params],
        "optimizer_param_group_keys": {names[id(p)]: _group_key(g, i) for i, g in enumerate(optimizer.param_groups)
                                       for p in g["params"]},
        "optimizer_other": {names[id(params[i])]: v for i, v in opt_other.items()},
        "optimizer_param_groups": opt_sd["param_groups"],
        "optimizer_extra": {k: v for k, v in opt_sd.items() if k not in ("state", "param_groups")},
    }
    if groups.pp_size == 1:
        return local
    stages: list = [None] * groups.pp_size
    dist.all_gather_object(stages, local, group=groups.pp)
    merged = {"optimizer_tensor_keys": sorted({k for s in stages for k in s["optimizer_tensor_keys"]}),
              "optimizer_param_names": [n for s in stages for n in s["optimizer_param_names"]],
              "optimizer_param_group_keys": {}, "optimizer_other": {}, "optimizer_param_groups": [],
              "optimizer_extra": local["optimizer_extra"]}
    seen = set()
    for stage in stages:
        merged["optimizer_param_group_keys"].update(stage["optimizer_param_group_keys"])
        merged["optimizer_other"].update(stage["optimizer_other"])
        for i, g in enumerate(stage["optimizer_param_groups"]):
            if _group_key(g, i) not in seen:
                seen.add(_group_key(g, i))
                merged["optimizer_param_groups"].append(g)
    return merged


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state_dict(model, optimizer, groups, extra: dict, template: bool, blocked_rows: bool = False) -> dict:
    """The sharded state dict to save (``template`` False), or to load into (True; ``blocked_rows``: the
    checkpoint predates ``ROW_LAYOUT_KEY``)."""
    from megatron.core.dist_checkpointing import ShardedObject

    def sharded(key: str, t: torch.Tensor, role):
        return _sharded(key, _template(t, role, blocked_rows) if template else t.detach(), role, groups,
                        template and blocked_rows)

    sd: dict = {f"model.{n}": sharded(f"model.{n}", t, get_role(t)) for n, t in _model_tensors(model).items()}
    params_by_name = _main_weights(model)
    names = {id(p): n for n, p in params_by_name.items()}
    if optimizer is not None:
        if template:
            keys = extra["optimizer_tensor_keys"]
            opt_tensors = {(n, k): params_by_name[n] for n, k in keys
                           if n in params_by_name}  # under PP: this stage's parameters
        else:
            _, _, opt_tensors, _ = _optimizer_split(optimizer, names)
        for (n, k), t in opt_tensors.items():
            sd[f"optim.{n}.{k}"] = sharded(f"optim.{n}.{k}", t, get_role(params_by_name[n]))
    if not template or extra.get("world_size") == groups.world_size:
        sd["rng"] = ShardedObject("rng", None if template else _rng_state(), (groups.world_size,), (groups.rank,),
                                  replica_id=0)
    sd.update(extra)
    return sd


@single_intra_op_thread()
def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, data_state: dict, groups: ParallelGroups, model_cfg: ModelConfig,
                    trainer_state: dict | None = None, keep_last: int = 0,
                    writer: CheckpointWriter | None = None) -> Path:
    """Write step ``step`` (collective). With an asynchronous ``writer`` the shards are written in the
    background and the checkpoint is published (checksums, rename, ``latest``) by ``writer.finalize()``."""
    from megatron.core import dist_checkpointing

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp_step_{step:08d}"
    writer = writer or CheckpointWriter()
    writer.finalize()  # the previous save is published before this one starts
    if groups.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    names = {id(p): n for n, p in _main_weights(model).items()}
    extra = {
        "step": step,
        "world_size": groups.world_size,
        "model_config": dataclasses.asdict(model_cfg),
        ROW_LAYOUT_KEY: ROW_LAYOUT,
        "scheduler": scheduler.state_dict(),
        "data": data_state,
        "trainer_state": trainer_state or {},  # the trainer's own state (the step guard's loss history)
        **_optimizer_common(optimizer, names, groups),
    }
    use_in_process_results_queue()
    request = dist_checkpointing.save(_state_dict(model, optimizer, groups, extra, template=False), str(tmp),
                                      sharded_strategy=save_strategy(), async_sharded_save=True)
    request.add_finalize_fn(partial(_publish, tmp, final, keep_last, groups.is_main))
    writer.submit(request)
    return final


def _publish(tmp: Path, final: Path, keep_last: int, is_main: bool) -> None:
    """Once every shard and the metadata are written (Megatron's last finalize step ends in a barrier):
    checksums, rename into place, then ``latest`` (collective)."""
    if is_main:
        from k3train.training.integrity import write_checksums

        ckpt_root = final.parent
        write_checksums(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = ckpt_root / f".{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, ckpt_root / LATEST)
        if keep_last:
            prune_checkpoints(ckpt_root, keep_last)
    dist.barrier()


def remove_incomplete_saves(run_dir: Path) -> list[str]:
    """Delete what saves that never finished left in ``<run_dir>/checkpoints`` (a ``.tmp_step_*``
    folder of partial shards, a half-written ``latest`` pointer), with one warning line each.
    Call it while holding the run directory's lock: no other trainer can be writing there."""
    removed = []
    ckpt_root = Path(run_dir) / "checkpoints"
    for tmp in sorted(ckpt_root.glob(".tmp_step_*")) + sorted(ckpt_root.glob(f".{LATEST}.tmp")):
        files = [f for f in tmp.rglob("*") if f.is_file()] if tmp.is_dir() else [tmp]
        size = sum(f.stat().st_size for f in files)
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
        print(f"k3train: warning: removed {tmp} ({size / 2**20:.1f} MiB), left by a save that did not finish",
              file=sys.stderr, flush=True)
        removed.append(tmp.name)
    return removed


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest ``step_*`` checkpoints (``latest`` is the newest)."""
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in steps[:-keep_last]:
        shutil.rmtree(old)


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist; delete {pointer} or restore it")
    return path


def check_model_config(saved: dict, model_cfg: ModelConfig, path: Path, ignore: tuple[str, ...] = ("name",),
                       fix: str = "resume with the same model config or use train.resume=none") -> None:
    current = dataclasses.asdict(model_cfg)
    diffs = {k: (saved.get(k), v) for k, v in current.items() if k not in ignore and saved.get(k) != v}
    if diffs:
        detail = "; ".join(f"model.{k}: checkpoint={a} config={b}" for k, (a, b) in sorted(diffs.items()))
        raise CheckpointError(f"checkpoint {path} was written for a different model config ({detail}); {fix}")


# Model fields that do not change the weights: train.init_from may change them.
NON_WEIGHT_FIELDS = ("name", "require_k3_layer_pattern", "qb_estimator", "qb_bins", "qb_ema", "qb_rescore_stride",
                     "qb_updates_per_step", "qb_step_feedback", "init_std", "max_seq_len")


@single_intra_op_thread()
def load_model_weights(path: Path, model: nn.Module, groups: ParallelGroups, model_cfg: ModelConfig) -> None:
    """train.init_from: copy the model tensors of a checkpoint (any parallel layout, full or weights-only)
    into ``model``; optimizer, scheduler, step and data position stay fresh."""
    from megatron.core import dist_checkpointing

    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise CheckpointError(f"{path} is not a k3train checkpoint directory (no dist_checkpointing metadata); "
                              f"train.init_from takes one of ours or an HF Kimi K3 folder")
    common = dist_checkpointing.load_common_state_dict(str(path))
    check_model_config(common["model_config"], model_cfg, path, NON_WEIGHT_FIELDS,
                       "set the model config to the checkpoint's (for an HF folder: its config.json)")
    blocked = has_blocked_rows(common)
    template = _state_dict(model, None, groups, {}, template=True, blocked_rows=blocked)
    loaded = dist_checkpointing.load(template, str(path))
    tensors = _model_tensors(model)
    _note_blocked_rows(path, tensors, groups, blocked)
    with torch.no_grad():
        for n, t in tensors.items():
            t.copy_(_as_model_layout(loaded[f"model.{n}"], t, get_role(t), blocked))


def _note_blocked_rows(path: Path, tensors: dict[str, torch.Tensor], groups: ParallelGroups, blocked: bool) -> None:
    """One line (main rank) when an older checkpoint's blocked rows are being interleaved."""
    names = [n for n, t in tensors.items() if _is_blocked(get_role(t), blocked)]
    if names and groups.is_main:
        print(blocked_rows_note(path, names), file=sys.stderr, flush=True)


@single_intra_op_thread()
def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                    groups: ParallelGroups, model_cfg: ModelConfig) -> dict:
    """Restore everything in place; returns {"step", "data"}."""
    from megatron.core import dist_checkpointing

    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise CheckpointError(f"{path} is not a k3train checkpoint directory (no dist_checkpointing metadata)")
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as err:  # an unreadable file: one line, not a library traceback
        raise CheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}; "
                              f"give train.resume another checkpoint") from err
    check_model_config(common["model_config"], model_cfg, path)
    lookup = {"optimizer_tensor_keys": [tuple(k) for k in common["optimizer_tensor_keys"]],
              "world_size": common["world_size"]}
    blocked = has_blocked_rows(common)
    template = _state_dict(model, optimizer, groups, lookup, template=True, blocked_rows=blocked)
    template = {k: v for k, v in template.items() if k not in lookup}
    try:
        loaded = dist_checkpointing.load(template, str(path))
    except Exception as err:  # an unreadable shard: one line, not a library traceback
        raise CheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
                              f"; give train.resume another checkpoint") from err

    tensors = _model_tensors(model)
    _note_blocked_rows(path, tensors, groups, blocked)
    with torch.no_grad():
        for n, t in tensors.items():
            t.copy_(_as_model_layout(loaded[f"model.{n}"], t, get_role(t), blocked))
    names = {id(p): n for n, p in _main_weights(model).items()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved_keys = common.get("optimizer_param_group_keys")
    if saved_keys is None:  # written before pipeline parallelism: same layout or nothing
        same = order == common["optimizer_param_names"]
    else:  # every parameter of this stage in the same param group as when saved (any pipeline layout)
        same = all(saved_keys.get(names[id(p)]) == _group_key(g, i)
                   for i, g in enumerate(optimizer.param_groups) for p in g["params"])
    if not same:
        raise CheckpointError(f"checkpoint {path} has a different optimizer parameter layout (optim.name or "
                              f"per-head config changed?); resume with the same optim config or train.resume=none")
    param_index = {n: i for i, n in enumerate(order)}
    state: dict = {}
    for n, k in common["optimizer_tensor_keys"]:
        if n in param_index:
            state.setdefault(param_index[n], {})[k] = _as_model_layout(loaded[f"optim.{n}.{k}"], tensors[n],
                                                                       get_role(tensors[n]), blocked)
    for n, other in common["optimizer_other"].items():
        if n in param_index:
            state.setdefault(param_index[n], {}).update(other)
    saved_groups = {_group_key(g, i): g for i, g in enumerate(common["optimizer_param_groups"])}
    param_groups = []  # the saved hyper-parameters over this stage's parameters
    for i, g in enumerate(optimizer.state_dict()["param_groups"]):
        kept = {k: g[k] for k in ("params", "names") if k in g}
        param_groups.append({**saved_groups[_group_key(g, i)], **kept})
    optimizer.load_state_dict({**common.get("optimizer_extra", {}), "state": state, "param_groups": param_groups})
    scheduler.load_state_dict(common["scheduler"])
    if "rng" in loaded:  # per-rank RNG streams only carry over to the same number of ranks
        _set_rng_state(loaded["rng"])
    return {"step": common["step"], "data": common["data"], "trainer": common.get("trainer_state", {})}
