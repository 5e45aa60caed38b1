"""benchmarks/qb_sweep.py's oracle in CUDA-graph layers (train.compile=true, reduce-overhead), as its
bench-1B runs use it. Run with ``pytest -m gpu``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import yaml

from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from k3train.training.compile import begin_forward, compile_layers

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import qb_sweep  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_oracle_keeps_each_micro_batchs_scores_under_cuda_graphs():
    """Two micro-batches of different tokens, twice (the second round replays the recorded graphs): the
    scores the recorder keeps of each equal eager's within bf16 noise, and the first is not overwritten
    by the second's replay (a kept graph output would be)."""
    cfg = ModelConfig(**yaml.safe_load((REPO / "conf/model/k3_tiny_kernel.yaml").read_text()))
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = K3Model(cfg).cuda().train()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled, mode="reduce-overhead")
    recorders = {m: [qb_sweep.OracleRecorder(layer) for layer in m.moe_layers()] for m in (eager, compiled)}
    g = torch.Generator().manual_seed(2)
    T = 512
    batches = [torch.randint(0, cfg.vocab_size, (2, T), generator=g).cuda() for _ in range(2)]
    pos = torch.arange(T).repeat(2, 1).cuda()
    for model in (eager, compiled):
        for _ in range(2):
            for rec in recorders[model]:
                rec.pop()
            for tokens in batches:
                # no .grad kept across micro-batches: under CUDA graphs a parameter's .grad is the backward
                # graph's output, which the next replay overwrites (the trainer moves grads to its buffers)
                model.zero_grad(set_to_none=True)
                if model is compiled:
                    begin_forward("reduce-overhead")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    model(tokens, pos, tokens).backward()
    for want, got in zip(recorders[eager], recorders[compiled]):
        assert len(got.scores) == len(want.scores) == 2
        for a, b in zip(want.scores, got.scores):
            assert float((b - a).norm() / a.norm()) < 2e-2
        first, second = got.scores
        assert float((first - second).norm() / second.norm()) > 1e-2
        fitted, want_fitted = got.pop()["pooled"], want.pop()["pooled"]
        print(f"fitted load: compiled {fitted:.3f}, eager {want_fitted:.3f}")
        assert abs(fitted - want_fitted) <= 0.1 * want_fitted
