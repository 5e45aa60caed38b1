"""Single-process tests of the per-head Muon + AdamW optimizer."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from k3train.config.schema import OptimConfig
from k3train.model.roles import Kind, ParamRole, set_role
from k3train.optim.muon import build_muon
from k3train.optim.newton_schulz import newton_schulz_reference
from standins import SPECS, StandInModel


def cfg(**kw):
    c = OptimConfig(name="muon")
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_groups_follow_roles():
    m = StandInModel()
    opt = build_muon(m.named_parameters(), cfg(weight_decay=0.1))
    groups = {g["group_name"]: g for g in opt.param_groups}
    assert set(groups["muon"]["names"]) == {n for n, (_, r) in SPECS.items() if r.kind in (Kind.MATRIX, Kind.EXPERT_MATRIX)}
    assert set(groups["adamw"]["names"]) == {"emb", "lm_head", "conv"}
    assert set(groups["adamw_no_wd"]["names"]) == {"norm", "dt_bias"}
    assert groups["adamw_no_wd"]["weight_decay"] == 0.0
    assert groups["muon"]["weight_decay"] == groups["adamw"]["weight_decay"] == 0.1
    for g in opt.param_groups:
        assert g["initial_lr"] == g["lr"]


def test_missing_role_and_bad_head_split_raise():
    m = StandInModel()
    m.extra = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="'extra' has no declared role"):
        build_muon(m.named_parameters(), cfg())
    bad = nn.Parameter(torch.randn(30, 8))
    set_role(bad, ParamRole(Kind.MATRIX, "kda_qkv", 8, 0))
    with pytest.raises(ValueError, match="not divisible by the head size"):
        build_muon([("bad_q", bad)], cfg())
    # the same matrix is fine when its head group is not orthogonalized per head
    build_muon([("bad_q", bad)], cfg(per_head_groups=["mla_q_b"]))
    vec = nn.Parameter(torch.randn(8))
    set_role(vec, ParamRole(Kind.MATRIX))
    with pytest.raises(ValueError, match="must be 2-D"):
        build_muon([("v", vec)], cfg())


def _expected_delta(g: torch.Tensor, blocks_of, lr: float) -> torch.Tensor:
    """-lr * 0.2 sqrt(max(m,n)) * NS(block) for every block (``blocks_of``: 2-D views), one at a time, in
    float64."""
    out = torch.zeros_like(g, dtype=torch.float64)
    for ob, blk in zip(blocks_of(out), blocks_of(g)):
        m, n = blk.shape
        ob.copy_(-lr * 0.2 * math.sqrt(max(m, n)) * newton_schulz_reference(blk))
    return out


def test_per_head_whole_and_expert_updates_match_blockwise_reference():
    torch.manual_seed(torch.seed() % 2**31)
    m = StandInModel(seed=3).double()  # fp64 weights: the delta is not lost in weight rounding
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    lr = 0.01
    opt = build_muon(m.named_parameters(), cfg(lr=lr, weight_decay=0.0))
    m.set_grads(seed=4)
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    opt.step()
    # after one step the Nesterov momentum is a positive multiple of g; NS is scale-free
    for name, (shape, role) in SPECS.items():
        if role.kind == Kind.MATRIX and role.head_group is not None:
            hd = role.head_dim
            blocks_of = lambda t, hd=hd: t.view(-1, hd, t.shape[1])  # noqa: E731
        elif role.kind == Kind.MATRIX:
            s = role.row_interleave
            blocks_of = lambda t, s=s: [t[k::s] for k in range(s)]  # noqa: E731
        elif role.kind == Kind.EXPERT_MATRIX:
            s = role.row_interleave  # interleaved gate/up rows: rows k::s of an expert are one matrix
            blocks_of = lambda t, s=s: [t[e, k::s] for e in range(t.shape[0]) for k in range(s)]  # noqa: E731
        else:
            continue
        exp = _expected_delta(grads[name], blocks_of, lr)
        got = (getattr(m, name).detach() - before[name]).double()
        assert ((got - exp).norm() / exp.norm()) < 1e-5, name
    # all per-head blocks of one shape went through one call (8x16: q and k, 4 heads each)
    assert ((8, 16), 12) in opt.last_step_info["buckets"]  # q, k, v: 4 heads each


def test_update_rms_is_the_rms_of_the_applied_muon_updates():
    """last_step_info["update_rms"] equals the RMS of -delta/lr over all Muon parameters (wd=0), and is
    about 0.2 (the AdamW-matched scale: 0.2 sqrt(max(m, n)) times a near-orthogonal block)."""
    m = StandInModel(seed=int(torch.randint(0, 1000, ())))
    m.double()
    lr = 0.01
    opt = build_muon(m.named_parameters(), cfg(lr=lr, weight_decay=0.0))
    muon = {n: p for g in opt.param_groups if g["optimizer"] == "muon" for n, p in zip(g["names"], g["params"])}
    for seed in (4, 5):  # the second step has momentum in it
        before = {n: p.detach().clone() for n, p in muon.items()}
        m.set_grads(seed)
        opt.step()
    squares = sum(((p.detach() - before[n]) / lr).square().sum() for n, p in muon.items())
    expected = math.sqrt(float(squares) / sum(p.numel() for p in muon.values()))
    got = float(opt.last_step_info["update_rms"])
    assert abs(got - expected) < 1e-6 * expected, (got, expected)
    assert 0.1 < got < 0.3, got


def test_per_head_groups_config_switches_to_whole():
    m = StandInModel()
    opt = build_muon(m.named_parameters(), cfg(per_head_groups=[]))
    m.set_grads(1)
    opt.step()
    shapes = dict(opt.last_step_info["buckets"])
    assert (8, 16) not in shapes and shapes[(16, 32)] == 5  # q, k, v, g (32x16 -> 16x32) and o


def _run(model, opt, seeds):
    for s in seeds:
        model.set_grads(s)
        opt.step()


def test_state_dict_round_trip(tmp_path):
    m1 = StandInModel(seed=5)
    o1 = build_muon(m1.named_parameters(), cfg(lr=0.02))
    _run(m1, o1, [10, 11])
    torch.save({"model": m1.state_dict(), "optim": o1.state_dict()}, tmp_path / "ckpt.pt")

    m2 = StandInModel(seed=99)  # different init: everything must come from the checkpoint
    o2 = build_muon(m2.named_parameters(), cfg(lr=0.02))
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    m2.load_state_dict(ck["model"])
    o2.load_state_dict(ck["optim"])
    _run(m1, o1, [12, 13])
    _run(m2, o2, [12, 13])
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
    sd1, sd2 = o1.state_dict(), o2.state_dict()
    for k in sd1["state"]:
        for key in sd1["state"][k]:
            assert torch.equal(sd1["state"][k][key], sd2["state"][k][key])
    assert sd1["param_groups"] == sd2["param_groups"]


def test_bf16_params_keep_fp32_momentum_through_load():
    m = StandInModel().to(torch.bfloat16)
    o = build_muon(m.named_parameters(), cfg())
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    o.step()
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    o.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    q = m.q
    assert o.state[q]["momentum_buffer"].dtype == torch.float32


def test_lambda_lr_scales_every_group():
    m = StandInModel()
    o = build_muon(m.named_parameters(), cfg(lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1))
    _run(m, o, [1])
    sched.step()
    assert all(g["lr"] == pytest.approx(0.05) and g["initial_lr"] == 0.1 for g in o.param_groups)


def test_nonfinite_grad_skips_step_and_keeps_state():
    m = StandInModel(seed=1)
    o = build_muon(m.named_parameters(), cfg())
    _run(m, o, [2])
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = copy.deepcopy(o.state_dict())
    m.set_grads(3)
    m.q.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient.*'q'"):
        o.step()
    assert o.last_step_skipped and o.num_skipped_steps == 1
    for n, p in m.named_parameters():
        assert torch.equal(p, params[n]), n
    after = o.state_dict()
    for k in state["state"]:
        for key, v in state["state"][k].items():
            assert torch.equal(v, after["state"][k][key])
    m.set_grads(4)
    m.emb.grad[1, 1] = float("inf")
    with pytest.warns(RuntimeWarning):
        o.step()
    assert o.num_skipped_steps == 2
    _run(m, o, [5])
    assert not o.last_step_skipped
    assert o.state_dict()["k3_muon"]["num_skipped_steps"] == 2


def test_adamw_part_matches_torch_adamw():
    m = StandInModel(seed=2)
    ref = copy.deepcopy(m)
    o = build_muon(m.named_parameters(), cfg(lr=0.01, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8))
    adam_names = {"emb", "lm_head", "conv"}
    ro = torch.optim.AdamW(
        [
            {"params": [p for n, p in ref.named_parameters() if n in adam_names], "weight_decay": 0.1},
            {"params": [p for n, p in ref.named_parameters() if n in ("norm", "dt_bias")], "weight_decay": 0.0},
        ],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for s in range(3):
        m.set_grads(s)
        ref.set_grads(s)
        o.step()
        ro.step()
    for n in adam_names | {"norm", "dt_bias"}:
        torch.testing.assert_close(getattr(m, n), getattr(ref, n), rtol=1e-6, atol=1e-7)


def test_weight_decay_is_decoupled():
    p = nn.Parameter(torch.randn(16, 32))
    set_role(p, ParamRole(Kind.MATRIX))
    w0 = p.detach().clone()
    o = build_muon([("w", p)], cfg(lr=0.1, weight_decay=0.5))
    p.grad = torch.zeros_like(p)  # zero grad -> zero NS update, only decay remains
    o.step()
    torch.testing.assert_close(p.detach(), w0 * (1 - 0.1 * 0.5))


def test_ns_backend_from_config():
    from k3train.optim.muon import ns_backend
    from k3train.optim.newton_schulz import newton_schulz

    assert ns_backend("torch") is newton_schulz
    # "auto" (the default) is the torch path on CPU, whatever the Triton interpreter says
    G = torch.randn(3, 8, 24)
    assert torch.equal(ns_backend("auto")(G, steps=5, scale=1.0, dtype=torch.float32), newton_schulz(G))
    # "inductor" compiles only CUDA blocks of more than 128 rows: on CPU it is "auto"
    assert torch.equal(ns_backend("inductor")(G, steps=5, scale=1.0, dtype=torch.float32), newton_schulz(G))
    with pytest.raises(ValueError, match="muon_ns_backend"):
        ns_backend("cuda")
    m = StandInModel()
    o = build_muon(m.named_parameters(), {"lr": 0.01, "weight_decay": 0.0, "muon_ns_backend": "torch"})
    assert o.ns_fn is newton_schulz


def test_batching_choices_do_not_change_results():
    # one stack per shape (default) vs big parameters in their own batch vs plain momentum
    ms = [StandInModel(seed=4) for _ in range(3)]
    opts = [build_muon(ms[0].named_parameters(), cfg(lr=0.03)),
            build_muon(ms[1].named_parameters(), cfg(lr=0.03), stack_max_blocks=2)]
    assert len(opts[1].param_groups[0]["params"]) > 0
    for s in (1, 2):
        for m, o in zip(ms[:2], opts):
            m.set_grads(s)
            o.step()
    assert len(opts[1].last_step_info["buckets"]) > len(opts[0].last_step_info["buckets"])
    for (n, a), (_, b) in zip(ms[0].named_parameters(), ms[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    o = build_muon(ms[2].named_parameters(), cfg(lr=0.03))
    o.param_groups[0]["nesterov"] = False
    ms[2].set_grads(1)
    o.step()
    assert torch.isfinite(ms[2].q).all() and not torch.equal(ms[2].q, ms[0].q)


def test_learning_rates_read_from_the_device_follow_the_schedule():
    """lr_on_device (what a step captured in a CUDA graph needs) takes the same steps as the float learning
    rates while the schedule changes them, Muon and AdamW groups alike, weight decay on; and it refuses a
    step before sync_device_lr()."""
    a, b = StandInModel(seed=3), StandInModel(seed=3)
    oa = build_muon(a.named_parameters(), {"lr": 0.02, "weight_decay": 0.1})
    ob = build_muon(b.named_parameters(), {"lr": 0.02, "weight_decay": 0.1})
    ob.lr_on_device = True
    with pytest.raises(RuntimeError, match="sync_device_lr"):
        ob.step()
    start = [p.detach().clone() for p in b.parameters()]
    for s, lr in ((1, 0.02), (2, 0.01), (3, 0.004)):
        for o in (oa, ob):
            for g in o.param_groups:
                g["lr"] = lr if g["optimizer"] == "muon" else lr / 3
        ob.sync_device_lr()
        a.set_grads(s)
        b.set_grads(s)
        oa.step()
        ob.step()
    for (n, p), (_, q), p0 in zip(a.named_parameters(), b.named_parameters(), start):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=n)
        assert not torch.equal(q, p0), n  # every parameter moved


def test_captured_step_needs_k3muon():
    from k3train.training.optimizer_graph import CapturedOptimizerStep

    m = StandInModel()
    with pytest.raises(TypeError, match="K3Muon"):
        CapturedOptimizerStep(torch.optim.AdamW(m.parameters()))
    o = build_muon(m.named_parameters(), {"lr": 0.01})
    CapturedOptimizerStep(o)
    assert o.lr_on_device and not o.check_finite
