"""End-to-end training-step throughput of a K3 proxy on one GPU: tokens/s, TFLOP/s and MFU.

    python benchmarks/train_step.py --model k3_bench_1b --batch 2 --seq 4096 --steps 10

One step = forward + backward of one micro-batch under bf16 autocast + AdamW + Quantile Balancing
(the trainer's per-step bias update, timed separately as ``qb_ms``). FLOPs come
from ``k3train.training.flops`` (KDA, MLA and active-expert aware), so MFU here is the same
figure the trainer logs. MFU is reported against the H200 datasheet (989 TFLOP/s) and against
the bf16 GEMM ceiling measured on the lent H200 (ANCHORS.md: 694 TFLOP/s). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3train.config.schema import ModelConfig, OptimConfig
from k3train.model.k3 import K3Model
from k3train.optim.builder import build_optimizer
from k3train.training.flops import train_flops_per_token

MEASURED_GEMM_TFLOPS = 694.0  # ANCHORS.md, bf16 8192³ on the lent H200
DATASHEET_TFLOPS = 989.0


def model_config(name: str) -> ModelConfig:
    import yaml

    path = Path(__file__).resolve().parents[1] / "conf" / "model" / f"{name}.yaml"
    return ModelConfig(**yaml.safe_load(path.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_bench_1b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="train_step.json")
    args = ap.parse_args()

    cfg = model_config(args.model)
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = K3Model(cfg).to(device)
    opt = build_optimizer(model, OptimConfig(lr=1e-4))
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    moe = model.moe_layers()
    qb_events = []

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=y)
        loss.backward()
        opt.step()
        qb_start, qb_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        qb_start.record()
        for layer in moe:
            layer.update_bias()
            layer.load.reset()
        qb_end.record()
        qb_events.append((qb_start, qb_end))
        return loss.detach()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    qb_events.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    qb_ms = sum(a.elapsed_time(b) for a, b in qb_events) / len(qb_events)
    tok = args.batch * args.seq
    tflops = tok * train_flops_per_token(cfg, args.seq) / dt / 1e12
    row = {"model": args.model, "batch": args.batch, "seq": args.seq, "dtype": "bf16 autocast, fp32 params",
           "gpu": torch.cuda.get_device_name(), "step_ms": dt * 1e3, "tokens_per_s": tok / dt,
           "model_tflops": tflops, "mfu_datasheet": tflops / DATASHEET_TFLOPS,
           "mfu_measured_gemm": tflops / MEASURED_GEMM_TFLOPS,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss),
           "qb_ms": qb_ms, "qb_share": qb_ms / (dt * 1e3)}
    print(f"{'model':>12} {'B×T':>10} {'ms/step':>9} {'tok/s':>9} {'TFLOP/s':>8} {'MFU(989)':>9} "
          f"{'MFU(694)':>9} {'mem GB':>7} {'QB ms':>6} {'QB %':>5}")
    print(f"{args.model:>12} {args.batch}×{args.seq:<7} {row['step_ms']:>9.1f} {row['tokens_per_s']:>9.0f} "
          f"{tflops:>8.1f} {row['mfu_datasheet']:>9.1%} {row['mfu_measured_gemm']:>9.1%} {row['peak_mem_gb']:>7.1f} {qb_ms:>6.2f} {row['qb_share']:>5.1%}")
    Path(args.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
