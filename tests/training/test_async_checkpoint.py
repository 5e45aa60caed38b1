"""train.async_save: the checkpoint is the state at the save, and ``latest`` moves only once the files are complete.

The writer process is paused (SIGSTOP) while the trainer runs two more steps, so the shards are written
after the parameters changed: they must still hold the values of the save's step. A writer killed
mid-save must leave ``latest`` on the previous checkpoint. (Bit-exact resume from an async checkpoint:
tests/training/test_training.py::test_resume_is_bit_exact; multi-rank: test_interrupts.py.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from multiprocess import run_ranks
from test_training_helpers import checkpoint_tensors


def _state(trainer) -> dict[str, torch.Tensor]:
    """The model and param-shaped optimizer tensors under the checkpoint's key names, cloned."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out = {f"model.{n}": t.detach().clone() for n, t in trainer.model.state_dict().items() if torch.is_tensor(t)}
    for p, state in trainer.optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0:
                out[f"optim.{names[id(p)]}.{k}"] = v.clone()
    return out


def _steps(trainer, n: int) -> None:
    for _ in range(n):
        trainer.train_step()
        trainer.step += 1


def _body(rank: int, world: int, out: str) -> None:
    from torch.distributed.checkpoint import CheckpointException

    from k3train.config.load import load_config
    from k3train.training.integrity import verify_checkpoint
    from k3train.training.loop import Trainer

    run = Path(out) / "run"
    cfg = load_config(["model=k3_tiny", "train.device=cpu", "data.seq_len=64", "train.global_batch_size=4",
                       "train.micro_batch_size=2", "train.eval_every=0", "logging.wandb=false",
                       "logging.console=false", "train.steps=10", "train.async_save=true", f"train.out_dir={run}"])
    trainer = Trainer(cfg)
    ckpts = run / "checkpoints"
    _steps(trainer, 2)
    at_save = _state(trainer)
    trainer.save()
    writer = trainer.writer._process
    assert writer is not None and writer.is_alive() and trainer.writer.pending
    os.kill(writer.pid, signal.SIGSTOP)
    _steps(trainer, 2)  # the optimizer updates the parameters in place while the writer is paused
    name, param = next(iter(trainer.model.named_parameters()))
    assert not torch.equal(at_save[f"model.{name}"], param)
    assert not (ckpts / "latest").exists() and not trainer.writer.written()
    os.kill(writer.pid, signal.SIGCONT)
    trainer.writer.finalize()
    assert (ckpts / "latest").read_text() == "step_00000002" and verify_checkpoint(ckpts / "step_00000002") is None
    saved = checkpoint_tensors(ckpts / "step_00000002", Path(out))
    assert set(at_save) <= set(saved) and any(k.startswith("optim.") for k in at_save)
    for key, value in at_save.items():
        assert torch.equal(saved[key].view_as(value), value), key

    trainer.save()  # step 4: its writer dies mid-save
    trainer.writer._process.kill()
    with pytest.raises(CheckpointException, match="CheckpointException"):
        trainer.writer.finalize()
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert (ckpts / ".tmp_step_00000004").is_dir() and not (ckpts / "step_00000004").exists()
    trainer.lock.release()
    resumed = Trainer(cfg)  # the next run clears the unfinished save and resumes from step 2
    assert resumed.step == 2 and not (ckpts / ".tmp_step_00000004").exists()
    resumed.lock.release()


def test_async_save_is_the_state_at_the_save(tmp_path):
    run_ranks(1, _body, str(tmp_path))
