"""KDA benchmark: kernels.kda (Triton) against fla-core 0.6.0 chunk_kda (safe gate).

    python benchmarks/kda.py                        # the four shapes of issue 3
    python benchmarks/kda.py --shapes 8x4096x32x128,1x32768x32x128v8 --json out.json
    python benchmarks/kda.py --sweep --warm-jobs 6  # accuracy + per-kernel times per config
    torchrun --nproc-per-node 2 benchmarks/kda.py --cp   # context parallelism (benchmarks/kda_cp.py)

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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # op_timing

from op_timing import kernel_ms  # noqa: E402

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
    if not inputs[0].is_cuda:
        return {}
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]

    def step():  # fresh .grad each time: no gradient-accumulation kernels in the profile
        for x in leaves:
            x.grad = None
        torch.autograd.backward(fn(*leaves, cu), do)
    return kernel_ms(step, iters, name_chars=60)


SWEEP = [  # overrides of kernels.kda.chunk.CONFIG (defaults first)
    dict(),
    dict(bwd_warps=4),                             # 2 CTAs per SM in the backward kernel
    dict(bwd_bv=16),                               # smaller V tile in the backward kernel
    dict(grad_prec="tf32x3"),                      # ~fp32 dg-feeding dots
    dict(prep_inv_prec="ieee"),                    # fp32 FMA merges in the inverse
    dict(seq_bv=64),                               # scans: V split in two at every shape
]
ACC_SHAPE = (2, 2048, 8, 128)   # accuracy gate of a swept config (the GPU test's shape)
ACC_LIMITS = {"o": 1e-2}        # every gradient: 2e-2 (tests/kernels/test_kda_kernels.py)


def accuracy(ours, dev):
    """Relative errors of o and every gradient against the fp32 chunked reference."""
    from kernels.kda.reference import kda_chunked
    B, T, H, D = ACC_SHAPE
    inputs = make(B, T, H, D, dev, seed=3)
    do = torch.randn(B, T, H, D, device=dev, generator=torch.Generator(device=dev).manual_seed(4))
    a = outputs_and_grads(ours, inputs, None, do.to(inputs[0].dtype))

    def ref(q, k, v, g, beta, A_log, dt_bias, cu):
        return kda_chunked(q, k, v, g, beta, A_log, dt_bias, lower_bound=-5.0,
                           use_qk_l2norm=True)[0]
    b = outputs_and_grads(ref, [x.float() for x in inputs], None, do)
    names = ["o", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"]
    return {n: rel(x, y) for n, x, y in zip(names, a, b)}


def passes(err):
    return all(e <= ACC_LIMITS.get(n, 2e-2) for n, e in err.items())


def warm_in_parallel(configs, jobs):
    """Compile every swept config in parallel subprocesses (tiny shapes, same Triton cache:
    set TRITON_CACHE_DIR), so the timing process finds them compiled."""
    import subprocess
    procs, t0 = [], time.time()
    for ov in configs:
        while len([p for p in procs if p.poll() is None]) >= jobs:
            time.sleep(0.5)
        procs.append(subprocess.Popen([sys.executable, __file__, "--warm", "--config",
                                       json.dumps(ov)]))
    rc = [p.wait() for p in procs]
    print(f"warmed {len(configs)} configs in {time.time() - t0:.0f} s, rc {rc}", flush=True)


def warm(ours, dev):
    for H, cu in ((8, None), (32, None), (32, [0, 100, 256])):
        inputs = make(1, 256, H, 128, dev)
        cu_t = torch.tensor(cu, device=dev) if cu else None
        outputs_and_grads(ours, inputs, cu_t, torch.randn_like(inputs[0]))
    torch.cuda.synchronize()


def sweep(ours, shapes, setup, dev, configs):
    """Accuracy and time of each override of chunk.CONFIG in configs; returns the rows and
    the fastest override (fwd+bwd at the first shape) that passes the accuracy gate, or None."""
    from kernels.kda import chunk
    out, best = [], None
    defaults = dict(chunk.CONFIG)
    for ov in configs:
        chunk.CONFIG.clear()
        chunk.CONFIG.update(defaults, **ov)
        try:
            err = accuracy(ours, dev)
            row = dict(config=ov, errors=err, passes=passes(err), times={})
            for s in shapes:
                _, inputs, cu, do = setup(s)
                prof = profile_kernels(ours, inputs, cu, do)
                t = bench_impl(ours, inputs, cu, do)
                row["times"][s] = dict(fwd_ms=t[0], fwdbwd_ms=t[1], kernels=prof)
                ks = {k.split("_kernel")[0][-12:]: round(v, 3) for k, v in prof.items()
                      if "kda_" in k}
                print(f"sweep {s} {ov} fwd {t[0]:.3f} fb {t[1]:.3f} {ks}", flush=True)
            print(f"sweep {ov} passes={row['passes']} "
                  f"errors {({n: round(e, 4) for n, e in err.items()})}", flush=True)
            out.append(row)
            t_fb = row["times"][shapes[0]]["fwdbwd_ms"]
            if row["passes"] and (best is None or t_fb < best[0]):
                best = (t_fb, ov)
        except Exception as e:  # keep sweeping
            print(f"sweep {ov} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    chunk.CONFIG.clear()
    chunk.CONFIG.update(defaults)
    return out, (best[1] if best else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json", default="kda_bench.json")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare outputs/grads with fla")
    ap.add_argument("--profile", action="store_true", help="per-kernel times")
    ap.add_argument("--sweep", action="store_true",
                    help="accuracy + time of each SWEEP config; the table then uses the "
                         "fastest config that passes the accuracy gate")
    ap.add_argument("--sweep-shapes", default="8x4096x32x128,1x8192x96x128")
    ap.add_argument("--sweep-configs", default="",
                    help="json list of CONFIG overrides to sweep instead of SWEEP")
    ap.add_argument("--warm-jobs", type=int, default=0,
                    help="compile the swept configs first in this many parallel processes")
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm-fla", action="store_true",
                    help="only run fla once per shape (compiles and autotunes into the Triton "
                         "cache; run it first when TRITON_CACHE_DIR is fresh)")
    ap.add_argument("--config", default="", help="json dict overriding chunk.CONFIG")
    ap.add_argument("--device", default="cuda", help="cpu = smoke test under TRITON_INTERPRET=1")
    ap.add_argument("--cp", action="store_true",
                    help="under torchrun: one document at CP=world size vs CP=1 (benchmarks/kda_cp.py)")
    ap.add_argument("--cp-shape", default="1x65536x32x128", help="BxTxHxD of the --cp document")
    args = ap.parse_args()
    if args.cp:
        from kda_cp import main as cp_main

        cp_main(args.cp_shape, args.json)
        return
    dev = args.device
    from kernels.kda import chunk
    if args.config:
        chunk.CONFIG.update(json.loads(args.config))
    ours = ours_fn()
    if args.warm:  # a --warm-jobs worker
        warm(ours, dev)
        return
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

    if args.warm_fla:
        for s in shapes:
            print(f"[{time.time() - t_start:6.1f}s] fla first call {s}", flush=True)
            _, inputs, cu, do = setup(s)
            outputs_and_grads(fla, inputs, cu, do)
            torch.cuda.synchronize()
        print(f"[{time.time() - t_start:6.1f}s] fla warm done", flush=True)
        return
    if args.sweep:
        configs = json.loads(args.sweep_configs) if args.sweep_configs else SWEEP
        if args.warm_jobs:
            warm_in_parallel([{**json.loads(args.config or "{}"), **ov} for ov in configs],
                             args.warm_jobs)
        sweep_rows, best = sweep(ours, args.sweep_shapes.split(","), setup, dev, configs)
        if best is None:
            print("!! no swept config passed the accuracy gate; the table uses the defaults",
                  flush=True)
        chunk.CONFIG.update(best or {})
        info["config"] = dict(chunk.CONFIG)
        print(f"[{time.time() - t_start:6.1f}s] table uses the fastest passing config: "
              f"{best} -> {chunk.CONFIG}", flush=True)
        print(hdr, flush=True)
        dump()
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
