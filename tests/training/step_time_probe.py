"""Subprocess probe for test_checkpoint_threads: k3_tiny steps before and after a checkpoint save and load.

Run as ``python step_time_probe.py OUT_DIR STEPS``; prints one JSON line. A fresh process (no earlier
test has touched its OpenMP pools) on 2 cores with 2 intra-op threads, where the slowdown showed. Per
step it records the wall time and the voluntary context switches (sleeps) of the intra-op pool's
worker threads: the OS threads that the first parallel op starts.
"""

import json
import os
import sys
import time


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _sleeps(tids: set[str]) -> int:
    total = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def _steps(trainer, workers: set[str], n: int) -> tuple[list[float], list[int]]:
    times, sleeps = [], []
    for _ in range(n):
        s0, t0 = _sleeps(workers), time.perf_counter()
        trainer.train_step()
        trainer.step += 1
        times.append(time.perf_counter() - t0)
        sleeps.append(_sleeps(workers) - s0)
    return times, sleeps


def main() -> None:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # libgomp counts these cores at start-up
    import torch

    torch.set_num_threads(2)
    before_pool = _tasks()
    torch.ones(1 << 20).add_(1)  # a parallel op starts the intra-op pool
    workers = _tasks() - before_pool
    from k3train.config.load import load_config
    from k3train.parallel.state import destroy_parallel
    from k3train.training.loop import Trainer

    cfg = load_config(["model=k3_tiny", "train.device=cpu", "data.seq_len=64", "train.global_batch_size=2",
                       "train.micro_batch_size=2", "train.eval_every=0", "logging.wandb=false",
                       "logging.console=false", "train.steps=40", f"train.out_dir={sys.argv[1]}"])
    trainer = Trainer(cfg)
    n = int(sys.argv[2])
    _steps(trainer, workers, 1)  # warm-up
    before, sleeps_before = _steps(trainer, workers, n)
    tasks_before = len(_tasks())
    trainer.save()
    tasks_after = len(_tasks())
    after, sleeps_after = _steps(trainer, workers, n)
    # A resumed run: a new process group (gloo threads that have run no collective yet) loads the checkpoint.
    trainer.lock.release()
    destroy_parallel()
    resumed = Trainer(cfg)
    after_load, sleeps_after_load = _steps(resumed, workers, n)
    print(json.dumps({"workers": len(workers), "before": before, "after": after, "after_load": after_load,
                      "sleeps_before": sleeps_before, "sleeps_after": sleeps_after,
                      "sleeps_after_load": sleeps_after_load, "threads_after": torch.get_num_threads(),
                      "tasks_before": tasks_before, "tasks_after": tasks_after}), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
