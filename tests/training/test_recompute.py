"""Activation recompute (``train.recompute``, k3train/training/recompute.py) on k3_tiny, CPU.

Every policy gives the loss and every parameter gradient of ``none`` bit for bit (fp32, and bf16
parameters under bf16 autocast with expert QAT): the replay runs the same ops on the same inputs.
The forward's side effects happen once per micro-batch: expert load, Quantile Balancing state (and
the bias it writes), the kept router inputs and MLA's max logit equal ``none``'s. The recomputed
modules do run twice (the second time as a replay) and the activations saved outside them shrink.
"""

from __future__ import annotations

import pytest
import torch

import k3train.model.attn_res as attn_res_module
import k3train.model.kda as kda_module
from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from k3train.model.mla import GatedMLA
from k3train.model.replay import replaying
from k3train.precision.main_params import MainParams
from k3train.training.recompute import apply_recompute
from kernels.attn_res import attn_res_site, triton_attn_res
from test_training_helpers import losses, train
from triton_cpu import triton_interpreter

POLICIES = ("attn_res", "kda", "full")


def _model(policy: str, qat: bool = False, params: torch.dtype = torch.float32) -> K3Model:
    """k3_tiny (qb_rescore_stride 2, QK-clip's max logit tracked) with non-zero pseudo-queries and a
    random router bias, so that AttnRes weights get gradients and the bias changes the routing."""
    torch.manual_seed(0)
    model = K3Model(ModelConfig(qb_rescore_stride=2), linear_backend="torch")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "AttnResAggregator":
                m.proj.copy_(torch.randn(m.proj.shape, generator=g) * 0.5)
        for layer in model.moe_layers():
            layer.gate.e_score_correction_bias.copy_(torch.randn(layer.gate.e_score_correction_bias.shape,
                                                                 generator=g) * 0.05)
    for m in model.modules():
        if isinstance(m, GatedMLA):
            m.track_max_logit = True
    if qat:
        from k3train.precision.mx_qat import enable_expert_qat

        enable_expert_qat(model)
    MainParams(model, params)
    apply_recompute(model, policy)
    return model


def _step(model: K3Model, autocast: bool = False, micro_batches: int = 2) -> list[torch.Tensor]:
    """Forward and backward of ``micro_batches`` random micro-batches [2, 32] (two documents in
    a row), as the trainer's loop does; returns the losses."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, 512, (2, 33), generator=g)
        pos = torch.arange(32).repeat(2, 1)
        pos[1, 12:] = torch.arange(20)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], pos, tokens[:, 1:])
        (loss / micro_batches).backward()
        out.append(loss.detach())
    return out


def _assert_same_step(got: K3Model, ref: K3Model, got_losses, ref_losses) -> None:
    for a, b in zip(got_losses, ref_losses):
        assert torch.equal(a, b), (a, b)
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        assert q.grad is not None and torch.equal(p.grad, q.grad), name
    for a, b in zip(got.moe_layers(), ref.moe_layers()):
        assert torch.equal(a.load.tokens, b.load.tokens) and torch.equal(a.load.worst, b.load.worst)
        assert a.load.computed == b.load.computed
        assert (a.balancer.counts.sum(1) == 2 * 64).all()  # each expert saw two micro-batches of 64 tokens
        assert torch.equal(a.balancer.counts, b.balancer.counts)
        assert len(a.router_inputs) == len(b.router_inputs) == 2
        assert all(torch.equal(x, y) for x, y in zip(a.router_inputs, b.router_inputs))
    for a, b in zip(got.modules(), ref.modules()):
        if isinstance(a, GatedMLA):
            assert torch.equal(a.max_logit, b.max_logit)
    for a, b in zip(got.moe_layers(), ref.moe_layers()):  # the bias Quantile Balancing writes
        a.update_bias()
        b.update_bias()
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_none_bit_for_bit(policy):
    ref, got = _model("none"), _model(policy)
    _assert_same_step(got, ref, _step(got), _step(ref))


@triton_interpreter
@pytest.mark.parametrize("policy", ("attn_res", "full"))
def test_triton_attn_res_sites_recompute_like_none(policy, monkeypatch):
    """The AttnRes sites on their Triton path (through the interpreter, each passing its sources on
    as on a GPU, the mlp sites adding their attention branch): recomputing the sites, or whole layers, gives
    none's step bit for bit."""
    def site(sources, query, gain, norm_weight, norm_eps, out_dtype, pass_through, residual=None):
        return attn_res_site(sources, query, gain, norm_weight, norm_eps, out_dtype, pass_through, backend="triton",
                             residual=residual)

    monkeypatch.setattr(attn_res_module, "attn_res_site", site)
    monkeypatch.setattr(triton_attn_res, "INTERPRET_BLOCKS", (64, 64))  # one program a micro-batch: quicker
    ref, got = _model("none"), _model(policy)
    _assert_same_step(got, ref, _step(got), _step(ref))


def test_full_matches_none_with_bf16_params_and_expert_qat():
    """bf16 parameters (MainParams) under bf16 autocast with MXFP4/MXFP8 expert QAT: the replay runs
    under the forward's autocast state and with the same fake-quant callables."""
    ref, got = (_model(p, qat=True, params=torch.bfloat16) for p in ("none", "full"))
    _assert_same_step(got, ref, _step(got, autocast=True), _step(ref, autocast=True))


# calls per micro-batch of the AttnRes op (2 sites x 9 layers + the output site), the KDA recurrence
# (6 KDA layers) and the router (8 MoE layers): forward, and again in the backward where recomputed
CALLS = {"none": (19, 6, 8), "attn_res": (38, 6, 8), "kda": (38, 12, 8), "full": (38, 12, 16)}


@pytest.mark.parametrize("policy", ("none", *POLICIES))
def test_recomputed_modules_run_again_as_replays(policy, monkeypatch):
    model = _model(policy)
    calls = {"attn_res": [0, 0], "kda": [0, 0], "router": [0, 0]}  # [all calls, replays]

    def counted(what, fn):
        def run(*args, **kwargs):
            calls[what][0] += 1
            calls[what][1] += replaying()
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(attn_res_module, "attn_res_site", counted("attn_res", attn_res_module.attn_res_site))
    mixer = kda_module.KimiDeltaAttention  # its kernel seam: the recurrence each KDA mixer calls
    monkeypatch.setattr(mixer, "kernel", staticmethod(counted("kda", mixer.kernel)))
    for layer in model.moe_layers():
        layer.gate.forward = counted("router", layer.gate.forward)
    _step(model, micro_batches=1)
    want = CALLS[policy]
    assert [calls[k][0] for k in ("attn_res", "kda", "router")] == list(want)
    assert [calls[k][1] for k in ("attn_res", "kda", "router")] == [w - n for w, n in zip(want, CALLS["none"])]
    assert not replaying()


def test_saved_activations_shrink_with_each_policy():
    """Bytes of the distinct tensors autograd saves outside the recomputed regions (a region keeps
    only references to its inputs): none > attn_res > kda > full."""
    saved = {}
    for policy in ("none", *POLICIES):
        model = _model(policy)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _step(model, micro_batches=1)
        saved[policy] = sum(seen.values())
    assert saved["none"] > saved["attn_res"] > saved["kda"] > saved["full"], saved


def test_trainer_runs_full_recompute_like_none(tmp_path):
    """``train.recompute=full`` through ``python -m k3train.train``: the same losses as ``none``."""
    steps = ("train.steps=2", "train.save_every=0", "train.log_every=1")
    train(tmp_path / "none", *steps)
    train(tmp_path / "full", *steps, "train.recompute=full")
    ref, got = losses(tmp_path / "none"), losses(tmp_path / "full")
    assert sorted(got) == [1, 2] and got == ref, (got, ref)

