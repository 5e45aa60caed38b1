"""The routed experts' weight gradient dW[e] = G_eᵀ X_e: our Triton kernel against ``torch._grouped_mm``.

    python benchmarks/grouped_wgrad.py [--tokens 32768] [--tiles 128x256x64x8x3 128x128x64x8x3 ...]
                                       [--json grouped_wgrad.json]

At bench-1B's MoE dims (E=128, k=8, ℓ=512, I=256; tokens × k rows, bf16, one GPU, sm_90+), for W13
(G = dGU [M, 2I], X = rows [M, ℓ]) and W2 (G = dY [M, ℓ], X = h [M, I]), on natural routing (top-k of
random logits) and skewed routing (a linear logit bias; max/mean printed):

* ``aten (autograd's)``: the K-grouped ``torch._grouped_mm(xᵀ, g)`` autograd forms, read transposed;
* ``aten + laid out as W``: the same made contiguous, as the parameter's gradient is stored;
* ``dense mm``: one GEMM of the same FLOPs over all rows (no grouping), the ceiling;
* ``ours <tile>``: ``kernels.grouped_wgrad`` at each (BM, BN, BK, warps, stages), checked against aten.

Each is captured in a CUDA graph and its replays timed (``op_timing.graph_ms``); ms and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from kernels.grouped_wgrad import triton_grouped_wgrad  # noqa: E402
from moe_shapes import add_moe_dims  # noqa: E402
from op_timing import graph_ms  # noqa: E402


def routed_counts(tokens: int, experts: int, k: int, skew: float) -> torch.Tensor:
    """Rows per expert of top-k routing over random logits plus ``skew`` · a ramp over the experts."""
    logits = torch.randn(tokens, experts, device="cuda") + skew * torch.linspace(0, 1, experts, device="cuda")
    return torch.bincount(logits.topk(k, dim=1).indices.flatten(), minlength=experts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_moe_dims(ap, tokens=32768)
    ap.add_argument("--tiles", nargs="*", default=["x".join(map(str, triton_grouped_wgrad.GPU_TILES))],
                    metavar="BMxBNxBKxWARPSxSTAGES")
    ap.add_argument("--json", default="grouped_wgrad.json")
    args = ap.parse_args()
    E, k, ell, I = args.experts, args.topk, args.latent, args.width
    M = args.tokens * k
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, bf16, E={E} k={k} ℓ={ell} I={I}, {M} rows")
    rows = []
    for routing, skew in (("natural", 0.0), ("skewed", 1.5)):
        counts = routed_counts(args.tokens, E, k, skew)
        offsets = counts.cumsum(0).to(torch.int32)
        imbalance = (counts.max() / counts.float().mean()).item()
        for weight, O, C in (("W13", 2 * I, ell), ("W2", ell, I)):
            g = torch.randn(M, O, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
            flop = 2 * M * O * C
            want = torch._grouped_mm(x.t(), g, offs=offsets).transpose(-2, -1).float()
            ways = {"aten (autograd's)": lambda: torch._grouped_mm(x.t(), g, offs=offsets),
                    "aten + laid out as W": lambda: torch._grouped_mm(x.t(), g, offs=offsets).transpose(-2, -1).contiguous(),
                    "dense mm": lambda: g.t() @ x}
            for tile in args.tiles:
                t = tuple(int(v) for v in tile.split("x"))
                ways[f"ours {tile}"] = lambda t=t: triton_grouped_wgrad.grouped_wgrad(g, x, offsets, t)
            for way, fn in ways.items():
                err = None
                if way.startswith("ours"):
                    err = float((fn().float() - want).abs().max() / want.abs().max())
                ms = graph_ms(fn)
                rows.append({"routing": routing, "max_over_mean": imbalance, "weight": weight, "way": way, "ms": ms,
                             "tflops": flop / ms / 1e9 if ms else None, "rel_err": err})
                print(f"{routing:>8} {imbalance:5.2f} {weight:>4} {way:>26} {ms:8.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s"
                      + (f"  err {err:.1e}" if err is not None else ""), flush=True)
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "experts": E, "topk": k, "latent": ell, "width": I,
                   "rows_total": M, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
