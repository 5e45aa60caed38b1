"""The fused passes around Newton–Schulz (kernels/newton_schulz/muon_passes.py): the Triton kernels
(CPU: Triton's interpreter, switched on by tests/conftest.py) equal the torch path, and K3Muon takes
the same steps with either."""

import os

import pytest
import torch

from k3train.config.schema import OptimConfig
from k3train.optim.muon import build_muon
from kernels.newton_schulz.muon_passes import apply_update, nesterov_into
from standins import StandInModel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
triton_here = pytest.mark.skipif(
    DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1")

# (nb, R, C), stack holds the blocks transposed, grad dtype, stack dtype, nesterov
CASES = [((3, 70, 130), True, torch.float32, torch.bfloat16, True),
         ((2, 64, 200), False, torch.bfloat16, torch.float32, True),
         ((1, 5, 300), True, torch.float32, torch.float32, False)]
if DEV == "cuda":  # bench-1B's expert w2 (transposed into the stack) and KDA q heads: too slow for the interpreter
    CASES += [((128, 512, 256), True, torch.float32, torch.bfloat16, True),
              ((8, 128, 1024), False, torch.float32, torch.bfloat16, True)]


def _pair(shape, transposed, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nb, r, c = shape
    stack = torch.randn((nb, c, r) if transposed else shape, generator=g).to(device=DEV, dtype=dtype)
    view = stack.mT if transposed else stack
    return stack, view


@triton_here
@pytest.mark.parametrize("shape, transposed, gdt, sdt, nesterov", CASES)
def test_triton_passes_equal_torch(shape, transposed, gdt, sdt, nesterov):
    g = torch.Generator().manual_seed(1)
    grad = (torch.randn(shape, generator=g) * 1e-2).to(device=DEV, dtype=gdt)
    buf = torch.randn(shape, generator=g).to(DEV)
    bufs, outs = [buf.clone(), buf.clone()], [_pair(shape, transposed, sdt, 2)[1] for _ in range(2)]
    for b, o, backend in zip(bufs, outs, ("triton", "torch")):
        nesterov_into(grad, b, o, 0.95, nesterov, backend=backend)
    torch.testing.assert_close(bufs[0], bufs[1], rtol=1e-6, atol=1e-7)
    assert not torch.equal(bufs[0], buf)  # the momentum moved
    # bf16 stores: round-to-nearest on GPU, truncation in the interpreter (one bf16 ulp)
    tol = dict(rtol=2 ** -7, atol=1e-6) if sdt == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **tol)
    want = torch.lerp(grad.float(), bufs[1], 0.95) if nesterov else bufs[1]
    torch.testing.assert_close(outs[1].float(), want, **tol)

    upd = _pair(shape, transposed, sdt, 3)[1]
    p = torch.randn(shape, generator=g).to(DEV)
    ps, sums = [p.clone(), p.clone()], [torch.zeros((), device=DEV) for _ in range(2)]
    for q, s, backend in zip(ps, sums, ("triton", "torch")):
        apply_update(q, upd, 0.99, -0.1, s, backend=backend)
    torch.testing.assert_close(ps[0], ps[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ps[1], 0.99 * p - 0.1 * upd.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sums[0], upd.double().square().sum().float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-5, atol=0)


@triton_here
def test_k3muon_steps_equal_with_triton_and_torch_passes():
    """Per-head, whole, expert and tall (transposed into the stack) blocks, two steps, wd on."""
    models = [StandInModel(seed=6).to(DEV) for _ in range(2)]
    opts = [build_muon(m.named_parameters(), OptimConfig(lr=0.02, weight_decay=0.1), elementwise_backend=be)
            for m, be in zip(models, ("triton", "torch"))]
    for s in (1, 2):
        for m, o in zip(models, opts):
            m.set_grads(s)
            o.step()
    # CUDA: the NS stack is bf16, where an ulp of difference in fp32 can flip a rounding
    tol = 1e-5 if DEV == "cpu" else 1e-4
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol / 10, msg=n)
    for p in models[0].parameters():
        if "momentum_buffer" in opts[0].state[p]:
            q = dict(zip(models[0].parameters(), models[1].parameters()))[p]
            torch.testing.assert_close(opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"])
    r0, r1 = (float(o.last_step_info["update_rms"]) for o in opts)
    assert abs(r0 - r1) < tol * r1 and 0.1 < r0 < 0.3, (r0, r1)


@triton_here
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_apply_update_takes_device_scalars(backend):
    """beta and alpha as 0-d fp32 tensors (a captured step's learning rate) give the numbers' result."""
    g = torch.Generator().manual_seed(4)
    p = torch.randn(2, 40, 70, generator=g).to(DEV)
    upd = _pair((2, 40, 70), True, torch.bfloat16, 5)[1]
    got, want = p.clone(), p.clone()
    sums = [torch.zeros((), device=DEV) for _ in range(2)]
    lr = torch.tensor(0.03, device=DEV)
    apply_update(got, upd, 1.0 - lr * 0.1, -lr, sums[0], backend=backend)
    apply_update(want, upd, 1.0 - 0.03 * 0.1, -0.03, sums[1], backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(got, p)
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="both"):
        apply_update(got, upd, 1.0 - lr * 0.1, -0.03, sums[0], backend="triton")
