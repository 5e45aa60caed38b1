"""The routed experts' weight gradient dW[e] = G_eᵀ X_e: our Triton kernel against ``torch._grouped_mm``.

    python benchmarks/grouped_wgrad.py [--tokens 32768] [--tiles 128x256x64x8x3 128x128x64x8x3 ...]
                                       [--json grouped_wgrad.json]

At bench-1B's MoE dims (E=128, k=8, ℓ=512, I=256; tokens × k rows, bf16, one GPU, sm_90+), for W13
(G = dGU [M, 2I], X = rows [M, ℓ]) and W2 (G = dY [M, ℓ], X = h [M, I]), on natural routing (top-k of
random logits) and skewed routing (a linear logit bias; max/mean printed):

* ``aten (autograd's)``: the K-grouped ``torch._grouped_mm(xᵀ, g)`` autograd forms, read transposed;
* ``aten + laid out as W``: the same made contiguous, as the parameter's gradient is stored;
* ``dense mm``: one GEMM of the same FLOPs over all rows (no grouping), the ceiling;
* ``ours <tile>``: ``kernels.grouped_wgrad`` at each (BM, BN, BK, warps, stages), checked against aten;
* ``W13+W2`` rows: both weights' gradients as the ``fused:1`` backward takes them, ``grouped_wgrad_pair`` (one
  launch) against two ``grouped_wgrad`` launches and the two dense GEMMs.

``--row-tile T`` pads each expert's group to a multiple of T rows (the expert-tiled products' layout, T = 64
for ``fused:1``), so M grows by the padding.

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


def _time(ways: dict, row: dict, flop: int, want: tuple) -> list[dict]:
    """Each way's CUDA-graph ms and TFLOP/s; ours checked against ``want`` (aten's dW, fp32), largest relative
    error over its outputs."""
    out = []
    for way, fn in ways.items():
        err = None
        if way.startswith("ours"):
            err = max(float((got.float() - w).abs().max() / w.abs().max()) for got, w in zip(fn(), want))
        ms = graph_ms(fn)
        out.append({**row, "way": way, "ms": ms, "tflops": flop / ms / 1e9 if ms else None, "rel_err": err})
        print(f"{row['routing']:>8} {row['max_over_mean']:5.2f} {row['weight']:>6} {way:>34} {ms:8.3f} ms "
              f"{flop / ms / 1e9:6.0f} TFLOP/s" + (f"  err {err:.1e}" if err is not None else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_moe_dims(ap, tokens=32768)
    ap.add_argument("--tiles", nargs="*", default=["x".join(map(str, triton_grouped_wgrad.GPU_TILES))],
                    metavar="BMxBNxBKxWARPSxSTAGES")
    ap.add_argument("--row-tile", type=int, default=1, help="pad each expert's rows to a multiple of this")
    ap.add_argument("--json", default="grouped_wgrad.json")
    args = ap.parse_args()
    E, k, ell, I = args.experts, args.topk, args.latent, args.width
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, bf16, E={E} k={k} ℓ={ell} I={I}, {args.tokens * k} rows, "
          f"padded per expert to {args.row_tile}")
    rows = []
    for routing, skew in (("natural", 0.0), ("skewed", 1.5)):
        counts = routed_counts(args.tokens, E, k, skew)
        imbalance = (counts.max() / counts.float().mean()).item()
        counts = (counts + args.row_tile - 1) // args.row_tile * args.row_tile
        offsets = counts.cumsum(0).to(torch.int32)
        M = int(offsets[-1])
        operands = {}
        for weight, O, C in (("W13", 2 * I, ell), ("W2", ell, I)):
            g = operands[weight, "g"] = torch.randn(M, O, device="cuda", dtype=torch.bfloat16)
            x = operands[weight, "x"] = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
            want = operands[weight, "want"] = torch._grouped_mm(x.t(), g, offs=offsets).transpose(-2, -1).float()
            ways = {"aten (autograd's)": lambda: torch._grouped_mm(x.t(), g, offs=offsets),
                    "aten + laid out as W": lambda: torch._grouped_mm(x.t(), g, offs=offsets).transpose(-2, -1).contiguous(),
                    "dense mm": lambda: g.t() @ x}
            for tile in args.tiles:
                t = tuple(int(v) for v in tile.split("x"))
                ways[f"ours {tile}"] = lambda t=t: (triton_grouped_wgrad.grouped_wgrad(g, x, offsets, t),)
            rows += _time(ways, {"routing": routing, "max_over_mean": imbalance, "weight": weight}, 2 * M * O * C,
                          (want,))
        args13 = operands["W13", "g"], operands["W13", "x"]
        args2 = operands["W2", "g"], operands["W2", "x"]
        ways = {"dense mm": lambda: (args13[0].t() @ args13[1], args2[0].t() @ args2[1])}
        for tile in args.tiles:
            t = tuple(int(v) for v in tile.split("x"))
            ways[f"ours two launches {tile}"] = lambda t=t: (triton_grouped_wgrad.grouped_wgrad(*args13, offsets, t),
                                                             triton_grouped_wgrad.grouped_wgrad(*args2, offsets, t))
            ways[f"ours pair {tile}"] = lambda t=t: triton_grouped_wgrad.grouped_wgrad_pair(*args13, *args2, offsets, t)
        rows += _time(ways, {"routing": routing, "max_over_mean": imbalance, "weight": "W13+W2"},
                      2 * M * (2 * I * ell + ell * I), (operands["W13", "want"], operands["W2", "want"]))
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "experts": E, "topk": k, "latent": ell, "width": I,
                   "tokens": args.tokens, "row_tile": args.row_tile, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
