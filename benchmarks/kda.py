"""KDA benchmark: kernels.kda (Triton) against fla-core 0.6.0 chunk_kda (safe gate).

    python benchmarks/kda.py                        # the four shapes of issue 3
    python benchmarks/kda.py --shapes 8x4096x32x128,1x32768x32x128v8 --json out.json
    python benchmarks/kda.py --sweep                # per-kernel times for launch configs

A shape is BxTxHxD; a trailing ``vN`` packs B*T tokens as N documents of uneven length
(B must be 1, ``cu_seqlens``).  Inputs are bf16, gate/L2 norm/beta sigmoid in the kernel,
lower bound -5.  Times are medians of triton.testing.do_bench (L2 flushed per rep).

Counting conventions (stated so the figures can be compared):
* FLOPs: the forward per head per token is 6D^2 + 3CD + C^2 with C = 64 (the Kimi Linear
  count, as in ../shared/ANCHORS.md), whatever chunk size a kernel uses; fwd+bwd = 3x fwd.
* Bytes: the operator's own I/O in bf16, a floor on traffic: forward reads q, k, v, g, beta
  and writes o; the backward reads q, k, v, g, beta, do and writes dq, dk, dv, dg, dbeta.
* Ceilings (ANCHORS.md, this H200): 694 TFLOP/s bf16 GEMM, 4.2 TB/s device copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

PEAK_TFLOPS = 694.0
PEAK_TBPS = 4.2
DEFAULT_SHAPES = "8x4096x32x128,2x16384x32x128,1x8192x96x128,1x32768x32x128v8"


def parse_shape(s):
    docs = None
    if "v" in s:
        s, d = s.split("v")
        docs = int(d)
    B, T, H, D = (int(x) for x in s.split("x"))
    return B, T, H, D, docs


def uneven_cu(T, n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g) + 0.25          # lengths vary by up to ~5x
    lens = (w / w.sum() * T).floor().long().clamp_min(1)
    lens[-1] = T - lens[:-1].sum()
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lens.cumsum(0)
    return cu.to(device), cu


def make(B, T, H, D, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        return torch.randn(*s, generator=g).to(device=device, dtype=dt)

    q, k, v, gg = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    beta = r(B, T, H)
    A_log = (torch.rand(H, generator=g) * 0.6 - 0.3).to(device)
    dt_bias = (torch.randn(H * D, generator=g) * 0.5).to(device)
    return q, k, v, gg, beta, A_log, dt_bias


def flops(B, T, H, D, C=64):
    fwd = B * T * H * (6 * D * D + 3 * C * D + C * C)
    return fwd, 3 * fwd


def io_bytes(B, T, H, D):
    tok = B * T * H
    fwd = tok * (5 * D * 2 + 2)
    bwd = tok * (9 * D * 2 + 2 * 2)
    return fwd, fwd + bwd


def ours_fn():
    from kernels.kda.chunk import kda_triton

    def f(q, k, v, g, beta, A_log, dt_bias, cu):
        return kda_triton(q, k, v, g, beta, A_log, dt_bias, lower_bound=-5.0,
                          cu_seqlens=cu, use_qk_l2norm=True, validate=False)[0]
    return f


def fla_fn():
    from fla.ops.kda import chunk_kda

    def f(q, k, v, g, beta, A_log, dt_bias, cu):
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                         cu_seqlens=cu)[0]
    return f


def _cpu_bench(f, warmup=0, rep=0, grad_to_none=None):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def bench_impl(fn, inputs, cu, do):
    from triton.testing import do_bench
    if inputs[0].device.type == "cpu":  # --device cpu smoke test (interpreter)
        do_bench = _cpu_bench
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    with torch.no_grad():
        t_fwd = do_bench(lambda: fn(*inputs, cu), warmup=25, rep=100)

    def fb():
        o = fn(*leaves, cu)
        torch.autograd.backward(o, do)
    t_fb = do_bench(fb, warmup=25, rep=100, grad_to_none=leaves)
    return t_fwd, t_fb


def outputs_and_grads(fn, inputs, cu, do):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    o = fn(*leaves, cu)
    grads = torch.autograd.grad(o, leaves, do)
    return [o] + list(grads)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def profile_kernels(fn, inputs, cu, do, iters=5):
    """Per-kernel CUDA time (ms per fwd+bwd), via torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    for _ in range(2):
        torch.autograd.backward(fn(*leaves, cu), do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.backward(fn(*leaves, cu), do)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0:
            out[e.key[:60]] = t / 1e3 / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


SWEEP = [  # overrides of kernels.kda.chunk.CONFIG (defaults first)
    dict(),
    dict(grad_prec="bf16"),                        # one bf16 pass for the dg-feeding dots
    dict(inv_prec="tf32x3"),                       # tensor-core inverse merges
    dict(prep_warps=8),
    dict(seq_bv=32),                               # more scan programs at small B*H
    dict(seq_bv=128, fwd_warps=8, bwd_h_warps=8),  # fewer re-reads of the chunk tiles
]


def sweep(ours, inputs, cu, do, s):
    """Per-kernel times for each SWEEP override of chunk.CONFIG at one shape."""
    from kernels.kda import chunk
    out = []
    for ov in SWEEP:
        saved = dict(chunk.CONFIG)
        chunk.CONFIG.update(ov)
        try:
            prof = profile_kernels(ours, inputs, cu, do)
            t = bench_impl(ours, inputs, cu, do)
            out.append(dict(shape=s, config=dict(chunk.CONFIG), fwd_ms=t[0], fwdbwd_ms=t[1],
                            kernels=prof))
            ks = {k.split("_kernel")[0][-12:]: round(v, 3) for k, v in prof.items()
                  if "kda_" in k}
            print(f"sweep {s} {ov} fwd {t[0]:.3f} fb {t[1]:.3f} {ks}", flush=True)
        except Exception as e:  # keep sweeping
            print(f"sweep {s} {ov} FAILED {type(e).__name__}: {str(e)[:200]}")
        chunk.CONFIG.clear()
        chunk.CONFIG.update(saved)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json", default="kda_bench.json")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare outputs/grads with fla")
    ap.add_argument("--profile", action="store_true", help="per-kernel times")
    ap.add_argument("--sweep", action="store_true", help="per-kernel times per launch config")
    ap.add_argument("--sweep-shapes", default="8x4096x32x128,1x8192x96x128")
    ap.add_argument("--config", default="", help="json dict overriding chunk.CONFIG")
    ap.add_argument("--device", default="cuda", help="cpu = smoke test under TRITON_INTERPRET=1")
    args = ap.parse_args()
    dev = args.device
    from kernels.kda import chunk
    if args.config:
        chunk.CONFIG.update(json.loads(args.config))
    ours = ours_fn()
    fla = None
    if not args.no_fla:
        try:
            fla = fla_fn()
        except ImportError as e:
            print(f"!! fla-core not importable ({e}); timing ours only")
    info = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                triton=__import__("triton").__version__, config=dict(chunk.CONFIG),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    rows, sweep_rows, checks = [], [], []
    t_start = time.time()
    print(info, flush=True)
    hdr = (f"{'shape':<20}{'impl':<6}{'fwd ms':>9}{'f+b ms':>9}{'f+b Mtok/s':>11}"
           f"{'fwd TF/s':>9}{'f+b TF/s':>9}{'%peak':>6}{'f+b GB/s':>9}{'%bw':>5}"
           f"{'x fla fwd':>10}{'x fla f+b':>10}")

    def line(r):
        return (f"{r['shape']:<20}{r['impl']:<6}{r['fwd_ms']:9.3f}{r['fwdbwd_ms']:9.3f}"
                f"{r['fwdbwd_Mtok_s']:11.2f}{r['fwd_TFLOPs']:9.1f}{r['fwdbwd_TFLOPs']:9.1f}"
                f"{100 * r['fwdbwd_TFLOPs'] / PEAK_TFLOPS:6.1f}{r['fwdbwd_GBs']:9.0f}"
                f"{100 * r['fwdbwd_GBs'] / 1e3 / PEAK_TBPS:5.1f}"
                f"{r.get('fwd_ratio_vs_fla', float('nan')):10.2f}"
                f"{r.get('fwdbwd_ratio_vs_fla', float('nan')):10.2f}")
    print(hdr, flush=True)
    shapes = args.shapes.split(",")

    def setup(s):
        B, T, H, D, docs = parse_shape(s)
        inputs = make(B, T, H, D, dev)
        cu = uneven_cu(T, docs, dev)[0] if docs else None
        do = torch.randn(B, T, H, D, device=dev, dtype=inputs[0].dtype,
                         generator=torch.Generator(device=dev).manual_seed(1))
        return (B, T, H, D, docs), inputs, cu, do

    def dump():  # incremental, in case the run is cut short
        with open(args.json, "w") as fh:
            json.dump(dict(info=info, rows=rows, checks=checks, sweep=sweep_rows), fh, indent=1)

    # Ours on every shape first, then fla on every shape (fla autotunes on its first call per
    # shape class, which can take minutes on a fresh machine): a run cut short still has ours.
    for name, fn in (("ours", ours), ("fla", fla)):
        if fn is None:
            continue
        for s in shapes:
            (B, T, H, D, docs), inputs, cu, do = setup(s)
            fF, fFB = flops(B, T, H, D)
            bF, bFB = io_bytes(B, T, H, D)
            print(f"[{time.time() - t_start:6.1f}s] timing {name} {s}", flush=True)
            if name == "ours" and args.sweep and s in args.sweep_shapes.split(","):
                sweep_rows.extend(sweep(ours, inputs, cu, do, s))
            t_f, t_fb = bench_impl(fn, inputs, cu, do)
            row = dict(shape=s, impl=name, B=B, T=T, H=H, D=D, docs=docs, fwd_ms=t_f,
                       fwdbwd_ms=t_fb, fwd_Mtok_s=B * T / t_f / 1e3,
                       fwdbwd_Mtok_s=B * T / t_fb / 1e3,
                       fwd_TFLOPs=fF / t_f / 1e9, fwdbwd_TFLOPs=fFB / t_fb / 1e9,
                       fwd_GBs=bF / t_f / 1e6, fwdbwd_GBs=bFB / t_fb / 1e6)
            if args.profile and name == "ours":
                row["kernels"] = profile_kernels(fn, inputs, cu, do)
                print("kernels", s, {k: round(v, 3) for k, v in row["kernels"].items()},
                      flush=True)
            mine = [r for r in rows if r["impl"] == "ours" and r["shape"] == s]
            if name == "fla" and mine:
                mine[0]["fwd_ratio_vs_fla"] = t_f / mine[0]["fwd_ms"]
                mine[0]["fwdbwd_ratio_vs_fla"] = t_fb / mine[0]["fwdbwd_ms"]
                print(line(mine[0]), flush=True)
            rows.append(row)
            print(line(row), flush=True)
            del inputs, do
            if dev == "cuda":
                torch.cuda.empty_cache()
            dump()
    if args.check and fla is not None:
        for s in shapes:
            _, inputs, cu, do = setup(s)
            a = outputs_and_grads(ours, inputs, cu, do)
            b = outputs_and_grads(fla, inputs, cu, do)
            names = ["o", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"]
            c = {n: round(rel(x, y), 5) for n, x, y in zip(names, a, b)}
            c["shape"] = s
            checks.append(c)
            print("ours vs fla rel diff", s, c, flush=True)
            del a, b, inputs, do
            dump()
    print(f"\nKDA on {info['gpu']} (torch {info['torch']}, triton {info['triton']}); bf16, "
          f"D=K=V, safe gate lb=-5; ceilings {PEAK_TFLOPS} TFLOP/s, {PEAK_TBPS} TB/s")
    print(hdr)
    for r in rows:
        print(line(r))
    dump()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
