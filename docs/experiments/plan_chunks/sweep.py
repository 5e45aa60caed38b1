"""Session 38: the routing plan's count blocks of CHUNKS place tiles (``triton_plan.GPU_COUNT_CHUNKS``), swept with
the warps a program, at bench-1B's routing (16384 tokens, 8 of 128 experts, row tile 64), natural and skewed; each
plan checked equal to the reference, then timed as CUDA-graph replays of the whole plan (µs a call).

The kernels' CHUNKS are not on main: session 39 measured them (one H200, natural routing: 1 chunk 22.2 µs with 4 or 8
warps, 2 chunks 22.2-23.3, 4 24.7-27.1, 8 27.3-43.1, 16 37.3-218.7; docs/results/
moe_plan_count_chunks_s39_h200_2026-12-04.json) and removed them; apply the patch to run the sweep again.

    git apply docs/experiments/plan_chunks/count_chunks.patch
    python docs/experiments/plan_chunks/sweep.py out.json
"""

import json
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "docs", "experiments")]

from graph_timing import graph_us  # noqa: E402
from kernels.moe_plan import layout_rows, routing_plan  # noqa: E402
from kernels.moe_plan import triton_plan  # noqa: E402

N, E, K, T = 16384, 128, 8, 64


def routing(skew: bool) -> torch.Tensor:
    """experts [N, K]: the top K of uniform scores, or of scores tilted by a Dirichlet(0.3) popularity."""
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(N, E, generator=g)
    if skew:
        scores += torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample().log() * 0.5
    return scores.argsort(1, descending=True)[:, :K].cuda()


def main(out: str) -> None:
    rows, res = layout_rows(N * K, E, T), {}
    defaults = triton_plan.GPU_COUNT_CHUNKS, triton_plan.GPU_NUM_WARPS
    for skew in (False, True):
        experts = routing(skew)
        want = routing_plan(experts, E, T, backend="torch")
        for chunks in (1, 2, 4, 8, 16, 32):
            for warps in (4, 8):
                triton_plan.GPU_COUNT_CHUNKS, triton_plan.GPU_NUM_WARPS = chunks, warps
                got = routing_plan(experts, E, T, backend="triton")
                same = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
                name = f"{'skewed' if skew else 'natural'} chunks {chunks} warps {warps}"
                res[name] = graph_us(lambda: routing_plan(experts, E, T, backend="triton"), reps=50) if same else "WRONG"
                print(f"{name:>32}  {res[name] if isinstance(res[name], str) else f'{res[name]:7.2f} us'}", flush=True)
    triton_plan.GPU_COUNT_CHUNKS, triton_plan.GPU_NUM_WARPS = defaults
    json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows, us=res), open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plan_chunks.json")
