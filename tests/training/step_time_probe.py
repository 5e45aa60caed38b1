"""Subprocess probe for test_checkpoint_threads: k3_tiny step times before and after a checkpoint save.

Run as ``python step_time_probe.py OUT_DIR THREADS``; prints one JSON line with per-step wall times and
voluntary context switches. A fresh process, so no earlier test has touched the OpenMP pools.
"""

import json
import os
import resource
import sys
import time


def _steps(trainer, n: int) -> tuple[list[float], list[int]]:
    times, switches = [], []
    for _ in range(n):
        c0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        t0 = time.perf_counter()
        trainer.train_step()
        trainer.step += 1
        times.append(time.perf_counter() - t0)
        switches.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - c0)
    return times, switches


def main() -> None:
    import torch

    torch.set_num_threads(int(sys.argv[2]))
    from k3train.config.load import load_config
    from k3train.parallel.state import destroy_parallel
    from k3train.training.loop import Trainer

    cfg = load_config(["model=k3_tiny", "train.device=cpu", "data.seq_len=64", "train.global_batch_size=4",
                       "train.micro_batch_size=2", "train.eval_every=0", "logging.wandb=false",
                       "logging.console=false", "train.steps=40", f"train.out_dir={sys.argv[1]}"])
    trainer = Trainer(cfg)
    _steps(trainer, 2)  # warm-up
    before, cs_before = _steps(trainer, 8)
    tasks_before = len(os.listdir("/proc/self/task"))
    trainer.save()
    tasks_after = len(os.listdir("/proc/self/task"))
    after, cs_after = _steps(trainer, int(sys.argv[3]) if len(sys.argv) > 3 else 8)
    print(json.dumps({"before": before, "after": after, "switches_before": cs_before, "switches_after": cs_after,
                      "threads_after": torch.get_num_threads(),
                      "tasks_before": tasks_before, "tasks_after": tasks_after}), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
