"""KDA under context parallelism: one long document at CP=C against CP=1, time and memory per rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/kda.py --cp \
        --cp-shape 1x65536x32x128 --json kda_cp.json

(``benchmarks/kda.py --cp`` calls ``main`` here.) Every rank runs the CP=C forward+backward of
``k3train.parallel.context_parallel.kda_context_parallel`` on its share (chunks r and 2C−1−r of
2C) of one document of T tokens; then rank 0 alone runs ``kernels.kda.kda`` on the whole
document (CP=1). bf16 inputs, gate lower bound −5, q/k L2-normalised in the kernel.

Reported per rank: median fwd+bwd time (CUDA events, ``--rep`` reps after ``--warmup``), peak
memory above the inputs, and the bytes each rank exchanges per layer: the forward all-gather of
its two chunks' (M, S_ext) [2, B, H, K, K+V] fp32 (it sends one share to each of the C−1 others
and receives theirs), and the backward all-reduce of the gathered [2C, B, H, K, K+V] fp32
(a ring all-reduce moves 2(C−1)/C of it through each rank).
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

from k3train.parallel.context_parallel import ChunkPieces, kda_context_parallel
from k3train.parallel.context_shard import ContextShard
from kernels.kda import kda


def _inputs(B: int, T: int, H: int, D: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    q, k, v, gate = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    beta = r(B, T, H)
    A_log = (torch.rand(H, generator=g) * 0.6 - 0.3).to(device)
    dt_bias = (torch.randn(H * D, generator=g) * 0.5).to(device)
    return q, k, v, gate, beta, A_log, dt_bias


def _time(fn, warmup: int, rep: int, device) -> tuple[float, float]:
    """(median ms, peak MiB above what was allocated before) of fn() (forward + backward)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated(device) - base) / 2**20


def main(shape: str, json_path: str, warmup: int = 3, rep: int = 10) -> None:
    dist.init_process_group("nccl")
    rank, C = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    B, T, H, D = (int(x) for x in shape.split("x"))
    shard = ContextShard(dist.group.WORLD, C, rank)
    full = _inputs(B, T, H, D, device)
    pos = torch.arange(T, device=device).expand(B, T)
    mine = [shard.split(t).contiguous().requires_grad_() for t in full[:5]]
    do = torch.randn(B, T // C, H, D, device=device, dtype=torch.bfloat16)
    pieces = ChunkPieces.from_position_ids(shard.split(pos))  # the model computes these once per forward

    def cp_step():
        o = kda_context_parallel(*mine, full[5], full[6], pieces, shard, lower_bound=-5.0)
        o.backward(do)

    cp_ms, cp_mib = _time(cp_step, warmup, rep, device)
    per_rank = torch.tensor([cp_ms, cp_mib], device=device)
    gathered = [torch.empty_like(per_rank) for _ in range(C)]
    dist.all_gather(gathered, per_rank)
    state_bytes = 2 * B * H * D * (D + D) * 4  # this rank's two chunks' [M | S_ext], fp32
    fwd_bytes = state_bytes * (C - 1)  # sent (and received) by each rank in the all-gather
    bwd_bytes = int(2 * (C - 1) / C * state_bytes * C)  # ring all-reduce of the gathered [2C, ...]

    if rank == 0:
        whole = [t.clone().requires_grad_() for t in full[:5]]
        do_full = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)

        def one_step():
            o, _ = kda(*whole, full[5], full[6], lower_bound=-5.0, use_qk_l2norm=True)
            o.backward(do_full)

        one_ms, one_mib = _time(one_step, warmup, rep, device)
        rows = [{"cp": 1, "rank": 0, "tokens": B * T, "ms": one_ms, "peak_mib": one_mib}]
        rows += [{"cp": C, "rank": r, "tokens": B * T // C, "ms": float(g[0]), "peak_mib": float(g[1])}
                 for r, g in enumerate(gathered)]
        print(f"KDA fwd+bwd, one document, B={B} T={T} H={H} D={D}, bf16, {torch.cuda.get_device_name(device)}")
        print(f"{'CP':>3} {'rank':>4} {'tokens':>8} {'ms':>9} {'peak MiB':>9}")
        for r in rows:
            print(f"{r['cp']:>3} {r['rank']:>4} {r['tokens']:>8} {r['ms']:>9.2f} {r['peak_mib']:>9.0f}")
        slowest = max(float(g[0]) for g in gathered)
        print(f"CP={C} speed-up over CP=1 (slowest rank): {one_ms / slowest:.2f}x")
        print(f"exchanged per rank per layer: forward all-gather {fwd_bytes / 2**20:.1f} MiB, "
              f"backward all-reduce {bwd_bytes / 2**20:.1f} MiB")
        with open(json_path, "w") as f:
            json.dump({"shape": shape, "dtype": "bf16", "device": torch.cuda.get_device_name(device), "rows": rows,
                       "speedup_vs_cp1": one_ms / slowest, "fwd_bytes_per_rank": fwd_bytes,
                       "bwd_bytes_per_rank": bwd_bytes}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
