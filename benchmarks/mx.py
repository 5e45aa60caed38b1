"""MX quantize / dequantize / fake-quant throughput (GPU): kernels.mx (Triton) against the
device copy ceiling and torchao's MX emulation (``torchao.prototype.mx_formats``, eager).

    python benchmarks/mx.py                                   # default shapes, bf16 input
    python benchmarks/mx.py --shapes 8192x8192 --dtypes bf16,fp32 --formats e4m3,e2m1 \
        --rules floor,rceil --json mx.json
    python benchmarks/mx.py --sweep                           # launch configs, then the table

Bytes (the operator's own I/O, a floor on traffic):
* quantize: read N input elements, write N codes (1 byte FP8, 1/2 byte FP4) + N/32 scales;
* dequantize: read codes + scales, write N outputs in the input dtype;
* fake quant: read N inputs, write N outputs (same dtype).
GB/s = bytes / median time (triton.testing.do_bench). Ceiling: 4.2 TB/s device copy
(../shared/ANCHORS.md); a ``torch.copy_`` of the input measured in the same process is the
peer. torchao is timed in its default eager mode; where it imports, the table also gives the
fraction of elements whose dequantized value agrees with ours (same scale rule).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

COPY_TBPS = 4.2
DEFAULT_SHAPES = "8192x8192,32768x7168,16x3072x3584"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_shape(s: str):
    return tuple(int(v) for v in s.split("x"))


def bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # ms


def scaled_input(shape, dtype):
    """Normal data, each block of 32 scaled by 2^[-8, 8)."""
    x = torch.randn(shape, device="cuda", dtype=torch.float32)
    return (x * torch.exp2(torch.randint(-8, 8, (*shape[:-1], shape[-1] // 32, 1), device="cuda")
                           ).repeat_interleave(32, -1).reshape(shape)).to(dtype)


def torchao_fns(fmt: str, rule: str):
    """(quantize, dequantize) closures over torchao's emulation, or a reason string."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception as e:  # noqa: BLE001 - report any import failure
        return f"torchao unavailable: {type(e).__name__}: {str(e)[:80]}"
    elem = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
            "e2m1": torch.float4_e2m1fn_x2}[fmt]
    mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rule]

    def q(x):
        return to_mx(x, elem, 32, mode)

    def dq(scale_data, dtype):
        scale, data = scale_data
        return to_dtype(data, scale, elem, 32, dtype)

    return q, dq


def run_case(shape, dtype_name, fmt, rule, results, check_torchao=True):
    from kernels.mx import get_format, mx_dequantize, mx_fake_quantize, mx_quantize
    f = get_format(fmt)
    dtype = DTYPES[dtype_name]
    x = scaled_input(shape, dtype)
    n = x.numel()
    in_b = x.element_size()
    code_b = 0.5 if f.packed else 1.0
    q_bytes = n * in_b + n * code_b + n / 32
    dq_bytes = n * code_b + n / 32 + n * in_b
    fq_bytes = 2 * n * in_b

    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x))
    data, scale = mx_quantize(x, fmt, rule)
    t_q = bench(lambda: mx_quantize(x, fmt, rule))
    t_dq = bench(lambda: mx_dequantize(data, scale, fmt, dtype=dtype))
    t_fq = bench(lambda: mx_fake_quantize(x, fmt, rule))
    row = {
        "shape": "x".join(map(str, shape)), "dtype": dtype_name, "fmt": fmt, "rule": rule,
        "copy_GBps": 2 * n * in_b / t_copy / 1e6,
        "quant_ms": t_q, "quant_GBps": q_bytes / t_q / 1e6,
        "dequant_ms": t_dq, "dequant_GBps": dq_bytes / t_dq / 1e6,
        "fake_ms": t_fq, "fake_GBps": fq_bytes / t_fq / 1e6,
    }
    row["quant_pct_ceiling"] = 100 * row["quant_GBps"] / (COPY_TBPS * 1e3)
    row["quant_pct_copy"] = 100 * row["quant_GBps"] / row["copy_GBps"]
    row["dequant_pct_copy"] = 100 * row["dequant_GBps"] / row["copy_GBps"]
    ao = torchao_fns(fmt, rule) if check_torchao else "skipped"
    if isinstance(ao, str):
        row["torchao"] = ao
    else:
        q, dq = ao
        try:
            sd = q(x)
            t_aq = bench(lambda: q(x))
            t_adq = bench(lambda: dq(sd, dtype))
            row["torchao_quant_ms"] = t_aq
            row["torchao_quant_GBps"] = q_bytes / t_aq / 1e6
            row["torchao_dequant_ms"] = t_adq
            row["torchao_dequant_GBps"] = dq_bytes / t_adq / 1e6
            ours = mx_dequantize(data, scale, fmt, dtype=torch.float32)
            theirs = dq(sd, torch.float32).reshape(ours.shape)
            same = (ours == theirs) | (torch.isnan(ours) & torch.isnan(theirs))
            row["torchao_value_agree"] = same.float().mean().item()
        except Exception as e:  # noqa: BLE001
            row["torchao"] = f"torchao failed: {type(e).__name__}: {str(e)[:80]}"
    results.append(row)
    del x, y, data, scale
    torch.cuda.empty_cache()
    return row


# launch configs (blocks of 32 per program, warps) the sweep tries
SWEEP_CONFIGS = [(128, 4), (128, 8), (256, 4), (256, 8), (512, 8)]


def sweep(shape, dtype_names, formats, configs=SWEEP_CONFIGS):
    """The kernels' launch configs, quantize and dequantize, each beside a copy of the same input
    measured in this process. Sets the best config for the table."""
    from kernels.mx import get_format, mx_quantize
    from kernels.mx import triton_mx
    out = []
    for dt in dtype_names:
        x = scaled_input(shape, DTYPES[dt])
        n, in_b = x.numel(), x.element_size()
        y = torch.empty_like(x)
        copy = 2 * n * in_b / bench(lambda: y.copy_(x)) / 1e6
        for fmt in formats:
            f = get_format(fmt)
            data, scale = mx_quantize(x, fmt, "rceil")
            codes = data.view(torch.uint8)
            code_b = 0.5 if f.packed else 1.0
            nbytes = n * in_b + n * code_b + n / 32  # same for both ops
            for op in ("quantize", "dequantize"):
                if op == "quantize":
                    def fn():
                        return triton_mx.quantize(x, f, "rceil")
                else:
                    def fn():
                        return (triton_mx.dequantize(codes, scale, f, shape[-1], x.dtype),)
                saved, first = triton_mx.GPU_CONFIG[op], None
                for bb, warps in configs:
                    triton_mx.GPU_CONFIG[op] = (bb, warps)
                    got = fn()
                    first = first or got
                    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                               for a, b in zip(got, first))
                    t = bench(fn)
                    gbps = nbytes / t / 1e6
                    out.append({"dtype": dt, "fmt": fmt, "op": op, "blocks": bb, "warps": warps,
                                "ms": t, "GBps": gbps, "copy_GBps": copy,
                                "pct_copy": 100 * gbps / copy, "bits_equal_first": same})
                triton_mx.GPU_CONFIG[op] = saved
        del x, y
        torch.cuda.empty_cache()
    print(f"\nsweep {'x'.join(map(str, shape))}, rceil (GB/s of operator I/O; copy measured "
          f"beside it; 'same' = bits equal to the first config's output)")
    print(f"{'in':>4} {'fmt':>4} {'op':>10} {'blocks':>6} {'warps':>5} | "
          f"{'us':>7} {'GB/s':>6} {'copy':>6} {'%copy':>6} same")
    for r in out:
        print(f"{r['dtype']:>4} {r['fmt']:>4} {r['op']:>10} {r['blocks']:6d} "
              f"{r['warps']:5d} | {r['ms'] * 1e3:7.1f} {r['GBps']:6.0f} {r['copy_GBps']:6.0f} "
              f"{r['pct_copy']:6.1f} {r['bits_equal_first']}")
    # one config per op for the table: the best worst case (% of copy) over dtypes and formats
    for op in ("quantize", "dequantize"):
        score = {}
        for r in out:
            if r["op"] == op:
                c = (r["blocks"], r["warps"])
                score[c] = min(score.get(c, 1e9), r["pct_copy"])
        triton_mx.GPU_CONFIG[op] = max(score, key=score.get)
    print(f"using {triton_mx.GPU_CONFIG} for the table")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--formats", default="e4m3,e5m2,e2m1")
    ap.add_argument("--rules", default="rceil")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tune launch configs first")
    ap.add_argument("--configs", default=",".join(f"{b}x{w}" for b, w in SWEEP_CONFIGS),
                    help="the sweep's launch configs, BLOCKSxWARPS,... (blocks of 32 per program)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "benchmarks/mx.py needs a CUDA GPU"
    gpu = torch.cuda.get_device_name()
    results, sweeps = [], []
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    if args.sweep:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
        sweeps = sweep(shapes[0], args.dtypes.split(","), args.formats.split(","), configs)
    for shape in shapes:
        for dt in args.dtypes.split(","):
            for fmt in args.formats.split(","):
                for rule in args.rules.split(","):
                    run_case(shape, dt, fmt, rule, results, not args.no_torchao)
    import triton
    print(f"\nMX kernels on {gpu} (torch {torch.__version__}, triton {triton.__version__}); "
          f"GB/s of operator I/O; ceiling {COPY_TBPS} TB/s copy")
    hdr = (f"{'shape':>16} {'in':>4} {'fmt':>4} {'rule':>5} | {'copy':>5} | {'quant':>5} "
           f"{'%ceil':>5} {'%copy':>5} | {'dequant':>7} {'%copy':>5} | {'fake':>5} | {'ao q':>5} "
           f"{'ao dq':>5} {'agree':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        ao_q = f"{r['torchao_quant_GBps']:5.0f}" if "torchao_quant_GBps" in r else "  n/a"
        ao_dq = f"{r['torchao_dequant_GBps']:5.0f}" if "torchao_dequant_GBps" in r else "  n/a"
        agree = f"{100 * r['torchao_value_agree']:5.1f}%" if "torchao_value_agree" in r else "   n/a"
        print(f"{r['shape']:>16} {r['dtype']:>4} {r['fmt']:>4} {r['rule']:>5} | "
              f"{r['copy_GBps']:5.0f} | {r['quant_GBps']:5.0f} {r['quant_pct_ceiling']:5.1f} "
              f"{r['quant_pct_copy']:5.1f} | {r['dequant_GBps']:7.0f} "
              f"{r['dequant_pct_copy']:5.1f} | {r['fake_GBps']:5.0f} | {ao_q} {ao_dq} {agree}")
    notes = {r.get("torchao") for r in results if r.get("torchao")}
    for n in notes:
        print("note:", n)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                       "copy_ceiling_TBps": COPY_TBPS, "results": results, "sweep": sweeps,
                       "launch_config": dict(__import__("kernels.mx.triton_mx",
                                                        fromlist=["x"]).GPU_CONFIG)},
                      fh, indent=1)


if __name__ == "__main__":
    main()
