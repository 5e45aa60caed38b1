"""K3Muon's skipped-step counter survives a checkpoint round trip through the trainer."""

from pathlib import Path

from multiprocess import run_ranks


def _body(rank: int, world: int, out: str) -> None:
    from k3train.config.load import load_config
    from k3train.training.loop import Trainer

    run = Path(out) / "run"
    args = ["model=k3_tiny", "optim=muon", "train.device=cpu", "data.seq_len=32", "train.global_batch_size=2",
            "train.micro_batch_size=2", "train.eval_every=0", "logging.wandb=false", "logging.console=false",
            "train.steps=4", f"train.out_dir={run}"]
    trainer = Trainer(load_config(args))
    trainer.train_step()  # optimizer state exists
    trainer.step = 1
    trainer.optimizer.num_skipped_steps = 3  # as after three steps with non-finite gradients
    trainer.save()
    trainer.writer.finalize()
    trainer.lock.release()
    resumed = Trainer(load_config(args + ["train.resume=auto"]))
    assert resumed.step == 1
    assert resumed.optimizer.num_skipped_steps == 3, resumed.optimizer.num_skipped_steps
    resumed.lock.release()


def test_num_skipped_steps_survives_trainer_checkpoint(tmp_path):
    run_ranks(1, _body, str(tmp_path))
