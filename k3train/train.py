"""Hydra entry point: ``python -m k3train.train model=k3_tiny train.steps=50 optim.lr=3e-4``.

Works as is for one process, and under ``torchrun`` for several (gloo on CPU, NCCL on GPU).
The config is validated once, before any process group exists.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import warnings

import hydra
from omegaconf import DictConfig

from k3train.config.load import CONF_DIR, register_schema, to_dataclass
from k3train.config.validate import ConfigError, validate, validate_keys

register_schema()
# Megatron-Core logs dataset-index details at INFO, warns that TE/apex are absent and, on every resume,
# calls a torch.distributed.checkpoint function that torch marks deprecated; keep the console for our
# progress lines.
logging.getLogger("megatron").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)


def _one_run_dir_per_sweep_job(raw: DictConfig) -> None:
    """Under ``-m`` every job gets its own run directory, ``<train.out_dir>/<its overrides>`` (e.g.
    ``runs/k3_tiny/optim.lr=0.001``), so a job never resumes or overwrites another one's run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        raw.train.out_dir = hc.runtime.output_dir


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    try:
        validate_keys(raw)
        _one_run_dir_per_sweep_job(raw)
        cfg = to_dataclass(raw)
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as err:
        sys.exit(f"k3train: config error: {err}")

    # A crash below Python (a segmentation fault in a CUDA library, an abort) prints every thread's Python
    # stack to stderr, so the log says where the run was.
    faulthandler.enable(all_threads=True)
    from k3train.parallel.state import destroy_parallel
    from k3train.training.checkpoint import CheckpointError
    from k3train.training.guards import TrainingStopped
    from k3train.training.run_dir import RunDirError
    from k3train.training.loop import Trainer

    # Errors from the user's data or checkpoints print one line (K3TRAIN_TRACEBACK=1 shows the
    # traceback); anything else is a bug and keeps its traceback.
    try:
        Trainer(cfg).fit()
    except (CheckpointError, FileNotFoundError, ValueError, FloatingPointError, TrainingStopped, RunDirError) as err:
        if os.environ.get("K3TRAIN_TRACEBACK") == "1":
            raise
        sys.exit(f"k3train: error: {err}")
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops)
        import multiprocessing

        # The interrupted checkpoint writer's processes (they inherit our SIGTERM handler, and one stuck in a
        # lock never runs it) would block the exit: kill them.
        for child in multiprocessing.active_children():
            child.kill()
        print("k3train: aborted by a second Ctrl-C; a checkpoint being written is discarded, the previous ones "
              "are intact", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
