"""Hydra entry point: ``python -m k3train.train model=k3_tiny train.steps=50 optim.lr=3e-4``.

Works as is for one process, and under ``torchrun`` for several (gloo on CPU, NCCL on GPU).
The config is validated once, before any process group exists.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import hydra
from omegaconf import DictConfig

from k3train.config.load import CONF_DIR, register_schema, to_dataclass
from k3train.config.validate import ConfigError, validate

register_schema()
# Megatron-Core logs dataset-index details at INFO and warns that TE/apex are absent; keep the console
# for our progress lines.
logging.getLogger("megatron").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    cfg = to_dataclass(raw)
    try:
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as err:
        sys.exit(f"k3train: config error: {err}")

    from k3train.parallel.state import destroy_parallel
    from k3train.training.checkpoint import CheckpointError
    from k3train.training.loop import Trainer

    # Errors from the user's data or checkpoints print one line (K3TRAIN_TRACEBACK=1 shows the
    # traceback); anything else is a bug and keeps its traceback.
    try:
        Trainer(cfg).fit()
    except (CheckpointError, FileNotFoundError, ValueError, FloatingPointError) as err:
        if os.environ.get("K3TRAIN_TRACEBACK") == "1":
            raise
        sys.exit(f"k3train: error: {err}")
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
