"""Issue 14: the step record's optimizer metrics and phase times, and train.profile_steps (k3_tiny, CPU).

One run with Muon, a QK-clip threshold every head of the tiny model exceeds, and step 2 profiled.
(The update RMS value itself is checked against parameter deltas in tests/optim/test_muon_optimizer.py.)
"""

from __future__ import annotations

import json

from test_training_helpers import train

PHASES = ("data", "fwd_bwd", "comm", "optimizer")


def test_muon_qk_clip_phases_and_profile(tmp_path):
    tau = 1e-3
    train(tmp_path, "optim=muon", f"optim.qk_clip_tau={tau}", "train.steps=3", "train.save_every=0",
          "train.log_every=1", "train.profile_steps=[2,2]")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.1 < r["muon_update_rms"] < 0.3, r  # the AdamW-matched scale, ~0.2
        assert isinstance(r["qk_clip_heads"], int) and r["qk_clip_heads"] > 0, r
        assert r["qk_max_logit"] > tau, r
        times = [r[f"time_{p}_s"] for p in PHASES]
        assert all(t > 0 for t in times) and sum(times) <= r["step_time_s"], r
        assert r["time_fwd_bwd_s"] > r["time_data_s"], r
    trace = json.loads((tmp_path / "profile" / "trace_rank0_steps2-2.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert set(PHASES) <= names, "the phases are labelled ranges in the trace"
    assert any(str(n).startswith("aten::mm") for n in names), "the trace holds the step's operators"
    by_module = json.loads((tmp_path / "profile" / "by_module_rank0_steps2-2.json").read_text())
    for path in ("K3Layer/KimiDeltaAttention", "K3Layer/LatentMoE", "optimizer"):
        row = by_module[path]
        assert row["fwd_ms"] + row["bwd_ms"] > 0, (path, row)
    assert by_module["K3Layer/KimiDeltaAttention"]["bwd_n"] > 0, "the backward is charged to its module"
