"""benchmarks/qb_sweep.py end to end on CPU: two k3_tiny variants, a table and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from k3train.config.validate import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import qb_sweep  # noqa: E402


def test_sweep_runs_variants_and_writes_json(tmp_path, capsys, one_rank):
    out = tmp_path / "sweep.json"
    base = ("model=k3_tiny train.device=cpu train.steps=200 data.seq_len=64 train.global_batch_size=4 "
            "train.micro_batch_size=2")
    qb_sweep.main(["--steps", "3", "--from-step", "2", "--base", base, "--json", str(out),
                   "published:", "within:model.qb_updates_per_step=2"])
    res = json.loads(out.read_text())
    assert list(res) == ["published", "within"]
    assert res["within"]["overrides"][-1] == "model.qb_updates_per_step=2"
    for tag in res:
        rows = res[tag]["rows"]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(len(r["expert_load_per_layer"]) == 8 and r["expert_load_max_over_mean"] >= 1.0 for r in rows)
    assert res["within"]["rows"][0] != res["published"]["rows"][0]  # a within-step update changes step 1
    table = capsys.readouterr().out
    assert "published" in table and "within" in table


def test_sweep_refuses_a_bad_variant_by_its_field(tmp_path, one_rank):
    with pytest.raises(ConfigError, match=r"model\.qb_updates_per_step"):
        qb_sweep.main(["--steps", "1", "--json", str(tmp_path / "s.json"), "--base",
                       "model=k3_tiny train.device=cpu train.global_batch_size=4 train.micro_batch_size=4",
                       "bad:model.qb_updates_per_step=2"])


def test_sweep_leaves_no_process_group(tmp_path, one_rank):
    import torch.distributed as dist

    qb_sweep.main(["--steps", "1", "--json", str(tmp_path / "s.json"), "--base",
                   "model=k3_tiny train.device=cpu data.seq_len=64 train.global_batch_size=4", "only:"])
    assert not dist.is_initialized()
