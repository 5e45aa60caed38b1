"""Activation memory per ``train.recompute`` policy: the bytes autograd keeps for the backward.

    python benchmarks/recompute_memory.py [--model k3_bench_1b] [--batch 1] [--seq 1024] [--json out.json]

One forward of the model (bf16 parameters under bf16 autocast, as the trainer runs on GPU) per
policy, with a ``saved_tensors_hooks`` pack hook that records every distinct storage autograd saves
for the backward, minus the parameters themselves (they are held anyway). Activation checkpointing
installs its own hooks inside a recomputed region, so what a policy recomputes is not counted: the
figure is what stays alive between the forward and the backward. Runs on CPU or GPU; on CPU the
kernels' torch references run (the GPU's Triton kernels save other intermediates: KDA's chunk
buffers, AttnRes' per-token weights), so CPU figures describe the torch path. Prints a table (MiB,
MiB per 1K tokens, share of ``none``) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml

from k3train.config.schema import RECOMPUTE_POLICIES, ModelConfig
from k3train.model.k3 import K3Model
from k3train.precision.main_params import MainParams
from k3train.training.recompute import apply_recompute


def saved_bytes(model: K3Model, tokens: torch.Tensor, device: torch.device) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward of ``tokens``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens)
    del loss
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_bench_1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="recompute_memory.json")
    args = ap.parse_args()

    path = Path(__file__).resolve().parents[1] / "conf" / "model" / f"{args.model}.yaml"
    cfg = ModelConfig(**yaml.safe_load(path.read_text()))
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = K3Model(cfg).to(device).train()
    MainParams(model, torch.bfloat16)  # bf16 weights as the trainer holds them (KDA's fp32 ones stay)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    rows = []
    for policy in RECOMPUTE_POLICIES:
        wrapped = apply_recompute(model, policy)
        t0 = time.perf_counter()
        nbytes = saved_bytes(model, tokens, device)
        rows.append({"policy": policy, "recomputed_modules": len(wrapped), "saved_bytes": nbytes,
                     "forward_s": time.perf_counter() - t0})
        for name in wrapped:  # back to the class's forward before the next policy
            del model.get_submodule(name).forward
    tok = args.batch * args.seq
    base = rows[0]["saved_bytes"]
    print(f"{args.model}, {args.batch}x{args.seq} tokens, bf16 params + autocast, {device.type} "
          f"({'torch references' if device.type == 'cpu' else 'Triton kernels'})")
    print(f"{'policy':>9} {'modules':>8} {'MiB':>9} {'MiB/1K tok':>11} {'of none':>8}")
    for r in rows:
        mib = r["saved_bytes"] / 2**20
        print(f"{r['policy']:>9} {r['recomputed_modules']:>8} {mib:>9.1f} {mib / tok * 1024:>11.2f} "
              f"{r['saved_bytes'] / base:>8.1%}")
    Path(args.json).write_text(json.dumps({"model": args.model, "batch": args.batch, "seq": args.seq,
                                           "device": device.type, "dtype": "bf16 params, bf16 autocast",
                                           "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
