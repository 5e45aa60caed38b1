"""The routed experts' grouped weight gradient: the Triton kernel against the per-expert reference (CPU:
Triton interpreter, fp32; GPU: the same tests on CUDA in bf16), the aten path against the reference, and
the grouped linear layer's gradients against autograd's through ``torch._grouped_mm``.

fp32 kernel results are compared to within 1e-5 of the largest |dW| (the interpreter's dot is a float32
matmul in another order); bf16 (GPU) to within 1e-2, an eighth of a bf16 ulp of 1 summed over the rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from k3train.model.moe import grouped_linear
from kernels.backend import triton_on_cpu
from kernels.grouped_wgrad import grouped_wgrad, grouped_wgrad_pair
from kernels.grouped_wgrad import reference as R

REPO = Path(__file__).resolve().parents[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
RTOL = 1e-2 if DEV == "cuda" else 1e-5
# rows per expert: empty experts, fewer rows than a row block, block multiples and ragged tails
COUNTS = [[7, 0, 33, 16, 21], [0, 0, 3], [64, 1, 0, 95], [300]]
WIDTHS = [(40, 24), (16, 96), (136, 72)]  # O, C: not multiples of the tiles


def _inputs(counts, o, c, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    m = int(offsets[-1])
    grad, x = torch.randn(m, o, generator=g), torch.randn(m, c, generator=g)
    return grad.to(device, dtype), x.to(device, dtype), offsets.to(device)


def _assert_near(got, want):
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= RTOL * scale, f"max err {err:.3g} > {RTOL:g}·{scale:.3g}"


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_aten_path_matches_reference(counts):
    g, x, offsets = _inputs(counts, 24, 16, seed=len(counts))
    want = R.grouped_wgrad(g, x, offsets)
    torch.testing.assert_close(grouped_wgrad(g, x, offsets, backend="torch"), want, rtol=1e-5, atol=1e-5)
    assert bool((want[torch.tensor(counts) == 0] == 0).all()), "an expert without rows gets a zero gradient"


@triton_cpu
@pytest.mark.parametrize("o,c", WIDTHS, ids=str)
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_triton_kernel_matches_reference(counts, o, c):
    g, x, offsets = _inputs(counts, o, c, seed=o + c + len(counts), dtype=DTYPE, device=DEV)
    want = R.grouped_wgrad(g.cpu().double(), x.cpu().double(), offsets.cpu())
    with triton_on_cpu():
        got = grouped_wgrad(g, x, offsets, backend="triton")
    assert got.dtype == DTYPE and got.is_contiguous()
    _assert_near(got, want)


@triton_cpu
@pytest.mark.parametrize("counts", COUNTS + [[5, 9, 5, 0, 9, 5, 1],
                                    torch.randint(0, 6, (41,), generator=torch.Generator().manual_seed(3)).tolist()],
                         ids=lambda c: str(c) if len(c) < 10 else f"{len(c)} experts")
def test_triton_experts_by_size_is_a_stable_descending_argsort(counts):
    from kernels.grouped_wgrad.triton_grouped_wgrad import experts_by_size

    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = experts_by_size(offsets.to(DEV))
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu().long(), torch.tensor(counts).argsort(descending=True, stable=True))


@triton_cpu
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_triton_pair_matches_reference(counts):
    """grouped_wgrad_pair: two products of different widths over the same groups, in one launch, each equal to the
    per-expert reference."""
    g1, x1, offsets = _inputs(counts, 40, 24, seed=11, dtype=DTYPE, device=DEV)
    g2, x2, _ = _inputs(counts, 136, 16, seed=12, dtype=DTYPE, device=DEV)
    with triton_on_cpu():
        got = grouped_wgrad_pair(g1, x1, g2, x2, offsets, backend="triton")
    for dw, g, x in zip(got, (g1, g2), (x1, x2)):
        assert dw.dtype == DTYPE and dw.is_contiguous()
        _assert_near(dw, R.grouped_wgrad(g.cpu().double(), x.cpu().double(), offsets.cpu()))
    with pytest.raises(ValueError, match="share rows"):
        grouped_wgrad_pair(g1, x1, g2[1:], x2[1:], offsets)


@triton_cpu
def test_triton_pair_custom_op_opcheck():
    g1, x1, offsets = _inputs([7, 0, 12], 16, 8, seed=4, dtype=DTYPE, device=DEV)
    g2, x2, _ = _inputs([7, 0, 12], 8, 24, seed=5, dtype=DTYPE, device=DEV)
    torch.library.opcheck(torch.ops.k3.grouped_wgrad_pair.default, (g1, x1, g2, x2, offsets))


@triton_cpu
def test_triton_refuses_weights_past_32_bit_offsets():
    g, x = torch.zeros(1, 1 << 16, dtype=DTYPE, device=DEV), torch.zeros(1, 1 << 15, dtype=DTYPE, device=DEV)
    with triton_on_cpu(), pytest.raises(ValueError, match="32-bit"):
        grouped_wgrad(g, x, torch.tensor([1], dtype=torch.int32, device=DEV), backend="triton")


@triton_cpu
def test_triton_custom_op_opcheck():
    g, x, offsets = _inputs([7, 0, 12], 16, 8, seed=4, dtype=DTYPE, device=DEV)
    torch.library.opcheck(torch.ops.k3.grouped_wgrad.default, (g, x, offsets))


@triton_cpu
@pytest.mark.parametrize("counts", [[7, 0, 33, 16, 21], [40]], ids=str)
def test_triton_grouped_linear_gradients_match_autograd(counts):
    """grouped_linear's forward and both gradients equal autograd's through a bare ``torch._grouped_mm``."""
    _, x, offsets = _inputs(counts, 8, 32, seed=5, dtype=DTYPE, device=DEV)
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(len(counts), 40, 32, generator=gen) * 0.1).to(DEV, DTYPE)
    gy = torch.randn(x.shape[0], 40, generator=gen).to(DEV, DTYPE)

    def run(fn):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xl, wl)
        y.backward(gy)
        return y, xl.grad, wl.grad

    want = run(lambda a, b: torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets))
    with triton_on_cpu():
        got = run(lambda a, b: grouped_linear(a, b, offsets))
    for name, t, ref in zip(("y", "dx", "dw"), got, want):
        assert t.shape == ref.shape, name
        _assert_near(t, ref)


@triton_cpu
def test_triton_compiled_grouped_linear_holds_the_op():
    """Under torch.compile (AOT autograd) the backward graph computes dW with ``k3::grouped_wgrad``, and the
    gradients equal the eager ones. In bf16: ``torch._grouped_mm``'s fake-tensor rule takes no other dtype."""
    from torch._dynamo.backends.common import aot_autograd

    _, x, offsets = _inputs([5, 0, 11], 8, 16, seed=8, dtype=torch.bfloat16, device=DEV)
    w = (torch.randn(3, 24, 16, generator=torch.Generator().manual_seed(9)) * 0.1).to(DEV, torch.bfloat16)
    targets = []

    def record(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes)
        return gm.forward

    def grads(fn):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        (fn(xl, wl, offsets) ** 2).sum().backward()
        return xl.grad, wl.grad

    with triton_on_cpu():
        want = grads(grouped_linear)
        torch._dynamo.reset()
        got = grads(torch.compile(grouped_linear, fullgraph=True,
                                  backend=aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=record)))
    assert torch.ops.k3.grouped_wgrad.default in targets, targets
    for t, ref in zip(got, want):
        _assert_near(t, ref)


def test_errors():
    g, x, offsets = _inputs([3, 4], 8, 8, seed=7)
    with pytest.raises(ValueError, match="same M"):
        grouped_wgrad(g, x[1:], offsets)
    with pytest.raises(ValueError, match="int32"):
        grouped_wgrad(g, x, offsets.long())
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_wgrad(g, x.double(), offsets)
    with pytest.raises(ValueError, match="16 bytes"):
        grouped_wgrad(g[:, :6], x, offsets)
    with pytest.raises(ValueError, match="backend"):
        grouped_wgrad(g, x, offsets, backend="cuda")


_SHARED_MEMORY_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.grouped_wgrad import triton_grouped_wgrad as m

BM, BN, BK, warps, stages = m.GPU_TILES
G, X = f"tensordesc<bf16[{BK}, {BM}]>", f"tensordesc<bf16[{BK}, {BN}]>"
one = dict(G=G, X=X, DW="*bf16", OFFSETS="*i32", ORDER="*i32", O="i32", C="i32")
pair = dict(G1=G, X1=X, DW1="*bf16", O1="i32", C1="i32", G2=G, X2=X, DW2="*bf16", O2="i32", C2="i32",
            OFFSETS="*i32", ORDER="*i32", FIRST="i32")
for kernel, signature in ((m._grouped_wgrad_kernel, one), (m._grouped_wgrad_pair_kernel, pair)):
    signature.update(BM="constexpr", BN="constexpr", BK="constexpr")
    src = ASTSource(kernel, signature, constexprs=dict(BM=BM, BN=BN, BK=BK))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    print(kernel.fn.__name__, compiled.metadata.shared)
"""


def test_gpu_tiles_fit_hopper_shared_memory():
    """Both kernels compiled for sm_90 at ``GPU_TILES`` (no GPU needed: Triton's own ptxas) ask for no more
    shared memory than an H100/H200 block may have, 227 KiB. The interpreter does not model shared memory, so a
    pair kernel whose two branches each kept their own pipeline buffers (288 KiB) passed every CPU test and
    failed at launch on the GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _SHARED_MEMORY_CHECK], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    shared = {name: int(n) for name, n in (line.split() for line in r.stdout.split("\n") if line)}
    assert set(shared) == {"_grouped_wgrad_kernel", "_grouped_wgrad_pair_kernel"}, r.stdout
    assert max(shared.values()) <= 227 * 1024, shared
    # one pipeline's buffers: the pair kernel shares them between its two products
    assert shared["_grouped_wgrad_pair_kernel"] == shared["_grouped_wgrad_kernel"], shared


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)
