"""KDA's causal short conv with document resets: the fused Triton kernels against the torch reference.

    python benchmarks/short_conv.py [--tokens 8192] [--channels 3072] [--width 4] [--json out.json]

One process, one GPU, bench-1B shapes by default (2×4096 tokens, C = 3·8·128 = 3072 channels of
q, k and v, W = 4, bf16 x, fp32 weight, documents of 1..2048 tokens packed into the rows). For each
backend ("triton": the kernels; "torch": ``reference.causal_conv_forward`` under autograd), with the
SiLU that follows the conv in KDA (fused in the kernels; ``--conv-only`` for the conv alone):
forward and forward+backward time (median of ``triton.testing.do_bench``), the bytes an ideal
pass moves (forward: x read, out written; backward: x and g read, dx written; bf16) as GB/s, and
the memory autograd holds after the forward beyond the output and the inputs. Before timing, the
kernel's out, dx and dweight must match the reference (within 1e-2 of their largest magnitude:
bf16 out and dx). ``--small`` (2×40 tokens, 200 channels) is a dry run that also works on CPU
(Triton through its interpreter when TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from kernels.short_conv import causal_conv_with_resets  # noqa: E402
from op_timing import held_mib, median_ms  # noqa: E402


def inputs(tokens: int, channels: int, width: int, device: str, seed: int):
    """x [2, tokens/2, C] bf16, weight [C, 1, W] fp32, packed positions [2, tokens/2], g like x."""
    g = torch.Generator().manual_seed(seed)
    T = tokens // 2
    rows = []
    for _ in range(2):
        pos = []
        while len(pos) < T:
            pos += range(max(1, int(torch.empty(()).uniform_(0, 11, generator=g).exp2())))
        rows.append(torch.tensor(pos[:T]))
    x = torch.randn(2, T, channels, generator=g).bfloat16()
    weight = torch.empty(channels, 1, width).uniform_(-0.5, 0.5, generator=g)
    go = torch.randn(2, T, channels, generator=g).bfloat16()
    return [t.to(device) for t in (x, weight, torch.stack(rows), go)]


def measure(x, weight, pos, go, backend: str, silu: bool, device: str, warmup: int, rep: int) -> dict:
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()

    def fwd():
        return causal_conv_with_resets(x, weight, pos, silu, backend=backend)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (x, weight), go)

    held = held_mib(fwd, device)
    with torch.no_grad():
        t_fwd = median_ms(fwd, device, warmup, rep)
    t_fb = median_ms(fwd_bwd, device, warmup, rep)
    size = x.numel() * x.element_size()
    return {"backend": backend, "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb, "fwd_GBps": 2 * size / t_fwd / 1e6,
            "fwd_bwd_GBps": 5 * size / t_fb / 1e6, "held_MiB": held}


def check(x, weight, pos, go, silu: bool) -> None:
    """The kernel's out, dx and dweight against the torch reference, before anything is timed."""
    res = {}
    for backend in ("triton", "torch"):
        xl, wl = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = causal_conv_with_resets(xl, wl, pos, silu, backend=backend)
        res[backend] = (out.detach(), *torch.autograd.grad(out, (xl, wl), go))
    for name, k, t in zip(("out", "dx", "dweight"), res["triton"], res["torch"]):
        err = float((k.float() - t.float()).abs().max() / t.float().abs().max())
        assert err < 1e-2, f"the kernel's {name} is {err:.2g} from the reference"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--channels", type=int, default=3072)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--small", action="store_true", help="2×40 tokens, 200 channels, 2 reps: a dry run")
    p.add_argument("--conv-only", action="store_true", help="the conv without the SiLU that follows it in KDA")
    p.add_argument("--json", default="short_conv_bench.json")
    args = p.parse_args()
    if args.small:
        args.tokens, args.channels, args.warmup, args.rep = 80, 200, 1, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, weight, pos, go = inputs(args.tokens, args.channels, args.width, device, seed=0)
    silu = not args.conv_only
    check(x, weight, pos, go, silu)
    rows = [measure(x, weight, pos, go, b, silu, device, args.warmup, args.rep) for b in ("torch", "triton")]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"short conv{' + SiLU' if silu else ''}, {args.tokens} tokens, C={args.channels}, W={args.width}, "
          f"bf16 x, {name}")
    print(f"{'backend':>7} {'fwd ms':>8} {'fwd GB/s':>9} {'f+b ms':>8} {'f+b GB/s':>9} {'held MiB':>9} "
          f"{'f+b speedup':>11}")
    for r in rows:
        r["fwd_bwd_speedup_vs_torch"] = rows[0]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        held = "n/a" if r["held_MiB"] is None else f"{r['held_MiB']:.0f}"
        print(f"{r['backend']:>7} {r['fwd_ms']:>8.3f} {r['fwd_GBps']:>9.0f} {r['fwd_bwd_ms']:>8.3f} "
              f"{r['fwd_bwd_GBps']:>9.0f} {held:>9} {r['fwd_bwd_speedup_vs_torch']:>10.2f}x")
    with open(args.json, "w") as f:
        json.dump({"device": name, "tokens": args.tokens, "channels": args.channels, "width": args.width,
                   "silu": silu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
