"""benchmarks/moe.py --ep (benchmarks/moe_ep.py) end to end on CPU: 2 gloo ranks, tiny dims, every
dispatcher (ours and Megatron-Core's) and routing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_training_helpers import REPO

DISPATCHERS = ("alltoall", "balanced", "megatron")
CASES = ("natural", "skewed", "zero-load", "rotating")
PHASES = ("dispatch", "experts", "combine", "backward")


def test_moe_ep_benchmark_every_dispatcher_and_case(tmp_path):
    out = tmp_path / "moe_ep.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "benchmarks" / "moe.py"), "--ep", "--experts", "8", "--topk", "3",
                           "--latent", "16", "--width", "16", "--tokens", "64", "--warmup", "0", "--rep", "2",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {(r["dispatcher"], r["routing"]): r for r in result["rows"]}
    assert set(rows) == {(d, c) for d in DISPATCHERS for c in CASES}, result.get("megatron")
    assert result["megatron"]["cpu_stand_ins"] and "megatron" in proc.stdout
    # Megatron-Core's output and gradients equal plain all-to-all's (fp32) in every case
    assert set(result["checks"]) == set(CASES) and result["check_limit"] == 1e-5
    assert all(0 <= err <= 1e-5 for check in result["checks"].values() for err in check.values())
    for (dispatcher, case), r in rows.items():
        phases = [r["phases_ms"][p] for p in PHASES]
        assert all(t > 0 for t in phases) and sum(phases) <= r["ms"] + 1e-9, (dispatcher, case, r)
        assert abs(r["dispatch_combine_ms"] - r["phases_ms"]["dispatch"] - r["phases_ms"]["combine"]) < 1e-9
        assert r["rank_medians_ms"]["iteration"][r["slowest_rank"]] == max(r["rank_medians_ms"]["iteration"])
        assert sum(r["rows_per_rank"]) == 2 * 64 * 3
    for case in CASES:
        assert rows["balanced", case]["compute_max_over_mean"] == 1.0  # exactly S·K copies per rank
        assert rows["megatron", case]["rows_per_rank"] == rows["alltoall", case]["rows_per_rank"]  # at home
    assert rows["alltoall", "zero-load"]["rows_per_rank"] == [384, 0]
