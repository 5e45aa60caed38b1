"""benchmarks/moe.py on CPU (fp32, tiny shapes): the script runs end to end, checks grouped and
Megatron-Core against the loop, and writes every row; the routings have the loads they claim.
Timings on CPU mean nothing; these tests keep the GPU script from rotting between device sessions."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SMOKE = "--device cpu --dtype fp32 --tokens 256 --experts 8 --topk 2 --latent 32 --width 32 --warmup 0 --rep 1"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_bench", os.path.join(ROOT, "benchmarks", "moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(bench, tmp_path, extra=""):
    out = tmp_path / "moe.json"
    bench.main(f"{SMOKE} {extra} --json {out}".split())
    assert not dist.is_initialized()  # the script tears its process group down
    return json.loads(out.read_text())


def test_smoke_run_checks_and_times_every_row(bench, tmp_path, one_rank):
    res = run(bench, tmp_path)
    rows = res["rows"]
    assert [(r["routing"], r["impl"]) for r in rows] == [("any", "dense"), ("any", "dense_gemm")] + [
        (kind, impl) for kind in ("natural", "skewed") for impl in ("loop", "grouped", "megatron")]
    assert all(r["ms"] > 0 and r["TFLOPs"] > 0 and r["of_dense"] > 0 for r in rows), rows
    mc = res["info"]["megatron"]
    assert mc["experts"] == "SequentialMLP" and set(mc["not_run"]) == {"TEGroupedMLP", "GroupedMLP"}, mc
    for kind in ("natural", "skewed"):
        for impl in ("grouped", "megatron"):  # fp32: equal to the loop up to summation order
            errors = res["checks"][kind][impl]
            assert set(errors) == {"out", "dz", "dweights", "dw13", "dw2"}
            assert max(errors.values()) < 1e-5, (kind, impl, errors)
    assert res["loads"]["skewed"]["max_over_mean"] > res["loads"]["natural"]["max_over_mean"]


def test_megatron_failure_is_a_reason_not_a_number(bench, tmp_path, one_rank, monkeypatch):
    def broken(*args):
        raise ImportError("no megatron here")
    monkeypatch.setattr(bench, "megatron_experts", broken)
    res = run(bench, tmp_path, "--routing skewed")
    row = [r for r in res["rows"] if r["impl"] == "megatron"]
    assert row == [dict(routing="skewed", impl="megatron", na="ImportError: no megatron here")]
    assert [r["impl"] for r in res["rows"] if "ms" in r] == ["dense", "dense_gemm", "loop", "grouped"]


def test_routings(bench):
    N, E, k = 2048, 64, 4
    for kind in ("natural", "skewed"):
        experts, weights = bench.make_routing(kind, N, E, k, 256)
        assert experts.shape == weights.shape == (N, k) and experts.dtype == torch.int64
        assert (experts.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token
        torch.testing.assert_close(weights.sum(-1), torch.ones(N))
    natural = torch.bincount(bench.make_routing("natural", N, E, k, 256)[0].flatten(), minlength=E)
    skewed = torch.bincount(bench.make_routing("skewed", N, E, k, 256)[0].flatten(), minlength=E)
    mean = N * k / E
    assert natural.max() < 2 * mean < 4 * mean < skewed.max()  # roughly uniform vs Dirichlet(0.3)


def test_expert_tiled_rows_check_against_the_loop(bench, tmp_path, one_rank):
    """``--grouped-gemms torch,tiles:0``: the padded layout (the kernel's reference on CPU) is checked against the
    loop like the packed one, and each gets its row."""
    res = run(bench, tmp_path, "--impls grouped --grouped-gemms torch,tiles:0")
    assert [r["impl"] for r in res["rows"] if r["routing"] == "natural"] == ["grouped", "grouped tiles:0"]
    for kind in ("natural", "skewed"):
        errors = res["checks"][kind]["grouped tiles:0"]
        assert max(errors.values()) < 1e-5, (kind, errors)


def test_rounds_time_every_row_again_and_report_medians(bench, tmp_path, one_rank):
    """``--rounds 3``: every row timed three times, its ms the median, its "of dense" the median of the rounds'
    dense/row ratios (the dense row's own is exactly 1)."""
    import statistics

    res = run(bench, tmp_path, "--impls grouped --grouped-gemms torch,tiles:0 --rounds 3")
    timed = [r for r in res["rows"] if "ms" in r]
    assert [r["impl"] for r in timed] == ["dense", "dense_gemm"] + ["grouped", "grouped tiles:0"] * 2
    dense = timed[0]["ms_rounds"]
    for r in timed:
        assert len(r["ms_rounds"]) == 3 and all(ms > 0 for ms in r["ms_rounds"]), r
        assert r["ms"] == statistics.median(r["ms_rounds"])
        ratios = [d / ms for d, ms in zip(dense, r["ms_rounds"])]
        assert r["of_dense_rounds"] == ratios and r["of_dense"] == statistics.median(ratios)
    assert timed[0]["of_dense_rounds"] == [1.0, 1.0, 1.0]
    with pytest.raises(SystemExit):
        bench.main(f"{SMOKE} --rounds 0 --json {tmp_path / 'x.json'}".split())
