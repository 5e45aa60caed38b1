"""Mixed precision with bf16 model weights and fp32 main weights (``precision.params=bf16``):
``MainParams`` and ``GradBuffers`` on k3_tiny (CPU) and k3_tiny_kernel (``-m gpu``).

- a few AdamW steps track fp32 parameters, in fp32 or under bf16 autocast (loss within 1%, and not equal);
- the main weights after two steps (two micro-batches each, then QK-clip) equal, bit for bit, what the
  fp32 optimizer makes of an fp32 copy of the weights given the same bf16-computed gradients summed in
  fp32, and the model's weights are those main weights rounded to bf16;
- under MXFP4 QAT the experts' compute copies are the fake-quantized main weights;
- a main gradient holds only its step's gradients (the first one is copied in, a parameter without
  one is zeroed by ``reduce``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from k3train.config.schema import ModelConfig, OptimConfig
from k3train.model.k3 import K3Model
from k3train.model.roles import get_role
from k3train.optim.builder import build_optimizer
from k3train.optim.qk_clip import apply_qk_clip, find_mla_modules
from k3train.parallel.grad_buffers import GradBuffers
from k3train.precision.main_params import MainParams, main_param

REPO = Path(__file__).resolve().parents[2]
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
SEQ, MICRO = 32, 2


def _model(device: str, seed: int = 0) -> K3Model:
    """k3_tiny on CPU; on CUDA k3_tiny_kernel (K3 head dims, which the Triton KDA kernel takes)."""
    cfg = ModelConfig() if device == "cpu" else ModelConfig(
        **yaml.safe_load((REPO / "conf" / "model" / "k3_tiny_kernel.yaml").read_text()))
    torch.manual_seed(seed)
    model = K3Model(cfg, linear_backend="torch").to(device)
    for m in model.modules():  # non-zero pseudo-queries, so that AttnRes weights get gradients
        if type(m).__name__ == "AttnResAggregator":
            with torch.no_grad():
                m.proj.normal_(0, 0.5)
    return model


def _batches(model: K3Model, device: str, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, model.cfg.vocab_size, (2, SEQ + 1), generator=g).to(device) for _ in range(n)]
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def _train(device: str, params: torch.dtype, steps: int, autocast: bool) -> tuple[list[float], K3Model]:
    model = _model(device)
    main = MainParams(model, params)
    grads = GradBuffers(model, None)
    opt = build_optimizer(model, OptimConfig(lr=3e-3))
    losses = []
    for tokens, labels in _batches(model, device, steps):
        grads.zero()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels=labels)
        loss.backward()
        grads.reduce()
        grads.clip(1.0, grads.norm())
        opt.step()
        main.sync_model()
        losses.append(float(loss.detach()))
    return losses, model


@pytest.mark.parametrize("device,ref_autocast", [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=GPU)])
def test_bf16_params_track_fp32_params(device, ref_autocast):
    """Against fp32 parameters, in fp32 or under bf16 autocast (then the GEMMs see the same bf16 weights
    and only ops that read weights in fp32, as norms do, differ). Measured on CPU: the losses of 4 steps
    agree to 6e-4 (fp32) and 1.3e-3 (autocast) relative; held to 1e-2."""
    ref, _ = _train(device, torch.float32, 4, autocast=ref_autocast)
    got, model = _train(device, torch.bfloat16, 4, autocast=True)
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-2 * abs(b), (got, ref)
    assert got != ref  # the bf16 path really ran in bf16
    for name, p in model.named_parameters():
        keep = get_role(p).keep_fp32
        assert p.dtype == (torch.float32 if keep else torch.bfloat16), name
        assert main_param(p).dtype == torch.float32 and main_param(p) is not p, name
    assert any(get_role(p).keep_fp32 for p in model.parameters())  # KDA's A_log, dt_bias, conv, o_norm


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("device", DEVICES)
def test_main_weights_are_the_fp32_optimizer_on_bf16_gradients(device, optim):
    model, ref = _model(device), _model(device)  # the same fp32 initial weights
    captured: dict[int, list[torch.Tensor]] = {id(p): [] for p in model.parameters()}
    for p in model.parameters():  # runs before GradBuffers' hook: sees the bf16 gradient of each backward
        p.register_post_accumulate_grad_hook(lambda p: captured[id(p)].append(p.grad.clone()))
    main = MainParams(model, torch.bfloat16)
    grads = GradBuffers(model, None)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(main_param(p), r)  # main weights start at the fp32 initial values
    cfg = OptimConfig(name=optim, lr=1e-2, weight_decay=0.1)
    opt, ref_opt = build_optimizer(model, cfg), build_optimizer(ref, cfg)
    mla = [m for _, m in find_mla_modules(model)]
    ref_mla = [m for _, m in find_mla_modules(ref)]
    batches = _batches(model, device, 2 * MICRO)
    for step in range(2):
        grads.zero()
        for c in captured.values():
            c.clear()
        for tokens, labels in batches[step * MICRO:(step + 1) * MICRO]:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(tokens, labels=labels)
            (loss / MICRO).backward()
        grads.reduce()
        opt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            assert captured[id(p)] and captured[id(p)][0].dtype == p.dtype
            r.grad = torch.zeros_like(r)
            for g in captured[id(p)]:  # the micro-batches' gradients, summed in fp32 in their order
                r.grad.add_(g)
            assert torch.equal(main_param(p).grad, r.grad)
        ref_opt.step()
        for m, rm in zip(mla, ref_mla):  # QK-clip acts on the main weights: head 0 clipped, head 1 not
            for module in (m, rm):
                module.max_logit.copy_(torch.tensor([3.0, 0.5], device=device))
        report = apply_qk_clip(model, tau=1.0)
        apply_qk_clip(ref, tau=1.0)
        assert report["num_clipped_heads"] == len(mla)
        main.sync_model()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(main_param(p), r), (step, name)
            assert torch.equal(p, r.to(p.dtype)), (step, name)
    assert any(not torch.equal(r, r.bfloat16().float()) for r in ref.parameters())  # fp32 weights are not bf16


def test_qat_compute_copies_are_fake_quantized_main_weights():
    from k3train.precision.mx_qat import enable_expert_qat, mx_fake_quant, qat_roundings

    model = _model("cpu")
    enable_expert_qat(model)
    rounding = qat_roundings(model)
    assert len(rounding) == 2 * len(model.moe_layers())
    MainParams(model, torch.bfloat16, rounding)
    for w, quantize in rounding:
        main = main_param(w)
        assert w.dtype == torch.bfloat16 and torch.equal(w.float(), mx_fake_quant(main))
        assert torch.equal(quantize(w), w)  # the forward's fake quant leaves them as they are
        assert not torch.equal(w.float(), main.bfloat16().float())


def test_main_gradient_holds_only_this_steps_gradients():
    """bf16 parameters: a step's first gradient is copied into the main gradient, not added to the last
    step's, and a parameter no backward reached this step has a zero main gradient after ``reduce``."""
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(32, 16, bias=False), "b": torch.nn.Linear(16, 8, bias=False)})
    seen: dict[str, torch.Tensor] = {}
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.__setitem__(name, p.grad.float()))
    MainParams(net, torch.bfloat16)
    grads = GradBuffers(net, None)
    for use_b in (True, False):
        grads.zero()
        y = net["a"](torch.randn(5, 32).bfloat16())
        (net["b"](y) if use_b else y).float().square().sum().backward()
        grads.reduce()
        assert torch.equal(main_param(net["a"].weight).grad, seen["a.weight"])
    assert seen["b.weight"].abs().sum() > 0 and torch.equal(main_param(net["b"].weight).grad, torch.zeros(8, 16))


def test_gradient_norm_is_fp32_accurate_on_a_long_buffer():
    """‖g‖ of a 1M-element buffer within 1e-6 of float64 (CPU vector_norm of one long vector is ~1e-4 off,
    which moved the norm of a pipeline run, whose stages split the buffers, 1e-5 from one rank's)."""
    net = torch.nn.Linear(1000, 1001)
    grads = GradBuffers(net, None)
    grads.zero()
    net(torch.randn(4, 1000)).square().sum().backward()
    grads.reduce()
    want = torch.cat([p.grad.double().reshape(-1) for p in net.parameters()]).norm()
    assert abs(grads.norm().double() - want) <= 1e-6 * want
