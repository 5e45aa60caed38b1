"""Pipeline parallelism: step time, measured bubble and AttnRes traffic of the PP schedule.

    NPROC=2 bash launch/torchrun.sh ... is for training; this runs as
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/pipeline.py --json pipeline.json

bench-1B by default (bf16 autocast on GPU, fp32 on CPU), P = the number of processes. Each rank
builds its stage of the model and runs ``--rep`` forward+backward steps of m micro-batches of
[micro, seq] random tokens through ``PipelineSchedule`` (after ``--warmup``; no optimizer). Per
step and rank: the wall time of an untimed step (the throughput figure), and, in as many steps
again with the compute stream synchronised around each P2P wait, the time blocked waiting for a
message and the bubble fraction wait / step time against the ideal (P−1)/(mV+P−1) (those
synchronisations keep the host from queueing ahead, so the timed steps are slower). AttnRes traffic per micro-batch: the bytes the cached plan sends on the forward
hops against sending the whole bank every hop (the backward mirrors both), and the bytes the
ranks really sent. Rank 0 prints the table and writes the JSON. ``--device cpu --model k3_tiny``
is a quick smoke run over gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.config.load import load_config  # noqa: E402
from k3train.model.k3 import K3Model  # noqa: E402
from k3train.parallel.pipeline.layout import build_chunks  # noqa: E402
from k3train.parallel.pipeline.runtime import PipelineSchedule  # noqa: E402
from k3train.parallel.pipeline.schedule import ideal_bubble  # noqa: E402
from k3train.parallel.pipeline.stage import keep_stage  # noqa: E402
from k3train.parallel.state import destroy_parallel, init_parallel, pick_device  # noqa: E402


def batches(m: int, micro: int, seq: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, vocab, (micro, seq), generator=g),
             "labels": torch.randint(0, vocab, (micro, seq), generator=g),
             "position_ids": torch.arange(seq).repeat(micro, 1), "loss_mask": torch.ones(micro, seq)}
            for _ in range(m)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_bench_1b")
    ap.add_argument("--vpp", type=int, default=1, help="virtual stages per rank")
    ap.add_argument("--layout", default="", help="layers per chunk, e.g. 5,4 (default: equal chunks)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default="pipeline.json")
    args = ap.parse_args(argv)

    P = int(os.environ.get("WORLD_SIZE", 1))
    layout = [int(x) for x in args.layout.split(",")] if args.layout else []
    cfg = load_config([f"model={args.model}", f"parallel.pipeline={P}", f"parallel.virtual_stages={args.vpp}",
                       f"parallel.pipeline_layout=[{','.join(map(str, layout))}]"])
    device = pick_device(args.device)
    groups = init_parallel(cfg.parallel, device)
    chunks = build_chunks(cfg.model.num_layers, P, args.vpp, layout)
    torch.manual_seed(0)
    model = keep_stage(K3Model(cfg.model, groups), chunks, groups.pp_rank).to(device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext
    schedule = PipelineSchedule(model, chunks, groups.pp, device, autocast)
    data = batches(args.micro_batches, args.micro, args.seq, cfg.model.vocab_size, seed=1)

    def steps(n: int, timed: bool) -> list[list[float]]:
        """n steps: [wall s, P2P wait s, bytes sent] each."""
        schedule.channels.timed = timed
        out = []
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            schedule.channels.wait_s, schedule.channels.bytes_sent = 0.0, 0
            start = time.perf_counter()
            schedule.train(data)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out.append([time.perf_counter() - start, schedule.channels.wait_s, schedule.channels.bytes_sent])
        return out

    steps(args.warmup, timed=False)
    untimed = steps(args.rep, timed=False)
    timed = steps(args.rep, timed=True)
    mine = torch.tensor([[u[0], t[0], t[1], t[2]] for u, t in zip(untimed, timed)], dtype=torch.float64)  # [rep, 4]
    every = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather_object(every, mine)

    if groups.is_main:
        m, V = args.micro_batches, args.vpp
        cached, whole = schedule.plan.hop_bytes(args.micro * args.seq, cfg.model.hidden_size)
        hops = len(chunks) - 1
        rows_sent, rows_whole = schedule.plan.hop_rows()
        step_s = statistics.median(max(float(r[i, 0]) for r in every) for i in range(args.rep))
        timed_step_s = statistics.median(max(float(r[i, 1]) for r in every) for i in range(args.rep))
        bubble = [statistics.median(float(r[i, 2] / r[i, 1]) for i in range(args.rep)) for r in every]
        sent_per_micro = [float(r[:, 3].mean()) / m for r in every]
        result = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "args": vars(args), "P": P, "V": V, "m": m, "layout": [len(c.layers) for c in chunks],
            "step_s": step_s, "tokens_per_s": m * args.micro * args.seq / step_s, "timed_step_s": timed_step_s,
            "bubble_per_rank": bubble, "bubble_ideal": ideal_bubble(P, V, m),
            "attn_res_rows_per_micro": {"cached": rows_sent, "whole_bank": rows_whole, "hops": hops},
            "attn_res_bytes_per_micro_forward": {"cached": cached, "whole_bank": whole,
                                                 "cached_per_hop": cached / max(hops, 1),
                                                 "whole_bank_per_hop": whole / max(hops, 1)},
            "p2p_bytes_sent_per_micro_per_rank": sent_per_micro,
        }
        print(f"{args.model} PP{P} V{V} layout {result['layout']}, m={m} micro-batches of {args.micro}x{args.seq}, "
              f"{result['device']}")
        print(f"step {step_s * 1e3:.1f} ms | {result['tokens_per_s']:,.0f} tok/s "
              f"(with the waits timed: {timed_step_s * 1e3:.1f} ms)")
        print(f"{'rank':<6}{'bubble (wait/step)':>20}{'ideal (P-1)/(mV+P-1)':>24}{'P2P MB/micro-batch':>20}")
        for r in range(P):
            print(f"{r:<6}{bubble[r]:>20.3f}{result['bubble_ideal']:>24.3f}{sent_per_micro[r] / 2**20:>20.2f}")
        print(f"AttnRes forward per micro-batch over {hops} hops: P + {rows_sent} rows = {cached / 2**20:.2f} MB "
              f"(cached) vs P + {rows_whole} rows = {whole / 2**20:.2f} MB (whole bank every hop); "
              f"per hop {cached / max(hops, 1) / 2**20:.2f} vs {whole / max(hops, 1) / 2**20:.2f} MB")
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
