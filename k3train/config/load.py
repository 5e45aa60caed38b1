"""Compose a typed ``K3Config`` from ``conf/`` plus command-line style overrides (no Hydra app)."""

from __future__ import annotations

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from k3train.config.schema import K3Config

# The repository's conf/; K3TRAIN_CONF points elsewhere (e.g. for a wheel installed outside a checkout).
CONF_DIR = Path(os.environ.get("K3TRAIN_CONF", Path(__file__).resolve().parents[2] / "conf"))


def register_schema() -> None:
    """Make ``k3_schema`` (the dataclass tree) the base every conf/ file merges into."""
    ConfigStore.instance().store(name="k3_schema", node=K3Config)


def to_dataclass(cfg) -> K3Config:
    """Resolve interpolations and turn a Hydra/OmegaConf config into the ``K3Config`` dataclass."""
    return OmegaConf.to_object(cfg)


def load_config(overrides: list[str] | None = None) -> K3Config:
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    return to_dataclass(cfg)
