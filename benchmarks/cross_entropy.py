"""Fused cross-entropy over bf16 logits: the Triton kernels against today's path.

    python benchmarks/cross_entropy.py [--tokens 8192] [--vocab 163840] [--tiles 4096x4096x8 …] [--json out.json]

One process, one GPU, bench-1B shapes by default (8,192 tokens × 163,840 vocabulary, bf16 logits,
TP = 1). For each path ("triton": ``kernels.cross_entropy``; "today": ``F.cross_entropy`` on
``logits.float()``, as ``TPSpec.cross_entropy`` did): forward+backward time (median of
``triton.testing.do_bench``) and the peak CUDA memory of one forward+backward beyond the logits
and labels. Before timing, the kernel's loss and dz must match today's (loss within 1e-3, dz within
1e-2 of its largest magnitude). ``--small`` (33 × 1000) is a dry run that also works on CPU
(Triton through its interpreter when TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from kernels.cross_entropy import cross_entropy  # noqa: E402
from op_timing import median_ms  # noqa: E402

PATHS = {
    "triton": lambda z, y: cross_entropy(z, y, backend="triton"),
    "today": lambda z, y: F.cross_entropy(z.float(), y, reduction="none"),
}


def fwd_bwd(path: str, z: torch.Tensor, y: torch.Tensor, go: torch.Tensor):
    loss = PATHS[path](z, y)
    (dz,) = torch.autograd.grad(loss, z, go)
    return loss, dz


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tiles", nargs="*", default=[], metavar="FWDxBWDxWARPS",
                    help="also time the Triton path at these blocks (forward BLOCK_V, backward BLOCK_V, warps; GPU)")
    ap.add_argument("--json")
    args = ap.parse_args()
    N, V = (33, 1000) if args.small else (args.tokens, args.vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    z = (4 * torch.randn(N, V, device=device, generator=g)).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device=device, generator=g)
    go = torch.full((N,), 1.0 / N, device=device)

    (l_k, dz_k), (l_t, dz_t) = (fwd_bwd(p, z, y, go) for p in ("triton", "today"))
    assert (l_k - l_t).abs().max().item() < 1e-3, "loss differs from today's path"
    assert (dz_k.float() - dz_t.float()).abs().max().item() <= 1e-2 * dz_t.float().abs().max().item()
    del l_k, dz_k, l_t, dz_t

    rows = []
    for path in PATHS:
        peak = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(path, z, y, go)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = median_ms(lambda: fwd_bwd(path, z, y, go), device, *((5, 20) if device == "cuda" else (2, 3)))
        rows.append({"path": path, "tokens": N, "vocab": V, "fwd_bwd_ms": ms, "peak_extra_gib": peak})

    print(f"{'path':8} {'tokens':>7} {'vocab':>7} {'fwd+bwd ms':>11} {'peak extra GiB':>15}")
    for r in rows:
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"
        print(f"{r['path']:8} {r['tokens']:7d} {r['vocab']:7d} {r['fwd_bwd_ms']:11.3f} {peak:>15}")
    print(f"speed-up {rows[1]['fwd_bwd_ms'] / rows[0]['fwd_bwd_ms']:.2f}x")
    if args.tiles and device == "cuda":  # the kernels read the blocks at each launch
        from kernels.cross_entropy import triton_cross_entropy as tce
        default = tce.GPU_FWD, tce.GPU_BWD, tce.GPU_NUM_WARPS
        for tile in args.tiles:
            tce.GPU_FWD, tce.GPU_BWD, tce.GPU_NUM_WARPS = (int(v) for v in tile.split("x"))
            ms = median_ms(lambda: fwd_bwd("triton", z, y, go), device, 5, 20)
            rows.append({"path": "triton", "tile": tile, "tokens": N, "vocab": V, "fwd_bwd_ms": ms})
            print(f"triton {tile:>16}: {ms:.3f} ms", flush=True)
        tce.GPU_FWD, tce.GPU_BWD, tce.GPU_NUM_WARPS = default
    if args.json:
        with open(args.json, "w") as f:
            name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
