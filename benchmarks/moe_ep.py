"""Expert-parallel MoE layer: plain all-to-all against the balanced dispatcher, per routing case.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/moe_ep.py --json moe_ep.json

At bench-1B MoE dims by default (E=128, k=8, ℓ=512, I=256, 16384 tokens per rank, bf16), each rank
runs dispatch → grouped experts → combine, forward and backward, for every dispatcher and routing:

- natural: a random sigmoid router;
- skewed: half of every rank's tokens pick experts 0 and 1 (and 6 random others);
- zero-load: every token picks experts homed on rank 0 (plain all-to-all leaves the others idle);
- rotating: half the tokens pick the experts of one rank, a different rank every iteration.

Per case: the rows each rank computes (max/mean over ranks in the worst iteration, the MoonEP
balance figure) and the median fwd+bwd wall time of an iteration (``--rep`` iterations after
``--warmup``, synchronised; the slowest rank's).
Rank 0 prints the table and writes the JSON. Runs on CPU over gloo too (small ``--tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.config.schema import ModelConfig, ParallelConfig  # noqa: E402
from k3train.model.moe import RoutedExperts  # noqa: E402
from k3train.parallel.state import destroy_parallel, init_parallel, pick_device  # noqa: E402
from k3train.parallel.tensor_parallel import TPSpec  # noqa: E402
from k3train.parallel.token_dispatcher import token_dispatcher  # noqa: E402

CASES = ("natural", "skewed", "zero-load", "rotating")


def routing(case: str, it: int, N: int, E: int, k: int, R: int, rank: int, g: torch.Generator) -> torch.Tensor:
    """experts [N, k] int64 (distinct per token) for one iteration of a case."""
    scores = torch.rand(N, E, generator=g)
    E_l = E // R
    if case == "skewed":
        scores[: N // 2, :2] += 2.0
    elif case == "zero-load":
        scores[:, :E_l] += 2.0
    elif case == "rotating":
        hot = it % R
        scores[: N // 2, hot * E_l:(hot + 1) * E_l] += 2.0
    elif case != "natural":
        raise ValueError(f"routing case {case!r}: one of {CASES}")
    return scores.topk(k, dim=-1).indices


def run_case(experts_module, dispatcher, case, args, groups, device, dtype) -> dict:
    R, rank = groups.ep_size, groups.ep_rank
    g = torch.Generator().manual_seed(1000 * rank + 7)
    N, ell = args.tokens, args.latent
    z = torch.randn(N, ell, device=device, dtype=dtype, requires_grad=True)
    weights = torch.rand(N, args.topk, device=device, requires_grad=True)
    du = torch.randn(N, ell, device=device, dtype=dtype)
    times, rows = [], []
    for it in range(args.warmup + args.rep):
        experts = routing(case, it, N, args.experts, args.topk, R, rank, g).to(device)
        dist.barrier(group=groups.ep)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        grouped, tokens_per_group, handle = dispatcher.dispatch(z, experts)
        w13, w2 = dispatcher.expert_stacks(experts_module, handle)
        u = dispatcher.combine(experts_module(grouped, tokens_per_group, w13, w2), weights, handle)
        u.backward(du)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if it >= args.warmup:
            times.append(time.perf_counter() - start)
            rows.append(grouped.shape[0])
        z.grad = weights.grad = experts_module.w13.grad = experts_module.w2.grad = None
    ms = torch.tensor([1e3 * statistics.median(times)], dtype=torch.float64, device=device)
    mine = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(R)]
    dist.all_gather(gathered, mine, group=groups.ep)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=groups.ep)
    loads = torch.stack(gathered)  # [R, iterations]
    ratio = loads.max(0).values / loads.mean(0).clamp(min=1)
    worst = int(ratio.argmax())
    return {"ms": float(ms), "rows_per_rank": [int(v) for v in loads[:, worst].tolist()],
            "compute_max_over_mean": float(ratio[worst])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default="moe_ep.json")
    args = ap.parse_args(argv)

    device = pick_device(args.device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    groups = init_parallel(ParallelConfig(expert=world), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(num_experts=args.experts, num_experts_per_token=args.topk, latent_size=args.latent,
                      moe_intermediate_size=args.width)
    torch.manual_seed(0)
    experts_module = RoutedExperts(cfg, TPSpec(groups, 0.02)).to(device)
    results = []
    for kind in ("alltoall", "balanced"):
        dispatcher = token_dispatcher(args.experts, groups.ep, groups.ep_size, kind)
        for case in args.cases.split(","):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                res = run_case(experts_module, dispatcher, case, args, groups, device, dtype)
            results.append({"dispatcher": kind, "routing": case, **res})
    if groups.rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"{world} × {name}, E={args.experts} k={args.topk} ℓ={args.latent} I={args.width}, "
              f"{args.tokens} tokens per rank, fwd+bwd")
        print(f"{'dispatcher':<11}{'routing':<11}{'ms':>9}{'compute max/mean':>18}  rows per rank")
        for r in results:
            print(f"{r['dispatcher']:<11}{r['routing']:<11}{r['ms']:9.2f}{r['compute_max_over_mean']:18.3f}  "
                  f"{r['rows_per_rank']}")
        with open(args.json, "w") as fh:
            json.dump({"device": name, "world": world, "args": vars(args), "rows": results}, fh, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
