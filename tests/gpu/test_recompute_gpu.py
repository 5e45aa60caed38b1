"""Activation recompute on CUDA: k3_tiny_kernel, bf16 parameters under bf16 autocast, through the Triton
KDA, AttnRes, SiTU and MoE-permute kernels (their autograd Functions run forward again in the replay).
Run with ``pytest -m gpu``.

Against ``none``: the loss and the expert load are the same (the forwards run the same kernels on the
same inputs); gradients within 1e-2 relative per parameter (the backward kernels may sum in another
order); ``full`` peaks lower than ``none``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from k3train.precision.main_params import MainParams
from k3train.training.recompute import apply_recompute

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(policy: str):
    cfg = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / "k3_tiny_kernel.yaml").read_text()))
    torch.manual_seed(0)
    model = K3Model(cfg, linear_backend="torch").cuda()
    MainParams(model, torch.bfloat16)
    apply_recompute(model, policy)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (4, 1025), generator=g).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), model, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("policy", ("attn_res", "kda", "full"))
def test_policy_matches_none_on_gpu(policy):
    ref_loss, ref, ref_peak = _run("none")
    loss, got, peak = _run(policy)
    print(f"{policy}: peak {peak / 2**20:.1f} MiB vs none {ref_peak / 2**20:.1f} MiB")
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    for a, b in zip(got.moe_layers(), ref.moe_layers()):
        assert torch.equal(a.load.tokens, b.load.tokens)
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        err = (p.grad.float() - q.grad.float()).norm()
        assert err <= 1e-2 * q.grad.float().norm() + 1e-6, (name, float(err), float(q.grad.float().norm()))
    if policy == "full":
        assert peak < ref_peak, (peak, ref_peak)
