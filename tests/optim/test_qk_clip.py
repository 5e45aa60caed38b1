"""QK-clip scales exactly the heads over tau, and exactly enough."""

import math

import pytest
import torch

from k3train.optim.qk_clip import apply_qk_clip, find_mla_modules, qk_clip_eta
from standins import StandInGatedMLA


def _track(m, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    cq = torch.randn(10, m.q_b_proj.weight.shape[1], generator=g) * scale
    x = torch.randn(10, m.kv_a_proj.weight.shape[1], generator=g) * scale
    m.max_logit.fill_(float("-inf"))
    m.track(cq, x)
    return cq, x


def test_scales_exactly_the_heads_over_tau():
    m = StandInGatedMLA(num_heads=4, seed=1)
    cq, x = _track(m)
    smax = m.max_logit.clone()
    order = smax.argsort()
    tau = float((smax[order[1]] + smax[order[2]]) / 2)  # two heads over, two under
    w = {n: p.detach().clone() for n, p in m.named_parameters()}
    logits_before = m.logits(cq, x)
    rep = apply_qk_clip(m, tau)

    over = (smax > tau).nonzero().flatten().tolist()
    assert rep["num_clipped_heads"] == 2 and sorted(rep["clipped"][""]) == sorted(over)
    assert torch.all(torch.isinf(m.max_logit)) and (m.max_logit < 0).all()  # reset to -inf
    H, dn, dr, dv = 4, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    for h in range(H):
        eta = qk_clip_eta(float(smax[h]), tau)
        q = slice(h * (dn + dr), (h + 1) * (dn + dr))
        kv = slice(h * (dn + dv), (h + 1) * (dn + dv))
        qn, qr = m.q_b_proj.weight[q][:dn], m.q_b_proj.weight[q][dn:]
        kn, v = m.kv_b_proj.weight[kv][:dn], m.kv_b_proj.weight[kv][dn:]
        torch.testing.assert_close(qn, w["q_b_proj.weight"][q][:dn] * math.sqrt(eta))
        torch.testing.assert_close(qr, w["q_b_proj.weight"][q][dn:] * eta)
        torch.testing.assert_close(kn, w["kv_b_proj.weight"][kv][:dn] * math.sqrt(eta))
        assert torch.equal(v, w["kv_b_proj.weight"][kv][dn:])  # values never touched
        if h not in over:
            assert torch.equal(m.q_b_proj.weight[q], w["q_b_proj.weight"][q])
            assert torch.equal(m.kv_b_proj.weight[kv], w["kv_b_proj.weight"][kv])
    assert torch.equal(m.kv_a_proj.weight, w["kv_a_proj.weight"])  # shared k_r untouched

    # every logit of a clipped head shrinks by exactly eta: its new max is tau
    logits_after = m.logits(cq, x)
    for h in range(H):
        eta = qk_clip_eta(float(smax[h]), tau)
        torch.testing.assert_close(logits_after[h], logits_before[h] * eta, rtol=1e-5, atol=1e-5)
    m.track(cq, x)
    new = m.max_logit
    for h in range(H):
        expect = tau if h in over else float(smax[h])
        assert float(new[h]) == pytest.approx(expect, rel=1e-5)


def test_noop_cases_and_nonfinite():
    m = StandInGatedMLA(seed=2)
    w = [p.detach().clone() for p in m.parameters()]
    rep = apply_qk_clip(m, tau=100.0)  # nothing tracked: -inf everywhere
    assert rep["num_clipped_heads"] == 0
    m.max_logit.copy_(torch.tensor([float("nan"), 1e9, 5.0]))
    rep = apply_qk_clip(m, tau=None)  # tau None: only reset and report
    assert rep["nonfinite"] == {"": [0]} and rep["num_clipped_heads"] == 0
    assert all(torch.equal(a, b) for a, b in zip(w, m.parameters()))
    m.max_logit.copy_(torch.tensor([float("inf"), 200.0, 5.0]))
    rep = apply_qk_clip(m, tau=100.0)  # +inf is reported, not turned into a zero weight
    assert rep["nonfinite"] == {"": [0]} and rep["clipped"] == {"": [1]} and rep["min_eta"] == 0.5
    with pytest.raises(ValueError):
        m.max_logit.fill_(3.0)
        apply_qk_clip(m, tau=0.0)


def test_real_gated_mla_is_found_and_clipped():
    mla_mod = pytest.importorskip("k3train.model.mla", reason="k3train.model.mla not importable")
    from k3train.config.schema import ModelConfig
    from k3train.model.documents import Documents
    from k3train.parallel.tensor_parallel import TPSpec

    cfg = ModelConfig()
    torch.manual_seed(0)
    mla = mla_mod.GatedMLA(cfg, TPSpec(None, 0.5, "torch"))
    model = torch.nn.Sequential(mla)
    assert [m for _, m in find_mla_modules(model)] == [mla]
    x = torch.randn(2, 16, cfg.hidden_size)
    docs = Documents.single(2, 16)
    mla.track_max_logit = True
    mla(x, docs)
    smax = mla.max_logit.clone()
    assert torch.isfinite(smax).all()
    tau = float(smax.min() + smax.max()) / 2
    rep = apply_qk_clip(model, tau)
    assert rep["num_clipped_heads"] == int((smax > tau).sum())
    mla(x, docs)
    expect = torch.minimum(smax, torch.tensor(tau))
    torch.testing.assert_close(mla.max_logit, expect, rtol=1e-4, atol=1e-4)


def test_log_sum_exp_bound_stands_in_for_the_exact_max_only_under_tau(monkeypatch):
    """With ``qk_clip_tau`` set, a head whose attention log-sum-exp bound is under τ − margin keeps the bound
    (≥ its exact max, ≤ exact + log T, so it is never clipped), the others the exact max. The bound here is a
    float64 log-sum-exp of the layer's own logits, standing in for the CUDA kernels' (CPU attention has none)."""
    from k3train.config.schema import ModelConfig
    from k3train.model import mla as mla_mod
    from k3train.model.documents import Documents
    from k3train.parallel.tensor_parallel import TPSpec

    cfg = ModelConfig(mla_num_heads=8)
    torch.manual_seed(0)
    mla = mla_mod.GatedMLA(cfg, TPSpec(None, 0.5, "torch"))
    x = torch.randn(2, 24, cfg.hidden_size) * 4
    docs = Documents.from_position_ids(torch.tensor([list(range(10)) + list(range(14)), list(range(24))]))
    mla.track_max_logit = True
    mla(x, docs)
    exact = mla.max_logit.clone()
    attend, bounds = mla_mod.attend, []

    def with_reference_bound(q, k, v, scale, docs, dense_mask):
        logits = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
        lse = logits.masked_fill(~dense_mask(), float("-inf")).logsumexp(-1)
        bounds.append(lse.amax(dim=(0, 2)).float().detach())
        return attend(q, k, v, scale, docs, dense_mask), bounds[-1]

    monkeypatch.setattr(mla_mod, "attend_with_lse_bound", with_reference_bound)
    mla.max_logit.fill_(float("-inf"))
    mla.qk_clip_tau = None  # no τ: the exact maximum, bound or not
    mla(x, docs)
    torch.testing.assert_close(mla.max_logit, exact)
    bound = bounds[-1]
    assert bool((bound >= exact - 1e-4).all()) and bool((bound <= exact + math.log(24) + 1e-4).all())
    tau = float(bound.median())
    under = bound < tau - mla_mod.BOUND_MARGIN
    assert 0 < int(under.sum()) < 8
    mla.max_logit.fill_(float("-inf"))
    mla.qk_clip_tau = tau
    mla(x, docs)
    torch.testing.assert_close(mla.max_logit[under], bound[under])
    torch.testing.assert_close(mla.max_logit[~under], exact[~under])
    rep = apply_qk_clip(torch.nn.Sequential(mla), tau)
    assert rep["num_clipped_heads"] == int((exact > tau).sum())
