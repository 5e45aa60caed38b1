"""The routed experts with the gather and SiTU fused into the grouped GEMMs (kernels/moe_experts) against the
plain per-expert reference: output and the gradients of z, W13 and W2, with an expert that gets no rows and
experts whose rows span several row tiles (CPU: Triton interpreter, fp32 dots; GPU: bf16 at bench-1B dims)."""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from kernels.moe_experts import reference as R
from kernels.moe_experts import routed_experts_fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BETAS = (4.0, 25.0)


def _case(N, E, k, ell, I, dtype, seed, empty_expert=True):
    g = torch.Generator().manual_seed(seed)
    choice = E - 1 if empty_expert else E  # the last expert gets no rows
    experts = torch.rand(N, choice, generator=g).argsort(dim=1)[:, :k]
    order = experts.flatten().argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    offsets = torch.bincount(experts.flatten(), minlength=E).cumsum(0).to(torch.int32)
    z = torch.randn(N, ell, generator=g)
    w13 = torch.randn(E, 2 * I, ell, generator=g) / ell ** 0.5
    w2 = torch.randn(E, ell, I, generator=g) / I ** 0.5
    dy = torch.randn(N * k, ell, generator=g)
    leaves = [t.to(DEV, dtype).requires_grad_() for t in (z, w13, w2)]
    return leaves, order.to(DEV), inverse.to(DEV), offsets.to(DEV), dy.to(DEV, dtype)


def _run(fn, leaves, dy):
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


@triton_cpu
@pytest.mark.parametrize("N,E,k,I", [(24, 4, 2, 16), (40, 4, 3, 32)])
def test_fused_equals_reference(N, E, k, I):
    leaves, order, inverse, offsets, dy = _case(N, E, k, ell=32, I=I, dtype=torch.float32, seed=N)
    got = _run(lambda z, a, b: routed_experts_fused(z, order, inverse, k, offsets, a, b, *BETAS), leaves, dy)
    want = _run(lambda z, a, b: R.routed_experts(z, order, k, offsets, a, b, *BETAS), leaves, dy)
    for name, x, ref in zip(("y", "dz", "dw13", "dw2"), got, want):
        err = float((x - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (name, err)
    assert got[2][-1].abs().sum() == 0 and got[3][-1].abs().sum() == 0  # the empty expert gets no gradient


@triton_cpu
def test_tiles_must_stay_within_one_expert():
    """The weights come through tensor descriptors: ℓ must split into whole BK-wide tiles (here 40 by 16 in the
    interpreter), else a tile would read into the next expert's weights; the error says so."""
    leaves, order, inverse, offsets, dy = _case(8, 2, 1, ell=40, I=16, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="multiple of BK"):
        routed_experts_fused(leaves[0], order, inverse, 1, offsets, leaves[1], leaves[2], *BETAS)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 tensor-core dots at bench-1B dims: GPU only")
def test_fused_bf16_bench_dims_close_to_reference():
    leaves, order, inverse, offsets, dy = _case(4096, 128, 8, ell=512, I=256, dtype=torch.bfloat16, seed=1,
                                                empty_expert=False)
    got = _run(lambda z, a, b: routed_experts_fused(z, order, inverse, 8, offsets, a, b, *BETAS), leaves, dy)
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    want = _run(lambda z, a, b: R.routed_experts(z, order, 8, offsets, a, b, *BETAS), f32, dy.float())
    for name, x, ref in zip(("y", "dz", "dw13", "dw2"), got, want):
        err = float((x.float() - ref).norm() / ref.norm())
        assert err < 2e-2, (name, err)  # bf16 operands and stores against an fp32 reference


def test_errors():
    z, w13, w2 = torch.zeros(4, 32), torch.zeros(2, 32, 32), torch.zeros(2, 32, 16)
    order = torch.arange(8)
    with pytest.raises(ValueError, match="dtype"):
        routed_experts_fused(z, order, order, 2, torch.tensor([4, 8]), w13.double(), w2, *BETAS)
    with pytest.raises(ValueError, match="w13"):
        routed_experts_fused(z, order, order, 2, torch.tensor([4, 8]), w13[:, :30], w2, *BETAS)
    with pytest.raises(ValueError, match="order"):
        routed_experts_fused(z, order[:6], order, 2, torch.tensor([4, 8]), w13, w2, *BETAS)


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)
