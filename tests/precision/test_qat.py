"""MX fake quant for QAT: straight-through gradients, QATLinear, the routed-experts-only switch,
and a short QAT training run of k3_tiny against full precision."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.mx import mx_fake_quantize
from k3train.precision.mx_qat import (MXFakeQuant, QATLinear, disable_expert_qat,
                                      enable_expert_qat, mx_fake_quant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_fake_quant_forward_and_straight_through(fmt, dtype):
    x = (torch.randn(6, 96) * 3).to(dtype).requires_grad_()
    y = mx_fake_quant(x, fmt, "rceil")
    assert y.dtype == dtype and torch.equal(y, mx_fake_quantize(x.detach(), fmt, "rceil"))
    assert not torch.equal(y, x)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)  # straight-through: the gradient passes unchanged


def test_fake_quant_empty_and_errors():
    x = torch.empty(0, 64, requires_grad=True)
    assert mx_fake_quant(x).shape == (0, 64)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mx_fake_quant(torch.randn(3, 40))
    with pytest.raises(ValueError, match="unknown MX element format"):
        MXFakeQuant("int4")


def test_qat_linear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    q = QATLinear.from_linear(lin)
    assert "e2m1" in repr(q)
    x = torch.randn(5, 7, 64, requires_grad=True)
    y = q(x)
    xq = mx_fake_quantize(x.detach(), "e4m3", "rceil")
    wq = mx_fake_quantize(lin.weight.detach(), "e2m1", "rceil")
    assert torch.allclose(y, F.linear(xq, wq, lin.bias), rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    # STE: the gradients are the ones of the linear evaluated at the quantized operands
    assert torch.allclose(x.grad, g @ wq, rtol=1e-5, atol=1e-6)
    assert torch.allclose(q.weight.grad, g.reshape(-1, 48).t() @ xq.reshape(-1, 64),
                          rtol=1e-5, atol=1e-5)
    assert q.bias.grad is not None
    with pytest.raises(ValueError, match="multiple of the MX block size"):
        QATLinear(40, 8)


def _tiny_model(seed=0):
    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model
    torch.manual_seed(seed)
    return K3Model(ModelConfig())


def test_enable_expert_qat_touches_routed_experts_only():
    from k3train.model.moe import RoutedExperts
    model = _tiny_model()
    keys = list(model.state_dict())
    mods = [type(m) for m in model.modules()]
    n = enable_expert_qat(model)
    assert n == sum(isinstance(m, RoutedExperts) for m in model.modules()) == 8
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            assert m.weight_fake_quant.fmt == "e2m1" and m.input_fake_quant.fmt == "e4m3"
        else:
            assert getattr(m, "weight_fake_quant", None) is None
            assert getattr(m, "input_fake_quant", None) is None
    assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == mods
    assert disable_expert_qat(model) == 8
    assert all(m.weight_fake_quant is None for m in model.modules() if isinstance(m, RoutedExperts))


def test_expert_gemms_see_quantized_operands():
    """The grouped experts with QAT equal a hand-written MX forward (one GEMM per expert)."""
    from k3train.model.mlp import situ_glu
    from k3train.model.moe import RoutedExperts
    model = _tiny_model(1)
    ex = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    torch.manual_seed(2)
    rows = torch.randn(12, ex.w13.shape[-1])  # already grouped: 5 rows of expert 0, 7 of expert 3
    tokens_per_expert = torch.zeros(ex.num_experts, dtype=torch.long)
    tokens_per_expert[0], tokens_per_expert[3] = 5, 7
    full = ex(rows, tokens_per_expert)
    enable_expert_qat(model)
    got = ex(rows, tokens_per_expert)
    disable_expert_qat(model)
    fq = lambda t, f: mx_fake_quantize(t, f, "rceil")  # noqa: E731
    want = []
    for e, part in ((0, rows[:5]), (3, rows[5:])):  # quantize each GEMM's input (e4m3) and weight (e2m1)
        gate_up = fq(part, "e4m3") @ fq(ex.w13[e], "e2m1").t()  # columns gate_0, up_0, gate_1, ...
        want.append(fq(situ_glu(gate_up[:, 0::2], gate_up[:, 1::2]), "e4m3") @ fq(ex.w2[e], "e2m1").t())
    want = torch.cat(want)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    assert not torch.allclose(got, full, rtol=1e-3, atol=1e-6)


def markov_batches(n_batches, batch, seq, vocab, seed, active=32, fanout=2):
    """Tokens from a fixed sparse Markov chain over ``active`` of the ``vocab`` ids, each with
    ``fanout`` equally likely successors: learnable fast (unigram: ln(vocab) -> ln(active)),
    then slower (bigram: -> ln(fanout))."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:active]
    nxt = ids[torch.randint(0, active, (vocab, fanout), generator=g)]
    out = []
    for _ in range(n_batches):
        t = torch.empty(batch, seq + 1, dtype=torch.long)
        t[:, 0] = ids[torch.randint(0, active, (batch,), generator=g)]
        for i in range(seq):
            t[:, i + 1] = nxt[t[:, i], torch.randint(0, fanout, (batch,), generator=g)]
        out.append(t)
    return out


def train_tiny(model, batches, eval_batch, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for b in batches:
        loss = model(b[:, :-1], labels=b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        ev = model(eval_batch[:, :-1], labels=eval_batch[:, 1:]).item()
    return losses, ev


def qat_gap(steps: int, batch: int = 4, seq: int = 16, seed: int = 0, lr: float = 3e-3):
    """Train the same k3_tiny init twice (fp32, then routed-expert QAT) on the same data."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only oversubscribe a busy 2-core CI box
    try:
        return _qat_gap(steps, batch, seq, seed, lr)
    finally:
        torch.set_num_threads(threads)


def _qat_gap(steps, batch, seq, seed, lr):
    base = _tiny_model(seed)
    data = markov_batches(steps + 1, batch, seq, base.cfg.vocab_size, seed=seed + 1)
    fp = copy.deepcopy(base)
    qat = copy.deepcopy(base)
    assert enable_expert_qat(qat) > 0
    with torch.no_grad():
        init = base(data[-1][:, :-1], labels=data[-1][:, 1:]).item()
    torch.manual_seed(seed + 2)
    l_fp, ev_fp = train_tiny(fp, data[:-1], data[-1], lr)
    torch.manual_seed(seed + 2)
    l_q, ev_q = train_tiny(qat, data[:-1], data[-1], lr)
    return init, l_fp, ev_fp, l_q, ev_q


def test_k3_tiny_qat_training_gap():
    steps = 12
    init, l_fp, ev_fp, l_q, ev_q = qat_gap(steps)
    print(f"\nk3_tiny {steps} steps: init {init:.4f}  fp32 eval {ev_fp:.4f}  QAT eval {ev_q:.4f}  "
          f"gap {ev_q - ev_fp:+.4f}")
    assert all(map(lambda v: v == v, l_q)), "QAT loss went NaN"
    assert ev_fp < init - 1.0 and ev_q < init - 1.0, (init, ev_fp, ev_q)  # both learn
    assert abs(ev_q - ev_fp) < 0.02 * ev_fp, (ev_fp, ev_q)  # and QAT stays close


if __name__ == "__main__":  # longer run for the report: python tests/precision/test_qat.py 200
    import sys
    import time
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    lr = float(sys.argv[3]) if len(sys.argv) > 3 else 3e-3
    for seed in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
        t0 = time.time()
        init, l_fp, ev_fp, l_q, ev_q = qat_gap(steps, seed=seed, lr=lr)
        print(f"seed {seed} steps {steps}: init {init:.4f} | last-10 train fp32 "
              f"{sum(l_fp[-10:]) / 10:.4f} QAT {sum(l_q[-10:]) / 10:.4f} | eval fp32 {ev_fp:.4f} "
              f"QAT {ev_q:.4f} gap {ev_q - ev_fp:+.4f} ({(ev_q - ev_fp) / ev_fp:+.2%}) "
              f"[{time.time() - t0:.0f}s]", flush=True)
