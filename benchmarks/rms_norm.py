"""RMSNorm: the fused Triton kernels against the torch reference, at the bench-1B step's shapes.

    python benchmarks/rms_norm.py [--tokens 8192] [--block-elems 2048 4096 8192 16384] [--json out.json]

One process, one GPU. Cases (the norms of one bench-1B step, 2×4096 tokens):

* ``layer``: x [N, 1024] fp32 (the AttnRes mix), y bf16 (``autocast_output``: read only by GEMMs);
* ``moe_in``: x [N, 1024] fp32, y fp32 (the MoE layers' input: the router reads it in fp32);
* ``kda_out``: o [N·8, 128] bf16 with the gate logits, y bf16 (KDA's gated output norm);
* ``latent``: u [N, 512] bf16, y bf16 (the MoE latent norm).

For each backend ("triton": the kernels; "torch": ``reference.rms_norm`` under autograd, with the
torch ops KDA used before the fused gate: norm, cast, sigmoid, multiply, cast): forward and
forward+backward time (median of ``triton.testing.do_bench``), the kernel launches of one
forward+backward (torch profiler), and the ratio torch/triton. Before timing, the kernel's y and
gradients must match the reference (within 1e-2 of their largest magnitude). ``--small`` (64
tokens) is a dry run that also works on CPU (Triton through its interpreter when TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from kernels.rms_norm import rms_norm  # noqa: E402
from op_timing import graph_ms, median_ms  # noqa: E402

EPS = 1e-5
# name: (rows per token, width, x dtype, y dtype, gated)
CASES = {"layer": (1, 1024, torch.float32, torch.bfloat16, False),
         "moe_in": (1, 1024, torch.float32, torch.float32, False),
         "kda_out": (8, 128, torch.bfloat16, torch.bfloat16, True),
         "latent": (1, 512, torch.bfloat16, torch.bfloat16, False)}


def inputs(case: str, tokens: int, device: str, seed: int):
    rows, n, xdt, ydt, gated = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens * rows, n, generator=g).to(xdt)
    w = (1 + 0.1 * torch.randn(n, generator=g))
    gate = torch.randn(tokens * rows, n, generator=g).to(xdt) if gated else None
    dy = torch.randn(tokens * rows, n, generator=g).to(ydt)
    return [None if t is None else t.to(device) for t in (x, w, gate, dy)], ydt


def forward(x, w, gate, ydt, backend: str):
    """The op as the model calls it; "torch" without the fused gate (the ops it replaced)."""
    if backend == "triton":
        return rms_norm(x, w, EPS, ydt, gate=gate, backend="triton")
    y = rms_norm(x, w, EPS, None if gate is not None else ydt, backend="torch")
    return y if gate is None else (y.float() * torch.sigmoid(gate.float())).to(ydt)


def leaves(x, w, gate):
    return [t.clone().requires_grad_() for t in (x, w, gate) if t is not None]


def call(ls, gated, ydt, backend):
    x, w, gate = (ls + [None])[:3] if gated else (ls[0], ls[1], None)
    return forward(x, w, gate, ydt, backend)


def launches(fn) -> int | None:
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(case: str, tokens: int, device: str, warmup: int, rep: int) -> dict:
    (x, w, gate, dy), ydt = inputs(case, tokens, device, seed=0)
    gated = gate is not None
    out = {}
    for backend in ("triton", "torch"):
        ls = leaves(x, w, gate)
        y = call(ls, gated, ydt, backend)
        out[backend] = (y.detach(), *torch.autograd.grad(y, ls, dy))
    for name, k, t in zip(("y", "dx", "dw", "dgate"), out["triton"], out["torch"]):
        err = float((k.float() - t.float()).abs().max() / t.float().abs().max())
        assert err < 1e-2, f"{case}: the kernel's {name} is {err:.2g} from the reference"
    row = {"case": case, "shape": [tokens * CASES[case][0], CASES[case][1]], "x": str(x.dtype), "y": str(ydt),
           "gated": gated}
    for backend in ("triton", "torch"):
        ls = leaves(x, w, gate)

        def fwd():
            return call(ls, gated, ydt, backend)

        def fwd_bwd():
            torch.autograd.grad(fwd(), ls, dy)

        with torch.no_grad():
            row[f"{backend}_fwd_ms"] = median_ms(fwd, device, warmup, rep)
        row[f"{backend}_fwd_bwd_ms"] = median_ms(fwd_bwd, device, warmup, rep)
        row[f"{backend}_launches"] = launches(fwd_bwd)
    row["torch_over_triton"] = row["torch_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
    return row


def sweep(tokens: int, device: str, block_elems: list[int]) -> list[dict]:
    """The Triton fwd+bwd of every case at each ``GPU_BLOCK_ELEMS`` (elements of a program's tile), timed as
    CUDA-graph replays (GPU time alone; ``do_bench`` above includes the host wherever it sets the pace)."""
    from kernels.rms_norm import triton_rms_norm

    default, rows = triton_rms_norm.GPU_BLOCK_ELEMS, []
    for case in CASES:
        (x, w, gate, dy), ydt = inputs(case, tokens, device, seed=0)
        ls = leaves(x, w, gate)
        for elems in block_elems:  # the kernels read the tile at each launch
            triton_rms_norm.GPU_BLOCK_ELEMS = elems
            ms = graph_ms(lambda: torch.autograd.grad(call(ls, gate is not None, ydt, "triton"), ls, dy))
            rows.append({"case": case, "block_elems": elems, "fwd_bwd_graph_ms": ms})
            print(f"{case:>8} tile {elems:>6} elements: {ms if ms is None else f'{ms:.3f} ms'}", flush=True)
    triton_rms_norm.GPU_BLOCK_ELEMS = default
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--small", action="store_true", help="64 tokens, a dry run (also on CPU)")
    p.add_argument("--block-elems", type=int, nargs="*", default=[], metavar="N",
                   help="also time the kernels at these tiles (GPU_BLOCK_ELEMS), as CUDA-graph replays (GPU only)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, warmup, rep = (64, 1, 3) if args.small else (args.tokens, 25, 200)
    rows = [measure(c, tokens, device, warmup, rep) for c in CASES]
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"RMSNorm fwd+bwd, {gpu}, {tokens} tokens (ms; launches per fwd+bwd)")
    print(f"{'case':>8} {'shape':>12} {'x':>5} {'y':>5} | {'triton':>7} {'torch':>7} {'ratio':>6} | "
          f"{'launches':>9}")
    short = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    for r in rows:
        x, y = (short[getattr(torch, s.split('.')[-1])] for s in (r["x"], r["y"]))
        print(f"{r['case']:>8} {'x'.join(map(str, r['shape'])):>12} {x:>5} {y:>5} | {r['triton_fwd_bwd_ms']:7.3f} "
              f"{r['torch_fwd_bwd_ms']:7.3f} {r['torch_over_triton']:6.2f} | "
              f"{r['triton_launches']} / {r['torch_launches']}")
    tiles = sweep(tokens, device, args.block_elems) if args.block_elems and device == "cuda" else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "tokens": tokens, "rows": rows, "tiles": tiles}, f,
                      indent=2)


if __name__ == "__main__":
    main()
