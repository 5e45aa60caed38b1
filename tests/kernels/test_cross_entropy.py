"""Fused cross-entropy over vocabulary-sharded logits: the reference against torch's
F.cross_entropy, the Triton kernels against the reference (CPU: Triton interpreter; GPU: the same
tests on CUDA), and the vocabulary-parallel combine over 2 gloo ranks against one-rank
F.cross_entropy on the full logits.

Loss and dz are compared with float64 on the same (fp32 or bf16-valued) logits: fp32 results to
within ``RTOL``, bf16 dz additionally within the store's rounding (GPU: half an ulp, 2⁻⁸ relative;
the interpreter truncates, 2⁻⁷).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multiprocess import run_ranks
from triton_cpu import interpreter_active, rerun_under_interpreter, triton_cpu

from kernels.cross_entropy import cross_entropy
from kernels.cross_entropy import reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 2e-5
BF16_ROUND = 2.0**-8 if DEV == "cuda" else 2.0**-7


def random_problem(N: int, V: int, seed: int, shards: int = 1):
    """float64 logits [N, V] (scale 3, a few rows shifted by ±50), labels [N] with every one of
    ``shards`` equal vocabulary slices owning some, and a loss gradient g [N]."""
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(N, V, generator=g, dtype=torch.float64)
    z[::3] += 50 * torch.randn(len(z[::3]), 1, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:shards] = torch.arange(shards) * (V // shards) + V // shards - 1  # the last id of each slice
    assert set((labels // (V // shards)).tolist()) == set(range(shards))
    go = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    return z, labels, go


def torch_loss_and_grad(z: torch.Tensor, labels: torch.Tensor, go: torch.Tensor):
    zl = z.clone().requires_grad_()
    loss = F.cross_entropy(zl, labels, reduction="none")
    loss.backward(go)
    return loss.detach(), zl.grad


def _assert_close(got, want, what, dtype=torch.float32):
    got, want = got.detach().cpu().double(), want.cpu().double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = RTOL * want.abs().max() + (BF16_ROUND * want.abs() if dtype == torch.bfloat16 else 0.0)
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} off, max err {float((got - want).abs().max()):.3g}"


# ----------------------------------------------------------------------------------------------
# reference and torch backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 3])
def test_reference_shards_combine_to_torch(shards):
    """local_stats / local_grad on each of ``shards`` slices, combined as the caller does."""
    z, labels, go = random_problem(9, 600, seed=shards, shards=shards)
    want_loss, want_dz = torch_loss_and_grad(z, labels, go)
    vl = z.shape[1] // shards
    stats = [R.local_stats(z[:, r * vl:(r + 1) * vl], labels, r * vl) for r in range(shards)]
    m = torch.stack([st[0] for st in stats]).max(0).values
    s = sum(st[1] * torch.exp(st[0] - m) for st in stats)
    zy = sum(st[2] for st in stats)
    lse = m + torch.log(s)
    _assert_close(lse - zy, want_loss, "loss")
    dz = torch.cat([R.local_grad(z[:, r * vl:(r + 1) * vl], labels, lse, go, r * vl) for r in range(shards)], 1)
    _assert_close(dz, want_dz, "dz")


def test_torch_backend_equals_f_cross_entropy():
    z, labels, go = random_problem(7, 1000, seed=5)
    want_loss, want_dz = torch_loss_and_grad(z, labels, go)
    zl = z.view(1, 7, 1000).clone().requires_grad_()
    loss = cross_entropy(zl, labels.view(1, 7), backend="torch")
    assert loss.shape == (1, 7)
    loss.backward(go.view(1, 7))
    _assert_close(loss.view(-1), want_loss, "loss")
    _assert_close(zl.grad.view(7, 1000), want_dz, "dz")


def test_errors():
    z = torch.randn(4, 10)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(z, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="backend"):
        cross_entropy(z, torch.zeros(4, dtype=torch.long), backend="cuda")


# ----------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU)
# ----------------------------------------------------------------------------------------------

@triton_cpu
@pytest.mark.parametrize("N, V, dtype, shards", [(7, 1000, torch.float32, 1), (9, 1000, torch.bfloat16, 1),
                                                 (5, 384, torch.bfloat16, 3)])
def test_triton_kernels(N, V, dtype, shards):
    """V = 1000 is 7.8 interpreter blocks of 128; with 3 shards each slice of 128 is one block.
    Each shard's kernel loss part and dz against the reference on the same values."""
    from kernels.cross_entropy.triton_cross_entropy import ce_stats
    z, labels, go = random_problem(N, V, seed=N + V, shards=shards)
    z = z.to(dtype).double()  # the values the kernel sees
    vl = V // shards
    for r in range(shards):
        zr = z[:, r * vl:(r + 1) * vl]
        m, s, zy = R.local_stats(zr, labels, r * vl)
        km, ks, kzy = (t.cpu() for t in ce_stats(zr.to(dtype).to(DEV), labels.to(DEV), r * vl))
        _assert_close(km, m, "m")
        _assert_close(ks, s, "s")
        _assert_close(kzy, zy, "zy")
        assert bool((zy != 0).any()), "this shard owns no label"
    want_loss, want_dz = torch_loss_and_grad(z, labels, go)
    zl = z.to(dtype).to(DEV).requires_grad_()
    loss = cross_entropy(zl, labels.to(DEV), backend="triton")
    assert "_CrossEntropy" in str(loss.grad_fn.next_functions) and loss.dtype == torch.float32
    loss.backward(go.float().to(DEV))
    assert zl.grad.dtype == dtype
    _assert_close(loss, want_loss, "loss")
    _assert_close(zl.grad, want_dz, "dz", dtype)


@triton_cpu
def test_grad_into_logits_writes_dz_over_them_with_the_same_gradients():
    """``grad_into_logits``: a linear head's input and weight gradients are the same as with a fresh dz
    (bit for bit), and afterwards the logits' storage holds dz: no second [N, V] tensor was made."""
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1)).to(DEV)
    w = torch.randn(300, 16, generator=torch.Generator().manual_seed(2)).to(DEV)
    labels = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(3)).to(DEV)
    results = []
    for in_place in (False, True):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        logits = xl @ wl.T
        cross_entropy(logits, labels, backend="triton", grad_into_logits=in_place).sum().backward()
        results.append((xl.grad, wl.grad, logits.detach()))
    (dx, dw, logits), (dx_in_place, dw_in_place, overwritten) = results
    assert torch.equal(dx, dx_in_place) and torch.equal(dw, dw_in_place)
    dz = torch.softmax(logits.double(), -1) - F.one_hot(labels, 300).double()
    assert not torch.equal(overwritten, logits)
    _assert_close(overwritten, dz, "dz over the logits")


def _two_rank_check(rank: int, world: int) -> None:
    z, labels, go = random_problem(11, 1000, seed=7, shards=world)
    z = z.float().double()
    want_loss, want_dz = torch_loss_and_grad(z, labels, go)
    vl = z.shape[1] // world
    for backend in ("torch", "triton") if interpreter_active() else ("torch",):  # CPU (gloo) tensors
        zl = z[:, rank * vl:(rank + 1) * vl].float().clone().requires_grad_()
        loss = cross_entropy(zl, labels, group=torch.distributed.group.WORLD, vocab_start=rank * vl,
                             backend=backend)
        loss.backward(go.float())
        _assert_close(loss, want_loss, f"{backend} rank {rank} loss")
        _assert_close(zl.grad, want_dz[:, rank * vl:(rank + 1) * vl], f"{backend} rank {rank} dz")


def test_vocab_parallel_two_ranks():
    """Each of 2 gloo (CPU) ranks holds half the vocabulary (labels in both halves): the local
    kernels (reference, and Triton under the interpreter when it is on) and the three all-reduces
    give F.cross_entropy's loss and the rank's slice of dz. One spawn for both (CI time)."""
    run_ranks(2, _two_rank_check)


def test_triton_cpu_subprocess():
    """Run the Triton tests above under the interpreter when this process cannot."""
    rerun_under_interpreter(__file__)
