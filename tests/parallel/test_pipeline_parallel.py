"""Pipeline parallelism over two gloo processes against one rank: one step's loss and every gradient.

k3_tiny (9 layers, AttnRes block size 4: bank rows are written at layers 0, 4 and 8, so rows cross
stage boundaries), fp32, two micro-batches through the schedule (the one-rank reference
backpropagates loss_i / 2 of each). PP2 with layout [5, 4] (1F1B) and PP2 × V2 with [3, 2, 2, 2]
(interleaved: rank 0 runs chunks 0 and 2, rank 1 chunks 1 and 3, so rank 0 caches row 0 from
chunk 0 for chunk 2 and only row 1 crosses the hop 1 → 2). Also the embedding alone on a stage
([0, 9]). Tolerance per parameter as in test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from k3train.config.schema import ModelConfig, ParallelConfig
from k3train.model.k3 import K3Model
from multiprocess import run_ranks

SEED = 7
MICRO = 2


def _batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(MICRO):
        tokens = torch.randint(0, 512, (2, 48), generator=g)
        pos = torch.arange(48).repeat(2, 1)
        pos[0, 20:] = torch.arange(28)  # two documents packed in row 0
        labels = torch.randint(0, 512, (2, 48), generator=g)
        out.append({"tokens": tokens, "position_ids": pos, "labels": labels, "loss_mask": torch.ones(2, 48)})
    return out


CASES = [(1, [5, 4]), (2, [3, 2, 2, 2]), (1, [0, 9])]


def _pp_rank(rank: int, world: int, out_path: str) -> None:
    """Every case in one pair of processes (a spawn costs more than the cases)."""
    from k3train.parallel.pipeline.layout import build_chunks
    from k3train.parallel.pipeline.runtime import PipelineSchedule
    from k3train.parallel.pipeline.stage import keep_stage
    from k3train.parallel.state import init_parallel

    cfg = ModelConfig()
    results = []
    for virtual, layout in CASES:
        groups = init_parallel(ParallelConfig(pipeline=2, virtual_stages=virtual, pipeline_layout=layout),
                               torch.device("cpu"))
        chunks = build_chunks(cfg.num_layers, 2, virtual, layout)
        torch.manual_seed(SEED)
        model = keep_stage(K3Model(cfg, groups), chunks, groups.pp_rank)
        schedule = PipelineSchedule(model, chunks, groups.pp, torch.device("cpu"))
        schedule.channels.bytes_sent = 0  # count the step's messages only
        loss_sum = schedule.train(_batches())
        eval_loss = schedule.evaluate(_batches())
        results.append({"loss_sum": loss_sum, "eval": eval_loss, "bytes": schedule.channels.bytes_sent,
                        "grads": {n: p.grad for n, p in model.named_parameters()}, "plan": schedule.plan})
    torch.save(results, f"{out_path}.{rank}")


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "pp"
    run_ranks(2, _pp_rank, str(out))
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"V{v}-{layout}" for v, layout in CASES])
def test_pipeline_matches_one_rank(pp_runs, case):
    virtual, layout = CASES[case]
    torch.manual_seed(SEED)
    ref = K3Model(ModelConfig())
    ref_losses = []
    for b in _batches():
        loss = ref(b["tokens"], b["position_ids"], b["labels"], b["loss_mask"])
        (loss / MICRO).backward()
        ref_losses.append(loss.detach())
    ref_sum = torch.zeros(())
    for loss in ref_losses:
        ref_sum += loss

    got = [pp_runs[r][case] for r in range(2)]

    for g in got:  # the step's loss is reported the same on every stage
        assert torch.allclose(g["loss_sum"], ref_sum, rtol=1e-6, atol=0), (g["loss_sum"], ref_sum)
        assert torch.allclose(g["eval"], torch.stack(ref_losses).mean(), rtol=1e-6, atol=0)
    grads = {**got[0]["grads"], **got[1]["grads"]}
    assert set(got[0]["grads"]).isdisjoint(got[1]["grads"])  # every parameter lives on one stage
    assert set(grads) == {n for n, _ in ref.named_parameters()}
    worst = 0.0
    for name, p in ref.named_parameters():
        g_ref, g_pp = p.grad, grads[name]
        assert g_pp is not None, name
        err = (g_pp - g_ref).norm().item()
        worst = max(worst, err / max(g_ref.norm().item(), 1e-30))
        assert err <= 1e-5 * g_ref.norm().item() + 1e-8, f"{name}: |dg|={err:.2e}, |g|={g_ref.norm().item():.2e}"

    # AttnRes traffic: what the ranks sent (train forward + backward, then eval forward) against the plan
    plan = got[0]["plan"]
    cached, whole = plan.hop_bytes(2 * 48, 64)
    assert got[0]["bytes"] + got[1]["bytes"] == MICRO * (2 * cached + cached)
    if virtual > 1:
        assert cached < whole
    print(f"PP2 V{virtual} {layout}: worst grad rel err={worst:.2e}, AttnRes bytes per micro-batch (forward) "
          f"{cached} vs whole bank {whole}")
