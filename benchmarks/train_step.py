"""End-to-end training-step throughput of a K3 proxy on one GPU: tokens/s, TFLOP/s and MFU.

    python benchmarks/train_step.py --model k3_bench_1b --batch 2 --seq 4096 --steps 10

One step = forward + backward of one micro-batch under bf16 autocast + AdamW + Quantile Balancing
(the trainer's per-step bias update). ``--params bf16`` (the trainer's default on GPU,
``precision.params``) holds bf16 model weights with fp32 main weights and gradients, as the trainer
does (``MainParams``, ``GradBuffers``); ``--params fp32`` keeps fp32 weights that autocast casts. Per-phase GPU times (forward, backward, optimizer, QB) come
from CUDA events around each phase; ``--profile`` adds a torch profiler pass over two steps that
prints GPU busy time against wall time (a host-bound step has idle GPU), the kernel count, and the
kernels grouped by kind and the top kernels by GPU time. FLOPs come
from ``k3train.training.flops`` (KDA, MLA and active-expert aware), so MFU here is the same
figure the trainer logs. MFU is reported against the H200 datasheet (989 TFLOP/s) and against
the bf16 GEMM ceiling measured on the lent H200 (ANCHORS.md: 694 TFLOP/s). ``--recompute`` applies an
activation recompute policy (``train.recompute``, k3train/training/recompute.py); compare the peak
memory (``torch.cuda.max_memory_allocated`` over the timed steps) and step time across policies. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3train.config.schema import RECOMPUTE_POLICIES, ModelConfig, OptimConfig
from k3train.model.k3 import K3Model
from k3train.optim.builder import build_optimizer
from k3train.parallel.grad_buffers import GradBuffers
from k3train.precision.main_params import MainParams
from k3train.training.flops import train_flops_per_token
from k3train.training.recompute import apply_recompute

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
    ap.add_argument("--params", choices=("bf16", "fp32"), default="bf16",
                    help="parameter storage (precision.params): bf16 with fp32 main weights, or fp32")
    ap.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default="none",
                    help="activation recompute policy (train.recompute)")
    ap.add_argument("--profile", action="store_true", help="also profile two steps (kernels by kind and time)")
    args = ap.parse_args()

    cfg = model_config(args.model)
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = K3Model(cfg).to(device)
    main = MainParams(model, torch.bfloat16 if args.params == "bf16" else torch.float32)
    grads = GradBuffers(model, None)
    apply_recompute(model, args.recompute)
    opt = build_optimizer(model, OptimConfig(lr=1e-4))
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    moe = model.moe_layers()
    phases = ("forward", "backward", "optimizer", "qb")
    events: list[dict] = []

    def step() -> torch.Tensor:
        marks = {name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for name in phases}
        grads.zero()
        marks["forward"][0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=y)
        marks["forward"][1].record()
        marks["backward"][0].record()
        loss.backward()
        grads.reduce()
        marks["backward"][1].record()
        marks["optimizer"][0].record()
        opt.step()
        main.sync_model()
        marks["optimizer"][1].record()
        marks["qb"][0].record()
        for layer in moe:
            layer.update_bias()
            layer.load.reset()
        marks["qb"][1].record()
        events.append(marks)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    phase_ms = {name: sum(m[name][0].elapsed_time(m[name][1]) for m in events) / len(events) for name in phases}
    qb_ms = phase_ms["qb"]
    tok = args.batch * args.seq
    tflops = tok * train_flops_per_token(cfg, args.seq) / dt / 1e12
    row = {"model": args.model, "batch": args.batch, "seq": args.seq, "dtype": f"bf16 autocast, {args.params} params",
           "recompute": args.recompute,
           "gpu": torch.cuda.get_device_name(), "step_ms": dt * 1e3, "tokens_per_s": tok / dt,
           "model_tflops": tflops, "mfu_datasheet": tflops / DATASHEET_TFLOPS,
           "mfu_measured_gemm": tflops / MEASURED_GEMM_TFLOPS,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss),
           "qb_ms": qb_ms, "qb_share": qb_ms / (dt * 1e3), "phase_ms": phase_ms}
    print(f"{'model':>12} {'B×T':>10} {'recompute':>9} {'ms/step':>9} {'tok/s':>9} {'TFLOP/s':>8} "
          f"{'MFU(989)':>9} {'MFU(694)':>9} {'mem GB':>7} {'QB ms':>6} {'QB %':>5}")
    print(f"{args.model:>12} {args.batch}×{args.seq:<7} {args.recompute:>9} {row['step_ms']:>9.1f} "
          f"{row['tokens_per_s']:>9.0f} {tflops:>8.1f} {row['mfu_datasheet']:>9.1%} {row['mfu_measured_gemm']:>9.1%} {row['peak_mem_gb']:>7.1f} {qb_ms:>6.2f} {row['qb_share']:>5.1%}")
    print(f"{args.params} params; phases (GPU time between events, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in phase_ms.items()))
    if args.profile:
        row["profile"] = profile(step)
    Path(args.json).write_text(json.dumps(row, indent=2))


KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "grouped_mm", "matmul")), ("kda", ("kda", "chunk_")),
         ("attention", ("flash", "fmha", "attention", "efficient")), ("nccl", ("nccl",)),
         ("triton (other)", ("triton",)), ("copy/cast", ("copy", "cast", "convert")),
         ("reduce", ("reduce", "norm", "softmax")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "elementwise/other")


def profile(step) -> dict:
    """Two profiled steps: wall time, GPU busy time, kernel count, time by kernel kind, top kernels."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / 2
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / 2
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3 / 2
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + ms
        by_name[e.name] = by_name.get(e.name, 0.0) + ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    print(f"profiled step: wall {wall_ms:.1f} ms, GPU busy {busy_ms:.1f} ms ({busy_ms / wall_ms:.0%}), "
          f"{len(kernels) // 2} kernels per step")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<18} {ms:8.2f} ms {ms / busy_ms:6.1%}")
    print("top kernels (ms per step):")
    for name, ms in top:
        print(f"  {ms:8.2f}  {name[:110]}")
    return {"wall_ms": wall_ms, "gpu_busy_ms": busy_ms, "kernels_per_step": len(kernels) // 2,
            "by_kind_ms": by_kind, "top_kernels_ms": dict(top)}


if __name__ == "__main__":
    main()
