"""W&B as users expect (issue 14): credentials from `wandb login` as well as the environment, and
the run's entity, group, tags and name from logging.*; per-layer lists logged as key/i."""

from __future__ import annotations

import json
import sys
import types

import pytest

from k3train.config.schema import LoggingConfig
from k3train.config.load import load_config
from k3train.config.validate import ConfigError, validate
from k3train.training.metrics import MetricsLogger, wandb_credentials_exist


def test_credentials_from_the_environment_or_wandb_login_netrc(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    assert not wandb_credentials_exist()  # no file
    netrc.write_text("machine example.org login u password p\n")
    netrc.chmod(0o600)
    assert not wandb_credentials_exist()
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    assert wandb_credentials_exist()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.mycompany.com")
    assert not wandb_credentials_exist()  # a self-hosted server needs its own entry
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_credentials_exist()


def test_run_identity_and_per_layer_metrics_reach_wandb(tmp_path, monkeypatch):
    calls = {}

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    class Histogram:  # records what the logger passes; W&B's own limit of 512 bins
        MAX_LENGTH = 512

        def __init__(self, **kwargs):
            self.kwargs = kwargs

    fake = types.SimpleNamespace(init=lambda **kw: calls.update(init=kw) or Run(), Histogram=Histogram)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(wandb_mode="offline", wandb_entity="lab", wandb_group="sweep-7", wandb_tags=["k3", "ep2"],
                        wandb_name="lr3e-3", console=False)
    logger = MetricsLogger(cfg, tmp_path, True, {"x": 1}, 10)
    per_expert = [[0.5, 1.5, 1.0, 1.0], [float(j % 7) for j in range(1030)]]  # 1030 experts: 3 to a bin
    logger.log({"kind": "train", "step": 3, "loss": 2.5, "expert_load_per_layer": [1.1, 1.4], "skipped": False,
                "expert_load_per_expert": per_expert})
    logger.close()
    init = calls["init"]
    assert (init["entity"], init["group"], init["tags"], init["name"], init["mode"]) == \
        ("lab", "sweep-7", ["k3", "ep2"], "lr3e-3", "offline")
    assert init["id"] == (tmp_path / "wandb_run_id").read_text().strip()  # a resume continues the run
    step, data = calls["log"][0]
    assert step == 3 and data["loss"] == 2.5 and data["expert_load_per_layer/1"] == 1.4
    assert "skipped" not in data and calls["finished"]
    small, large = data["expert_load_per_expert/0"], data["expert_load_per_expert/1"]
    assert (small.kwargs["np_histogram"][0], small.kwargs["np_histogram"][1]) == ([0.5, 1.5, 1.0, 1.0], [0, 1, 2, 3, 4])
    loads, edges = large.kwargs["np_histogram"]
    assert len(loads) == 344 <= 512 and edges[:3] == [0, 3, 6] and edges[-1] == 1032
    assert loads[:3] == [2.0, 5.0, 6.0] and loads == [max(per_expert[1][j:j + 3]) for j in range(0, 1030, 3)]
    assert "expert_load_per_expert" not in json.loads((tmp_path / "metrics.jsonl").read_text())  # W&B only


def test_unknown_wandb_mode_is_refused():
    with pytest.raises(ConfigError, match=r"logging\.wandb_mode='cloud'"):
        validate(load_config(["logging.wandb_mode=cloud"]))
