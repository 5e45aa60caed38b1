"""Expert-parallel MoE layer: plain all-to-all, the balanced dispatcher and Megatron-Core's
all-to-all dispatcher, per routing case.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/moe_ep.py --json moe_ep.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/moe.py --ep   # the same

At bench-1B MoE dims by default (E=128, k=8, ℓ=512, I=256, 16384 tokens per rank, bf16), each rank
runs dispatch → grouped experts → combine, forward and backward, for every dispatcher and routing:

- natural: a random sigmoid router;
- skewed: half of every rank's tokens pick experts 0 and 1 (and 6 random others);
- zero-load: every token picks experts homed on rank 0 (plain all-to-all leaves the others idle);
- rotating: half the tokens pick the experts of one rank, a different rank every iteration.

Dispatchers: ``alltoall`` and ``balanced`` (``k3train.parallel.token_dispatcher``) and
``megatron``, Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (``moe_ep_megatron.py``) on the same
tokens, routing and gate weights; every row runs our grouped expert GEMMs on the same weights.
Before timing, per case, megatron's output and gradients (z, gate weights, w13, w2) must equal
plain all-to-all's within ``CHECK_LIMIT`` (relative Frobenius, worst rank; asserted).

Per row: the rows each rank computes (max/mean over ranks in the worst iteration, the MoonEP
balance figure), the iteration time (fwd+bwd, ``--rep`` iterations after ``--warmup``, ranks
synchronised before each; the slowest rank's median, the lower one of an even count) and its phases: dispatch (with the planning
and, balanced, the replica-weight fetch), experts, combine, backward (everything, the reverse
all-to-alls included). Phases are CUDA events on the GPU, perf_counter on CPU, taken from the
slowest rank's median iteration, so they add up to at most its time; the JSON also has every
rank's per-phase medians. Rank 0 prints the table and writes the JSON. Runs on CPU over gloo
too (small ``--tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.config.schema import ModelConfig, ParallelConfig  # noqa: E402
from k3train.model.moe import RoutedExperts  # noqa: E402
from k3train.parallel.state import destroy_parallel, init_parallel, pick_device  # noqa: E402
from k3train.parallel.tensor_parallel import TPSpec  # noqa: E402
from k3train.parallel.token_dispatcher import token_dispatcher  # noqa: E402
from moe import failure, rel  # noqa: E402
from moe_ep_megatron import MegatronAlltoAll, on_host  # noqa: E402
from moe_shapes import add_moe_dims  # noqa: E402

CASES = ("natural", "skewed", "zero-load", "rotating")
PHASES = ("dispatch", "experts", "combine", "backward")
CHECK_LIMIT = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # megatron vs alltoall, relative Frobenius


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


class PhaseClock:
    """Timestamps at the phase boundaries of one iteration: CUDA events on the current stream
    (GPU) or perf_counter (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """ms between consecutive marks (after a synchronize on the GPU)."""
        pairs = zip(self.marks, self.marks[1:])
        return [a.elapsed_time(b) if self.cuda else 1e3 * (b - a) for a, b in pairs]


@dataclass
class Row:
    """A dispatcher under test and how it takes the router's output: ``route(experts, weights)``
    is what its ``dispatch(z, route)`` wants (untimed, as a router would hand it over)."""

    name: str
    dispatcher: object
    route: Callable


def iteration(row: Row, experts_module, z, route, weights, du, mark) -> tuple[torch.Tensor, int]:
    """One fwd+bwd through ``row``, calling ``mark`` at the PHASES boundaries → u [N, ℓ], rows
    computed here."""
    mark()
    grouped, tokens_per_group, handle = row.dispatcher.dispatch(z, route)
    w13, w2 = row.dispatcher.expert_stacks(experts_module, handle)
    mark()
    y = experts_module(grouped, tokens_per_group, w13, w2)
    mark()
    u = row.dispatcher.combine(y, weights, handle)
    mark()
    u.backward(du.to(u.dtype))
    mark()
    return u.detach(), grouped.shape[0]


def case_inputs(case, args, groups, device, dtype):
    """z [N, ℓ], gate weights [N, k], output gradient [N, ℓ] (leaves) and the routing of each
    iteration, the same for every dispatcher."""
    R, rank = groups.ep_size, groups.ep_rank
    g = torch.Generator().manual_seed(1000 * rank + 7)
    N, ell = args.tokens, args.latent
    z = torch.randn(N, ell, generator=g).to(device, dtype).requires_grad_(True)
    weights = torch.rand(N, args.topk, generator=g).to(device).requires_grad_(True)
    du = torch.randn(N, ell, generator=g).to(device, dtype)
    routes = [routing(case, it, N, args.experts, args.topk, R, rank, g).to(device)
              for it in range(args.warmup + args.rep)]
    return z, weights, du, routes


def outputs_and_grads(row, experts_module, z, experts, weights, du) -> list[torch.Tensor]:
    """[u, dz, dweights, dw13, dw2] of one iteration of ``row``."""
    u, _ = iteration(row, experts_module, z, row.route(experts, weights), weights, du, lambda: None)
    leaves = (z, weights, experts_module.w13, experts_module.w2)
    got = [u, *(t.grad.clone() for t in leaves)]
    for t in leaves:
        t.grad = None
    return got


def check(peer: Row, ref: Row, experts_module, inputs, groups) -> dict:
    """Relative errors of peer against ref on a case's first routing, the worst over EP ranks."""
    z, weights, du, routes = inputs
    got, want = (outputs_and_grads(r, experts_module, z, routes[0], weights, du) for r in (peer, ref))
    errs = torch.tensor([rel(a, b) for a, b in zip(got, want)], dtype=torch.float64, device=z.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=groups.ep)
    return dict(zip(("out", "dz", "dweights", "dw13", "dw2"), errs.tolist()))


def run_case(row: Row, experts_module, inputs, args, groups, device) -> dict:
    """Time ``row`` over a case's iterations → the row of the table (see the module docstring)."""
    z, weights, du, routes = inputs
    walls, phases, rows = [], [], []
    for it, experts in enumerate(routes):
        route = row.route(experts, weights)
        clock = PhaseClock(device)
        dist.barrier(group=groups.ep)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, n = iteration(row, experts_module, z, route, weights, du, clock.mark)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if it >= args.warmup:
            walls.append(1e3 * (time.perf_counter() - start))
            phases.append(clock.intervals_ms())
            rows.append(n)
        z.grad = weights.grad = experts_module.w13.grad = experts_module.w2.grad = None
    return summary(walls, phases, rows, groups, device)


def summary(walls, phases, rows, groups, device) -> dict:
    """Per-rank iteration times [I], phase times [I, 4] and rows computed [I] → the slowest
    rank's median iteration with its phases, every rank's medians, and the balance figure."""
    R = groups.ep_size
    mid = sorted(range(len(walls)), key=walls.__getitem__)[(len(walls) - 1) // 2]
    per_iteration = [[w, *p] for w, p in zip(walls, phases)]
    times = torch.tensor([per_iteration[mid], [statistics.median_low(c) for c in zip(*per_iteration)]],
                         dtype=torch.float64, device=device)  # [2, 5]
    loads = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered_times = [torch.zeros_like(times) for _ in range(R)]
    gathered_loads = [torch.zeros_like(loads) for _ in range(R)]
    dist.all_gather(gathered_times, times, group=groups.ep)
    dist.all_gather(gathered_loads, loads, group=groups.ep)
    times, loads = torch.stack(gathered_times).cpu(), torch.stack(gathered_loads).cpu()  # [R, 2, 5], [R, I]
    slowest = int(times[:, 0, 0].argmax())
    ratio = loads.max(0).values / loads.mean(0).clamp(min=1)
    worst = int(ratio.argmax())
    phase_ms = dict(zip(PHASES, times[slowest, 0, 1:].tolist()))
    return {"ms": float(times[slowest, 0, 0]), "phases_ms": phase_ms,
            "dispatch_combine_ms": phase_ms["dispatch"] + phase_ms["combine"], "slowest_rank": slowest,
            "rank_medians_ms": dict(zip(("iteration", *PHASES), times[:, 1].T.tolist())),
            "rows_per_rank": [int(v) for v in loads[:, worst].tolist()],
            "compute_max_over_mean": float(ratio[worst])}


def our_route(experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Our dispatchers take the chosen experts [N, k] (the gate weights come at combine)."""
    return experts


def rows_to_run(names, args, groups, device) -> tuple[list[Row], dict]:
    """The dispatchers asked for (``--dispatchers``), and megatron's build info or why it is n/a."""
    rows, info = [], {}
    for name in names:
        if name in ("alltoall", "balanced"):
            rows.append(Row(name, token_dispatcher(args.experts, groups.ep, groups.ep_size, name), our_route))
        elif name == "megatron":
            try:
                from megatron.core import __version__
                peer = MegatronAlltoAll(args.experts, args.topk, args.latent, device)
                rows.append(Row(name, peer, peer.route))
                info = {"version": __version__, "cpu_stand_ins": device.type != "cuda"}
            except Exception as e:  # noqa: BLE001 - the megatron rows say why
                info = {"error": failure(e)}
        else:
            raise ValueError(f"dispatcher {name!r}: alltoall, balanced or megatron")
    return rows, info
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_moe_dims(ap, tokens=16384, tokens_help="tokens per rank")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dispatchers", default="alltoall,balanced,megatron")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default="moe_ep.json")
    args = ap.parse_args(argv)

    device = pick_device(args.device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    groups = init_parallel(ParallelConfig(expert=world), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    limit = CHECK_LIMIT[dtype]
    cfg = ModelConfig(num_experts=args.experts, num_experts_per_token=args.topk, latent_size=args.latent,
                      moe_intermediate_size=args.width)
    torch.manual_seed(0)
    experts_module = RoutedExperts(cfg, TPSpec(groups, 0.02)).to(device)
    rows, megatron = rows_to_run(args.dispatchers.split(","), args, groups, device)
    plain = Row("alltoall", token_dispatcher(args.experts, groups.ep, groups.ep_size), our_route)
    results, checks = [], {}
    with on_host(device), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for case in args.cases.split(","):
            inputs = case_inputs(case, args, groups, device, dtype)
            for row in rows:
                if row.name == "megatron":
                    checks[case] = check(row, plain, experts_module, inputs, groups)
                    assert max(checks[case].values()) <= limit, (case, checks[case])
                results.append({"dispatcher": row.name, "routing": case,
                                **run_case(row, experts_module, inputs, args, groups, device)})
    if "error" in megatron:
        results += [{"dispatcher": "megatron", "routing": case, "na": megatron["error"]}
                    for case in args.cases.split(",")]
    if groups.rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"{world} × {name}, E={args.experts} k={args.topk} ℓ={args.latent} I={args.width}, "
              f"{args.tokens} tokens per rank; ms fwd+bwd (slowest rank's median) and its phases; "
              f"megatron: {megatron}")
        print(f"{'dispatcher':<11}{'routing':<11}{'ms':>8}{'dispatch':>9}{'experts':>9}{'combine':>9}"
              f"{'backward':>9}{'d+c':>8}{'max/mean':>9}  rows per rank")
        for r in results:
            if "na" in r:
                print(f"{r['dispatcher']:<11}{r['routing']:<11}  n/a: {r['na']}")
                continue
            ph = r["phases_ms"]
            print(f"{r['dispatcher']:<11}{r['routing']:<11}{r['ms']:8.2f}"
                  + "".join(f"{ph[p]:9.2f}" for p in PHASES)
                  + f"{r['dispatch_combine_ms']:8.2f}{r['compute_max_over_mean']:9.3f}  {r['rows_per_rank']}")
        for case, err in checks.items():
            print(f"check {case}: megatron vs alltoall, worst relative error {max(err.values()):.2e} "
                  f"(limit {limit:g})")
        with open(args.json, "w") as fh:
            json.dump({"device": name, "world": world, "args": vars(args), "megatron": megatron,
                       "check_limit": limit, "checks": checks, "rows": results}, fh, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
