"""The loop reads the device back once in a step that logs nothing: the step guard's loss and gradient
norm. On a GPU every other read (``.item()``, ``.tolist()``, ``float(t)``, ``bool(t)``, ``.cpu()``) would
wait for the queued kernels, and the host could not start the next step while the optimizer runs.

Counted on CPU with a ``TorchFunctionMode`` over one trainer step (k3_tiny, the default optimizer:
per-head Muon with QK-clip; two micro-batches), by the innermost k3train frame that made the read.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

from multiprocess import run_ranks

from k3train.config.load import load_config
from k3train.training.loop import Trainer

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero"}
LOOP_LAYERS = ("k3train/training/", "k3train/optim/", "k3train/parallel/")


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            ours = [f for f in traceback.extract_stack()[:-1] if "/k3train/" in f.filename or "/kernels/" in f.filename]
            where = ours[-1] if ours else None
            self.sites[f"{where.filename.rsplit('/k3train/', 1)[-1]}:{where.name}" if where else "?"] += 1
        return func(*args, **(kwargs or {}))


def _body(rank: int, world: int, out_dir: str) -> None:
    cfg = load_config(["model=k3_tiny", "train.device=cpu", "data.seq_len=64", "train.global_batch_size=4",
                       "train.micro_batch_size=2", "train.eval_every=0", "train.save_every=0", "logging.wandb=false",
                       "logging.console=false", "train.log_every=100", "train.steps=10", f"train.out_dir={out_dir}"])
    assert cfg.optim.name == "muon" and cfg.optim.qk_clip_tau
    trainer = Trainer(cfg)
    try:
        logged = trainer.train_step()  # step 1 logs
        assert "muon_update_rms" in logged and "qk_clip_heads" in logged and "expert_load_max_over_mean" in logged
        trainer.step = 2
        built = []  # the trainer hands the model documents counted on the host batch
        model_documents = trainer.model._documents
        trainer.model._documents = lambda *a: built.append(1) or model_documents(*a)
        reads = HostReads()
        with reads:
            record = trainer.train_step()  # step 3 of 10 at log_every=100: logs nothing
    finally:
        trainer.lock.release()
    loop = {site: n for site, n in reads.sites.items() if site.startswith(tuple(s[len("k3train/"):] for s in LOOP_LAYERS))}
    print(dict(reads.sites))
    assert loop == {"training/loop.py:train_step": 1}, loop
    assert not built, "the model counted the documents itself (a read-back on a GPU)"
    assert not record["skipped"] and "expert_load_max_over_mean" not in record and "muon_update_rms" not in record


def test_a_step_that_logs_nothing_reads_the_device_once(tmp_path):
    run_ranks(1, _body, str(tmp_path))  # its own process: the trainer sets the process group and env up
