"""train.optimizer_cuda_graph: K3Muon's step captured in a CUDA graph and replayed takes the same steps as
the eager optimizer while the learning rate changes, also after what a CUDA-graph-tree recording does to
cuBLAS's workspaces (GPU only)."""

import pytest
import torch

from k3train.optim.muon import build_muon
from k3train.training.optimizer_graph import CapturedOptimizerStep
from standins import StandInModel


def _set_grads_in_place(model: StandInModel, seed: int) -> None:
    """The step's gradients written into the same tensors every step, as the trainer's GradBuffers hold them
    (a captured step reads fixed addresses)."""
    fresh = StandInModel()
    fresh.set_grads(seed)
    for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(q.grad)


def _graph_tree_recording() -> list[torch.Tensor]:
    """What inductor's CUDA graph trees do around each recording of a compiled layer: free every cuBLAS
    workspace and release the allocator's free memory; then new tensors take memory (filled with 7), as the
    recording's activations would. Returns them, to be checked untouched."""
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
@pytest.mark.parametrize("recording", [False, True], ids=["plain", "after_graph_tree_recordings"])
def test_captured_step_equals_eager_steps(recording):
    """With the recordings, Newton–Schulz runs on cuBLAS (bmm), whose workspace the recordings free."""
    cfg = {"lr": 0.02, "weight_decay": 0.1, "muon_ns_backend": "torch" if recording else "auto"}
    eager, captured = StandInModel(seed=2).cuda(), StandInModel(seed=2).cuda()
    opt_eager = build_muon(eager.named_parameters(), cfg)
    opt = build_muon(captured.named_parameters(), cfg)
    step = CapturedOptimizerStep(opt, eager_steps=2)
    opt_eager.check_finite, opt_eager.lr_on_device = False, True  # the same arithmetic as the captured step
    for s, lr in enumerate((0.02, 0.015, 0.01, 0.007, 0.004, 0.002), start=1):
        for o in (opt_eager, opt):
            for g in o.param_groups:
                g["lr"] = lr
        _set_grads_in_place(eager, s)
        _set_grads_in_place(captured, s)
        opt_eager.sync_device_lr()
        opt_eager.step()
        fillers = _graph_tree_recording() if recording and s > 3 else []
        step()
        assert step.captured == (s > 2)
        assert all(bool((f == 7.0).all()) for f in fillers), f"step {s}: the replay wrote into freed memory"
        for (n, p), (_, q) in zip(eager.named_parameters(), captured.named_parameters()):
            # the same kernels in the same order; the update-RMS atomics do not touch the parameters
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=f"step {s}: {n}")
    rms = float(opt.last_step_info["update_rms"])  # the captured step's output tensor, refreshed by replay
    assert abs(rms - float(opt_eager.last_step_info["update_rms"])) < 1e-4 * rms
