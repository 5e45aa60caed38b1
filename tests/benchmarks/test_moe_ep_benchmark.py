"""benchmarks/moe_ep.py end to end on CPU: 2 gloo ranks, tiny dims, every dispatcher and routing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_training_helpers import REPO


def test_moe_ep_benchmark_balances_every_case(tmp_path):
    out = tmp_path / "moe_ep.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "benchmarks" / "moe_ep.py"), "--experts", "8", "--topk", "2", "--latent", "16",
                           "--width", "16", "--tokens", "64", "--warmup", "1", "--rep", "2", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {(r["dispatcher"], r["routing"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 8 and "balanced" in proc.stdout
    for case in ("natural", "skewed", "zero-load", "rotating"):
        assert rows["balanced", case]["compute_max_over_mean"] == 1.0  # exactly S·K copies per rank
        assert sum(rows["balanced", case]["rows_per_rank"]) == 2 * 64 * 2
    assert rows["alltoall", "zero-load"]["rows_per_rank"] == [256, 0]
