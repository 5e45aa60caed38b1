"""bf16/fp16 gradient into an fp32 main gradient: the Triton kernel equals the torch reference bit for bit
(the copy is exact, the add is one fp32 rounding either way). CPU: Triton interpreter; GPU: CUDA."""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from kernels.grad_accumulate import accumulate

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton_cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 50), (1000,), (7, 13, 5)])
def test_triton_copy_then_add_equals_reference(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    grads = [torch.randn(shape, generator=g).to(dtype).to(DEV) for _ in range(3)]
    got = torch.full(shape, float("nan"), device=DEV)  # the first call must overwrite, not add
    want = torch.empty(shape, device=DEV)
    for i, grad in enumerate(grads):
        accumulate(got, grad, first=i == 0, backend="triton")
        accumulate(want, grad, first=i == 0, backend="torch")
        assert torch.equal(got, want)
    assert not torch.equal(want, grads[0].float())  # the adds happened


@triton_cpu
def test_triton_non_contiguous_and_empty_take_the_reference():
    main = torch.zeros(8, 6, device=DEV)[:, :3]
    grad = torch.randn(3, 8, device=DEV).to(torch.bfloat16).t()
    accumulate(main, grad, first=True, backend="triton")
    assert torch.equal(main, grad.float())
    accumulate(torch.empty(0, device=DEV), torch.empty(0, dtype=torch.bfloat16, device=DEV), first=False)


def test_errors():
    with pytest.raises(ValueError, match="float32"):
        accumulate(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3), first=True)
    with pytest.raises(ValueError, match="as many elements"):
        accumulate(torch.zeros(3), torch.zeros(4, dtype=torch.bfloat16), first=True)


def test_triton_cpu_subprocess():
    rerun_under_interpreter(__file__)


def test_auto_takes_the_kernel_only_for_large_cuda_gradients(monkeypatch):
    """``"auto"``: Triton for contiguous CUDA gradients of at least TRITON_MIN_NUMEL elements, torch below."""
    import kernels.grad_accumulate as ga
    from kernels.grad_accumulate import triton_grad_accumulate

    calls = []
    monkeypatch.setattr(triton_grad_accumulate, "accumulate", lambda m, g, first: calls.append(g.numel()))
    monkeypatch.setattr(ga, "use_triton", lambda x, backend, op: True)  # as on a CUDA device
    monkeypatch.setattr(ga, "TRITON_MIN_NUMEL", 100)
    small, big = torch.ones(99, dtype=torch.bfloat16), torch.ones(100, dtype=torch.bfloat16)
    main_small, main_big = torch.zeros(99), torch.zeros(100)
    accumulate(main_small, small, first=True)
    accumulate(main_big, big, first=True)
    assert calls == [100] and torch.equal(main_small, small.float()) and not main_big.any()
