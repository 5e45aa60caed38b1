"""The fused Triton Newton–Schulz kernel equals the torch one (interpreter on CPU, fp32 dots)."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

CHECK = r"""
import torch
from kernels.newton_schulz import newton_schulz_triton, triton_supports
from k3train.optim.newton_schulz import newton_schulz
from k3train.optim.muon import build_muon
from k3train.config.schema import OptimConfig
from standins import StandInModel
torch.manual_seed(0)
for shape, scale in [((3, 16, 40), 1.0), ((2, 40, 24), 1.7), ((1, 20, 130), 1.7), ((5, 8, 8), 1.0)]:
    G = torch.randn(shape)
    assert triton_supports(G)
    if True:
        X, R = newton_schulz_triton(G, scale=scale), newton_schulz(G, scale=scale)
        assert X.shape == R.shape
        err = float((X - R).norm() / R.norm())
        assert err < 1e-5, (shape, err)
assert not triton_supports(torch.randn(2, 130, 140))  # > 128 rows: torch fallback
torch.testing.assert_close(newton_schulz_triton(torch.randn(2, 130, 140).mul(0)), torch.zeros(2, 130, 140))
# drop-in for the optimizer
a, b = StandInModel(seed=1), StandInModel(seed=1)
oa = build_muon(a.named_parameters(), OptimConfig(lr=0.02))
ob = build_muon(b.named_parameters(), OptimConfig(lr=0.02), ns_fn=newton_schulz_triton)
for s in (1,):
    a.set_grads(s); b.set_grads(s); oa.step(); ob.step()
for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
print("TRITON_NS_OK")
"""


def test_triton_ns_matches_torch_in_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the GPU path is measured by benchmarks/muon.py")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "TRITON_NS_OK" in res.stdout, res.stdout + res.stderr
