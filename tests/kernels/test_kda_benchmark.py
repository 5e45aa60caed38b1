"""benchmarks/kda.py on CPU (Triton interpreter, tiny shapes): the script runs end to end and
its config sweep picks only a config that passes the accuracy gate.  Timings on CPU mean
nothing; these tests keep the GPU script from rotting between device sessions."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def bench():
    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        pytest.skip("CPU smoke test of the GPU benchmark (GPU runs use the script itself)")
    spec = importlib.util.spec_from_file_location("kda_bench", os.path.join(ROOT, "benchmarks",
                                                                            "kda.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_accuracy_gate_limits(bench):
    ok = {"o": 9e-3, "dq": 1.9e-2, "dg": 1.9e-2, "ddt_bias": 1.9e-2}
    assert bench.passes(ok)
    assert not bench.passes({**ok, "o": 1.1e-2})          # outputs: 1e-2
    assert not bench.passes({**ok, "ddt_bias": 3.2e-2})   # gradients: 2e-2 (tf32 in run 4)


def test_sweep_picks_fastest_passing_config(bench, monkeypatch):
    from kernels.kda import chunk
    monkeypatch.setattr(bench, "ACC_SHAPE", (1, 64, 2, 32))
    before = dict(chunk.CONFIG)
    times = iter([5.0, 2.0, 9.0, 1.0])  # (fwd, fwd+bwd) per config: the second is faster
    monkeypatch.setattr(bench, "bench_impl", lambda *a: (next(times), next(times)))

    def setup(s):
        B, T, H, D, docs = bench.parse_shape(s)
        inputs = bench.make(B, T, H, D, "cpu")
        return (B, T, H, D, docs), inputs, None, torch.randn(B, T, H, D)
    configs = [{}, {"bwd_bv": 16}]
    rows, best = bench.sweep(bench.ours_fn(), ["1x64x2x32"], setup, "cpu", configs)
    assert chunk.CONFIG == before                        # the sweep restores the defaults
    assert [r["config"] for r in rows] == [{}, {"bwd_bv": 16}]
    assert all(r["passes"] for r in rows), rows         # fp32 interpreter: exact to ~1e-6
    assert max(max(r["errors"].values()) for r in rows) < 1e-4
    assert best == {"bwd_bv": 16}                        # fwd+bwd 1.0 ms beats 2.0 ms

    # a config that fails the gate is never picked, however fast
    monkeypatch.setattr(bench, "passes", lambda err: False)
    times = iter([1.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(bench, "bench_impl", lambda *a: (next(times), next(times)))
    assert bench.sweep(bench.ours_fn(), ["1x64x2x32"], setup, "cpu", configs)[1] is None


def test_script_runs_and_writes_json(bench, tmp_path, monkeypatch):
    out = tmp_path / "kda.json"
    monkeypatch.setattr("sys.argv", ["kda.py", "--device", "cpu", "--no-fla", "--json", str(out),
                                     "--shapes", "1x48x2x32,1x80x2x32v3"])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["impl"]) for r in rows] == [("1x48x2x32", "ours"),
                                                        ("1x80x2x32v3", "ours")]
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in rows)
