"""Block AttnRes aggregation: the fused Triton kernels against the torch reference.

    python benchmarks/attn_res.py [--tokens 8192] [--dim 1024] [--sources 2 5] [--json out.json]

One process, one GPU, bench-1B shapes by default (2×4096 tokens, d = 1024, fp32 sources; S = 2 and
5 are a site early and late in bench-1B's 13 layers). For each S and backend ("triton": the
kernels; "torch": ``reference.attn_res_forward`` under autograd): forward and forward+backward
time (on CUDA the median of CUDA-graph replays, ``op_timing.graph_ms``: GPU time alone; the host's
autograd and launch overhead, which ``do_bench`` adds, set the pace at 8192 tokens and hid the kernels'
differences in the session-11 tile sweep; on CPU host time), the bytes an ideal pass moves (forward: S sources
read, out written; backward: g and S sources read, S gradients written; fp32) as GB/s, and the
memory autograd holds after the forward beyond the output and the inputs. Before timing, the kernel
must match the reference (out and dv_0 within 1e-5 of their largest magnitude).
``--norm`` times the whole site instead: the mix read through its RMSNorm into bf16 (as under autocast),
the kernels with the norm fused ("fused": ``attn_res_rms_norm``, the mix never stored) against the
AttnRes kernel followed by the RMSNorm kernel ("two kernels": the fp32 mix written and read back)
and the torch reference; ideal bytes count y and dy in bf16. ``--passed`` adds the fused site as the
model runs it ("fused, passed": ``attn_res_site`` passing all S sources on, each with a gradient from
later readers that its backward adds in the kernel; S more fp32 reads backward). ``--residual`` adds, to
those, the site as the model runs most of its sites: a bf16 branch b added to the last source, P + b, first by a
separate add ("passed + add") and then inside the kernels ("passed, residual": ``attn_res_site(...,
residual=b)``); their GB/s count the passed site's bytes only. ``--bwd-programs`` sweeps the backward's
programs per SM.
``--small`` (64 tokens, d 96) is a dry run that also works on CPU (Triton through its interpreter
when TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from kernels.attn_res import attn_res_aggregate, attn_res_rms_norm, attn_res_site, triton_attn_res  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from op_timing import graph_ms, held_mib, median_ms  # noqa: E402


def gpu_time_ms(fn, device: str, warmup: int, rep: int) -> float:
    """Median ms of ``fn``: its CUDA-graph replays on CUDA (``median_ms`` if it cannot be captured), host time on CPU."""
    ms = graph_ms(fn, rep) if device == "cuda" else None
    return median_ms(fn, device, warmup, rep) if ms is None else ms


NORM_EPS = 1e-6


PASSED = ("fused, passed", "passed + add", "passed, residual")  # the sites that pass every source on
RESIDUAL = PASSED[1:]  # the sites that add a branch to the last source


def site(backend: str, norm: bool):
    """The op timed: (sources, w, γ, norm weight[, branch]) → out, or (out, *passed sources) for the
    ``PASSED`` backends; with ``norm``, backend "fused", "two kernels", a ``PASSED`` one (Triton) or "torch"."""
    if backend in PASSED:
        def passed_site(sources, w, gain, nw, branch=None):
            if backend == "passed + add":
                sources = [*sources[:-1], sources[-1] + branch]
            out, passed = attn_res_site(sources, w, gain, nw, NORM_EPS, torch.bfloat16, len(sources), backend="triton",
                                        residual=branch if backend == "passed, residual" else None)
            return (out, *passed)
        return passed_site
    if not norm:
        return lambda sources, w, gain, nw: attn_res_aggregate(sources, w, gain, backend=backend)
    if backend == "two kernels":
        return lambda sources, w, gain, nw: rms_norm(attn_res_aggregate(sources, w, gain, backend="triton"), nw,
                                                     NORM_EPS, torch.bfloat16, backend="triton")
    kernel = "triton" if backend == "fused" else backend
    return lambda sources, w, gain, nw: attn_res_rms_norm(sources, w, gain, nw, NORM_EPS, torch.bfloat16,
                                                          backend=kernel)


def _output(out):
    """The site's output y (without the passed sources, which are its inputs)."""
    return out[0] if isinstance(out, tuple) else out


def measure(S: int, tokens: int, d: int, backend: str, norm: bool, device: str, warmup: int, rep: int) -> dict:
    g = torch.Generator(device=device).manual_seed(S)
    sources = [torch.randn(tokens, d, device=device, generator=g).requires_grad_() for _ in range(S)]
    w = (torch.randn(1, d, device=device, generator=g) * 3 / d**0.5).requires_grad_()
    gain = (torch.rand(d, device=device, generator=g) + 0.5).requires_grad_()
    nw = (torch.rand(d, device=device, generator=g) + 0.5).requires_grad_()
    go = torch.randn(tokens, d, device=device, generator=g, dtype=torch.bfloat16 if norm else torch.float32)
    branch = ([torch.randn(tokens, d, device=device, generator=g).to(torch.bfloat16).requires_grad_()]
              if backend in RESIDUAL else [])
    leaves = [*sources, w, gain] + ([nw] if norm else []) + branch
    op = site(backend, norm)

    def fwd():
        return op(sources, w, gain, nw, *branch)

    later = [torch.randn(tokens, d, device=device, generator=g) for _ in range(S)]  # the passed sources' gradients

    def fwd_bwd():
        out = fwd()
        if isinstance(out, tuple):
            torch.autograd.grad(out, leaves, (go, *later))
        else:
            torch.autograd.grad(out, leaves, go)

    held = held_mib(lambda: _output(fwd()), device)
    with torch.no_grad():
        t_fwd = gpu_time_ms(fwd, device, warmup, rep)
    t_fb = gpu_time_ms(fwd_bwd, device, warmup, rep)
    out_bytes = 2 if norm else 4
    passed_reads = S * 4 if backend in PASSED else 0
    fwd_bytes, bwd_bytes = (S * 4 + out_bytes) * tokens * d, (2 * S * 4 + passed_reads + out_bytes) * tokens * d
    return {"S": S, "backend": backend, "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb,
            "fwd_GBps": fwd_bytes / t_fwd / 1e6, "fwd_bwd_GBps": (fwd_bytes + bwd_bytes) / t_fb / 1e6,
            "held_MiB": held}


def check(S: int, tokens: int, d: int, norm: bool, device: str) -> None:
    """The kernels' out and dv_0 against the torch reference, before anything is timed (with ``norm``:
    the fused site's bf16 y within two bf16 roundings)."""
    g = torch.Generator(device=device).manual_seed(100 + S)
    sources = [torch.randn(tokens, d, device=device, generator=g) for _ in range(S)]
    w, gain = torch.randn(1, d, device=device, generator=g) * 3 / d**0.5, torch.rand(d, device=device) + 0.5
    nw = torch.rand(d, device=device) + 0.5
    go = torch.randn(tokens, d, device=device, generator=g)
    res = {}
    for backend in ("fused" if norm else "triton", "torch"):
        leaf = sources[0].clone().requires_grad_()
        out = site(backend, norm)([leaf, *sources[1:]], w, gain, nw)
        (dv0,) = torch.autograd.grad(out, leaf, go.to(out.dtype))
        res[backend != "torch"] = (out.detach().float(), dv0)
    for name, k, t, tol in zip(("out", "dv0"), res[True], res[False], (2.0**-7 if norm else 1e-5, 1e-5)):
        err = float((k - t).abs().max() / t.abs().max())
        assert err < tol, f"S={S}: the kernel's {name} is {err:.2g} from the reference"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--sources", type=int, nargs="+", default=[2, 5])
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--tiles", nargs="+", default=None, metavar="MxW[xD]",
                   help="GPU tiles to sweep, as tokens x warps per program [x features a chunk] (e.g. 4x8 8x4 "
                        "2x8x1024), each for both kernels; default: the kernels' own per-S choice "
                        "(kernels/attn_res/triton_attn_res.py gpu_tile)")
    p.add_argument("--norm", action="store_true", help="time the site with its RMSNorm: fused, two kernels, torch")
    p.add_argument("--passed", action="store_true", help="with --norm, also the site passing its sources on")
    p.add_argument("--residual", action="store_true",
                   help="with --norm --passed, also the passed site with a bf16 branch added to its last source")
    p.add_argument("--bwd-programs", type=int, nargs="+", default=[None], metavar="P",
                   help="backward programs per SM to sweep (default: the kernels' own)")
    p.add_argument("--small", action="store_true", help="64 tokens, d 96, 2 reps: a dry run")
    p.add_argument("--json", default="attn_res_bench.json")
    args = p.parse_args()
    if args.small:
        args.tokens, args.dim, args.warmup, args.rep = 64, 96, 1, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles] if args.tiles else [None]
    rows = []
    passed = list(PASSED if args.residual else PASSED[:1]) if args.passed else []
    kernels = (["fused", "two kernels"] + passed) if args.norm else ["triton"]
    for S in args.sources:
        rows.append(measure(S, args.tokens, args.dim, "torch", args.norm, device, args.warmup, args.rep))
        check(S, args.tokens, args.dim, args.norm, device)
        for backend in kernels:
            for tile in tiles:  # the kernels read the tile and the program count at each launch
                for programs in args.bwd_programs:
                    triton_attn_res.GPU_TILE_OVERRIDE = tile
                    triton_attn_res.GPU_BWD_PROGRAMS_OVERRIDE = programs
                    row = measure(S, args.tokens, args.dim, backend, args.norm, device, args.warmup, args.rep)
                    label = ("auto" if tile is None else "x".join(map(str, tile))) + (f"/{programs}" if programs else "")
                    rows.append({**row, "tile": label})
        triton_attn_res.GPU_TILE_OVERRIDE = triton_attn_res.GPU_BWD_PROGRAMS_OVERRIDE = None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    what = "site (AttnRes + RMSNorm → bf16)" if args.norm else "AttnRes aggregation"
    print(f"{what}, {args.tokens} tokens, d={args.dim}, fp32 sources, {name}")
    print(f"{'S':>2} {'backend':>22} {'fwd ms':>8} {'fwd GB/s':>9} {'f+b ms':>8} {'f+b GB/s':>9} "
          f"{'held MiB':>9} {'f+b speedup':>11}")
    for r in rows:
        torch_row = next(x for x in rows if x["S"] == r["S"] and x["backend"] == "torch")
        r["fwd_bwd_speedup_vs_torch"] = torch_row["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        held = "n/a" if r["held_MiB"] is None else f"{r['held_MiB']:.0f}"
        backend = r["backend"] + (f" {r['tile']}" if "tile" in r else "")
        print(f"{r['S']:>2} {backend:>22} {r['fwd_ms']:>8.3f} {r['fwd_GBps']:>9.0f} {r['fwd_bwd_ms']:>8.3f} "
              f"{r['fwd_bwd_GBps']:>9.0f} {held:>9} {r['fwd_bwd_speedup_vs_torch']:>10.2f}x")
    with open(args.json, "w") as f:
        json.dump({"device": name, "tokens": args.tokens, "dim": args.dim, "norm": args.norm, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
