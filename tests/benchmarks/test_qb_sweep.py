"""benchmarks/qb_sweep.py end to end on CPU: two k3_tiny variants, a table and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from k3train.config.validate import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import qb_sweep  # noqa: E402


def test_sweep_runs_variants_and_writes_json(tmp_path, capsys, one_rank):
    out = tmp_path / "sweep.json"
    base = ("model=k3_tiny train.device=cpu train.steps=200 data.seq_len=64 train.global_batch_size=4 "
            "train.micro_batch_size=2")
    qb_sweep.main(["--steps", "3", "--from-step", "2", "--base", base, "--json", str(out), "--oracle",
                   "published:model.qb_updates_per_step=1", "within:"])  # within: the default, U = 2 here
    res = json.loads(out.read_text())
    assert list(res) == ["published", "within"]
    assert res["published"]["overrides"][-1] == "model.qb_updates_per_step=1"
    for tag in res:
        rows = res[tag]["rows"]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(len(r["expert_load_per_layer"]) == 8 and r["expert_load_max_over_mean"] >= 1.0 for r in rows)
        for r in rows:  # the fitted floor: one per layer, per micro-batch next to the actual load
            assert len(r["fitted_load_per_layer"]) == 8 and min(r["fitted_load_per_layer"]) >= 1.0
            assert all(len(layer) == 2 and all(len(p) == 2 for p in layer)
                       for layer in r["micro_batch_load_actual_fitted"])
            # two micro-batches: the second under a bias fitted on the first, next to its own fitted floor
            assert all(list(grid) == ["1,1"] and grid["1,1"][0] >= grid["1,1"][1] >= 1.0
                       for grid in r["held_out_load_per_layer"])
    # a within-step update routes step 1's second micro-batch with another bias
    assert res["within"]["rows"][0]["expert_load_per_layer"] != res["published"]["rows"][0]["expert_load_per_layer"]
    table = capsys.readouterr().out
    assert "published" in table and "within" in table and "fitted worst" in table
    assert "published: held-out load" in table and "own fit" in table


def test_oracle_records_compiled_layers_like_eager_ones(monkeypatch):
    """In compiled layers (aot_eager on CPU) the recorder's observe runs eagerly at a graph break and
    keeps copies: two micro-batches give the eager model's scores and fitted loads; inactive, nothing."""
    import copy

    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model
    from k3train.training.compile import compile_layers

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = K3Model(ModelConfig(num_layers=2, full_attn_layers=[2])).train()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled, backend="aot_eager")
    recorders = {m: [qb_sweep.OracleRecorder(layer) for layer in m.moe_layers()] for m in (eager, compiled)}
    traced = []  # under CUDA graphs a traced observe would keep tensors of the graph pool
    fitted_load = qb_sweep.fitted_load
    monkeypatch.setattr(qb_sweep, "fitted_load", lambda *a: traced.append(torch.compiler.is_compiling())
                        or fitted_load(*a))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (2, 16), generator=g) for _ in range(3)]
    for model in (eager, compiled):
        for i, tokens in enumerate(batches):
            for rec in recorders[model]:
                rec.active = i < 2  # the third micro-batch is not recorded
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(tokens, labels=tokens).backward()
    # 2 models x their MoE layers x 2 recorded micro-batches, all eager (a traced one says True)
    assert traced == [False] * (2 * len(recorders[eager]) * 2)
    for want, got in zip(recorders[eager], recorders[compiled]):
        assert len(got.scores) == len(want.scores) == 2
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
        assert got.scores[0].data_ptr() != got.scores[1].data_ptr()
        assert got.pop()["pooled"] == pytest.approx(want.pop()["pooled"], rel=0.05)
        assert got.pop() is None  # popped: nothing until the next active micro-batch


def test_fitted_load_balances_what_a_bias_can_split():
    """Distinct random scores: the fitted bias brings a skewed router to near-perfect balance;
    identical tokens: no bias can split them, the load stays E/k."""
    g = torch.Generator().manual_seed(0)
    N, E, k = 4096, 16, 2
    skew = torch.linspace(0.0, 0.5, E)
    scores = torch.rand(N, E, generator=g) * 0.3 + skew
    zero = torch.zeros(E)
    plain = torch.bincount((scores + zero).topk(k, -1).indices.flatten(), minlength=E).float()
    assert float(plain.max() / plain.mean()) > 3.0
    assert float(qb_sweep.fitted_load(scores, k, zero)) < 1.05
    same = scores[:1].expand(N, E).clone()
    assert float(qb_sweep.fitted_load(same, k, zero)) == E / k


def test_a_bias_fitted_on_one_half_holds_on_a_like_half_not_on_another():
    """The held-out load: a bias fitted on half of one score population balances the other half
    (sampling alone costs little at this size); fitted on a population with other expert
    preferences, it does not."""
    g = torch.Generator().manual_seed(0)
    N, E, k = 8192, 16, 2
    scores = torch.rand(N, E, generator=g) * 0.3 + torch.linspace(0.0, 0.5, E)
    zero = torch.zeros(E)
    b = qb_sweep.fitted_bias(scores[: N // 2], k, zero)
    assert float(qb_sweep.routed_load(scores[N // 2:], k, b)) < 1.1
    other = torch.rand(N // 2, E, generator=g) * 0.3 + torch.linspace(0.5, 0.0, E)
    assert float(qb_sweep.routed_load(other, k, b)) > 2.0


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


def test_held_out_grid_covers_every_fit_and_test_split():
    """Four micro-batches: a held-out load for every (fit on the first f, test on the last t) with f + t ≤ 4,
    each at least the test set's own fitted load (a bias fitted on other tokens cannot beat one fitted on
    these)."""
    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model

    torch.manual_seed(0)
    model = K3Model(ModelConfig(num_layers=2, full_attn_layers=[2])).train()
    recorders = [qb_sweep.OracleRecorder(layer) for layer in model.moe_layers()]
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        tokens = torch.randint(0, 512, (2, 64), generator=g)
        model(tokens, labels=tokens).backward()
    for rec in recorders:
        grid = rec.pop()["held_out"]
        assert sorted(grid) == sorted(f"{f},{t}" for f in range(1, 4) for t in range(1, 5 - f))
        assert all(held >= own - 1e-6 and own >= 1.0 for held, own in grid.values())
