"""Optimizer step time on k3_bench_1b's parameters: per-head Muon, whole-matrix Muon, fused AdamW.

    python benchmarks/muon.py [--steps 20] [--warmup 3] [--json out.json] [--no-triton]

One process, one GPU. Parameters are fp32 (master weights) with random fp32 gradients;
shapes and roles are K3_SPEC.md §5's bench-1B column, laid out as ``k3train.model`` does
(fused expert gate|up ``w13`` [E, 2I, ℓ] with TP stride 2, ``w2`` [E, ℓ, I]);
``--check-model`` compares the table with ``K3Model`` built on the meta device.

Prints, then writes as JSON:
1. optimizer step time (median over ``--steps`` timed steps after ``--warmup``), for
   torch fused AdamW, per-head Muon and whole-matrix Muon, each with the torch (bmm) and
   the fused Triton Newton–Schulz;
2. Newton–Schulz alone per block-shape bucket, bmm vs Triton, with TFLOP/s;
3. the NS work of the most loaded rank when the buckets are split over DP ranks.

Imports only torch/triton and k3train's light modules (no megatron-core, no hydra).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.model.roles import Kind, ParamRole  # noqa: E402
from k3train.optim.muon import NS_CALL_OVERHEAD, _Bucket, assign_blocks, build_muon  # noqa: E402
from k3train.optim.newton_schulz import muon_update_scale, newton_schulz  # noqa: E402
from k3train.optim.param_groups import muon_spec, split_params  # noqa: E402

M, EMB, HEAD, NORM, PQ, GATE, CONV, EXP = (Kind.MATRIX, Kind.EMBEDDING, Kind.LM_HEAD, Kind.NORM,
                                           Kind.PSEUDO_QUERY, Kind.GATE_PARAM, Kind.CONV, Kind.EXPERT_MATRIX)


def bench_1b_params(small: bool = False) -> list[tuple[str, tuple[int, ...], ParamRole]]:
    """(name, shape, role) of every k3_bench_1b parameter (K3_SPEC.md §5).

    ``small``: vocabulary 1024 and 4 experts (a CPU dry run of this script), else exact.
    """
    d, L, V = 1024, 13, 163840
    H, hd = 8, 128
    mla = {3, 7, 11, 12}  # 0-based: full_attn_layers 4, 8, 12, 13
    q_lora, kv_lora, nope, rope, v = 384, 256, 128, 64, 128
    dense_I, E, ell, I = 4864, 128, 512, 256
    if small:  # same structure, CPU-sized
        d, V, H, q_lora, kv_lora, dense_I, E, ell, I = 256, 1024, 2, 96, 64, 512, 4, 128, 64
    P = H * hd
    shared = 2 * I
    out = [("embed_tokens", (V, d), ParamRole(EMB, tp_partition_dim=0)),
           ("lm_head", (V, d), ParamRole(HEAD, tp_partition_dim=0)),
           ("norm", (d,), ParamRole(NORM)),
           ("output_attn_res.proj", (1, d), ParamRole(PQ)),
           ("output_attn_res.norm", (d,), ParamRole(NORM))]
    for l in range(L):
        p = f"layers.{l}."
        out += [(p + "self_attention_res.proj", (1, d), ParamRole(PQ)), (p + "self_attention_res.norm", (d,), ParamRole(NORM)),
                (p + "mlp_res.proj", (1, d), ParamRole(PQ)), (p + "mlp_res.norm", (d,), ParamRole(NORM)),
                (p + "input_layernorm", (d,), ParamRole(NORM)), (p + "post_attention_layernorm", (d,), ParamRole(NORM))]
        a = p + "self_attn."
        if l in mla:
            out += [(a + "q_a_proj", (q_lora, d), ParamRole(M)), (a + "q_a_layernorm", (q_lora,), ParamRole(NORM)),
                    (a + "q_b_proj", (H * (nope + rope), q_lora), ParamRole(M, "mla_q_b", nope + rope, 0)),
                    (a + "kv_a_proj", (kv_lora + rope, d), ParamRole(M)), (a + "kv_a_layernorm", (kv_lora,), ParamRole(NORM)),
                    (a + "kv_b_proj", (H * (nope + v), kv_lora), ParamRole(M, "mla_kv_b", nope + v, 0)),
                    (a + "g_proj", (H * v, d), ParamRole(M, tp_partition_dim=0)),
                    (a + "o_proj", (d, H * v), ParamRole(M, tp_partition_dim=1))]
        else:
            out += [(a + x, (P, d), ParamRole(M, "kda_qkv", hd, 0)) for x in ("q_proj", "k_proj", "v_proj")]
            out += [(a + "g_proj", (P, d), ParamRole(M, tp_partition_dim=0)), (a + "f_a_proj", (hd, d), ParamRole(M)),
                    (a + "f_b_proj", (P, hd), ParamRole(M, tp_partition_dim=0)),
                    (a + "b_proj", (H, d), ParamRole(M, tp_partition_dim=0)),
                    (a + "o_proj", (d, P), ParamRole(M, tp_partition_dim=1)),
                    (a + "A_log", (H,), ParamRole(GATE, tp_partition_dim=0)),
                    (a + "dt_bias", (P,), ParamRole(GATE, tp_partition_dim=0)), (a + "o_norm", (hd,), ParamRole(NORM))]
            out += [(a + f"{x}_conv1d", (P, 1, 4), ParamRole(CONV, tp_partition_dim=0)) for x in "qkv"]
        f = p + "mlp."
        if l == 0:
            out += [(f + "gate_proj", (dense_I, d), ParamRole(M, tp_partition_dim=0)),
                    (f + "up_proj", (dense_I, d), ParamRole(M, tp_partition_dim=0)),
                    (f + "down_proj", (d, dense_I), ParamRole(M, tp_partition_dim=1))]
        else:
            out += [(f + "gate", (E, d), ParamRole(M)), (f + "routed_expert_down_proj", (ell, d), ParamRole(M)),
                    (f + "routed_expert_up_proj", (d, ell), ParamRole(M)), (f + "routed_expert_norm", (ell,), ParamRole(NORM)),
                    (f + "shared_experts.gate_proj", (shared, d), ParamRole(M, tp_partition_dim=0)),
                    (f + "shared_experts.up_proj", (shared, d), ParamRole(M, tp_partition_dim=0)),
                    (f + "shared_experts.down_proj", (d, shared), ParamRole(M, tp_partition_dim=1)),
                    (f + "experts.w13", (E, 2 * I, ell), ParamRole(EXP, tp_partition_dim=1, tp_partition_stride=2)),
                    (f + "experts.w2", (E, ell, I), ParamRole(EXP, tp_partition_dim=2))]
    return out


def check_against_model() -> str:
    """Compare the table's multiset of (shape, role) with K3Model(k3_bench_1b) on the meta device."""
    from collections import Counter

    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model

    cfg = ModelConfig(name="k3_bench_1b", hidden_size=1024, num_layers=13, vocab_size=163840,
                      full_attn_layers=[4, 8, 12, 13], kda_num_heads=8, kda_head_dim=128, mla_num_heads=8,
                      q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      dense_intermediate_size=4864, num_experts=128, num_experts_per_token=8, latent_size=512,
                      moe_intermediate_size=256)
    with torch.device("meta"):
        model = K3Model(cfg, linear_backend="torch")
    a = Counter((tuple(p.shape), p.k3_role) for p in model.parameters())
    b = Counter((s, r) for _, s, r in bench_1b_params())
    if a != b:
        return f"MISMATCH: model-only {a - b}, table-only {b - a}"
    return f"table matches K3Model(k3_bench_1b): {sum(a.values())} tensors"


def make_params(device, small=False):
    g = torch.Generator(device=device).manual_seed(0)
    named = []
    for name, shape, role in bench_1b_params(small):
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=g) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=g) * 1e-3
        p.k3_role = role
        named.append((name, p))
    return named


def cuda_time_steps(step, steps, warmup) -> list[float]:
    for _ in range(warmup):
        step()
    if not torch.cuda.is_available():  # CPU dry run
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return times


def _no_ns(G, steps=5, scale=1.0, dtype=None, **_):
    """Stand-in for NS that only casts: the step time minus NS work (overhead breakdown)."""
    return (G * scale).to(dtype or torch.bfloat16)


def ns_flops(n_blocks, m, n, steps=5) -> float:
    return n_blocks * steps * (4.0 * m * m * n + 2.0 * m ** 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write results here (default: $OUT/muon_bench.json when $OUT is set)")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--check-model", action="store_true", help="compare the shape table with K3Model on meta and exit")
    ap.add_argument("--cpu-dry-run", action="store_true", help="exercise the script on CPU (vocab 1024, 4 experts)")
    args = ap.parse_args()
    if args.check_model:
        print(check_against_model())
        return 0
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("benchmarks/muon.py needs a CUDA GPU (or --cpu-dry-run)")
        return 1
    dev = torch.device("cpu" if args.cpu_dry_run else "cuda")
    if args.cpu_dry_run:
        args.steps, args.warmup = 1, 1
        torch.set_num_threads(1)
    res = {"gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run)", "torch": torch.__version__, "model": "k3_bench_1b",
           "param_dtype": "float32", "ns_dtype": "bfloat16"}
    try:
        import triton

        res["triton"] = triton.__version__
        from kernels.newton_schulz import newton_schulz_triton
    except Exception as exc:  # noqa: BLE001
        newton_schulz_triton = None
        res["triton_error"] = repr(exc)
    if args.no_triton:
        newton_schulz_triton = None
    print(f"GPU {res['gpu']}  torch {torch.__version__}  triton {res.get('triton')}", flush=True)

    named = make_params(dev, small=args.cpu_dry_run)
    nparams = sum(p.numel() for _, p in named)
    split = split_params(named)
    res["params"] = nparams
    res["muon_params"] = sum(p.numel() for _, p in split.muon)
    print(f"k3_bench_1b: {nparams:,} params, {res['muon_params']:,} in Muon", flush=True)

    # ---- 1. full optimizer steps ---------------------------------------------------
    rows = []

    def bench(label, make):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            opt = make()
            times = cuda_time_steps(opt.step, args.steps, args.warmup)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
            print(f"{label}: FAILED {exc!r}", flush=True)
            rows.append({"variant": label, "error": repr(exc)})
            return None
        med = statistics.median(times)
        row = {"variant": label, "median_ms": med, "min_ms": min(times), "max_ms": max(times),
               "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan"),
               "wall_s": time.time() - t0}
        if hasattr(opt, "last_step_info") and opt.last_step_info:
            row["ns_blocks"] = opt.last_step_info["ns_blocks_total"]
            row["buckets"] = len(opt.last_step_info["buckets"])
        rows.append(row)
        print(f"{label:34s} {med:8.2f} ms  (min {min(times):.2f}, max {max(times):.2f})", flush=True)
        del opt
        return med

    def adamw():
        decay = [p for _, p in split.muon + split.adamw_decay]
        nod = [p for _, p in split.adamw_no_decay]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nod, "weight_decay": 0.0}],
                                 lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)

    cfg_ph = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, muon_momentum=0.95, muon_ns_steps=5,
                  per_head_groups=["kda_qkv", "mla_q_b", "mla_kv_b"])
    cfg_whole = dict(cfg_ph, per_head_groups=[])
    base = bench("torch fused AdamW (all params)", adamw)
    bench("per-head Muon + AdamW (bmm NS)", lambda: build_muon(named, cfg_ph))
    bench("whole-matrix Muon + AdamW (bmm NS)", lambda: build_muon(named, cfg_whole))
    bench("per-head Muon, NS replaced by a cast", lambda: build_muon(named, cfg_ph, ns_fn=_no_ns))
    bench("per-head Muon, expert stacks separate", lambda: build_muon(named, cfg_ph, stack_max_blocks=64))
    if newton_schulz_triton is not None:
        bench("per-head Muon + AdamW (Triton NS)", lambda: build_muon(named, cfg_ph, ns_fn=newton_schulz_triton))
        bench("whole-matrix Muon + AdamW (Triton NS)", lambda: build_muon(named, cfg_whole, ns_fn=newton_schulz_triton))
    for r in rows:
        if base and "median_ms" in r:
            r["x_fused_adamw"] = r["median_ms"] / base
    adam_bytes = nparams * 28  # read p, g, m, v; write p, m, v (fp32)
    res["adamw_gb_per_s"] = adam_bytes / (base * 1e-3) / 1e9 if base else None
    res["steps"] = rows

    # ---- 2. Newton–Schulz alone, per bucket ------------------------------------------
    def buckets_for(per_head_groups):
        shapes = {}
        for name, p in split.muon:
            s = muon_spec(name, p, p.k3_role, per_head_groups)
            key = s.canonical_shape
            k = key  # K3Muon's default: one batch per block shape
            shapes.setdefault(k, [key, 0])[1] += s.num_blocks
        return [(v[0], v[1]) for v in shapes.values()]

    ns_rows = []
    calls = {}  # (m, n, batch) -> NS calls of that size per optimizer step
    for (m, n), nb in buckets_for(cfg_ph["per_head_groups"]):
        calls[(m, n, nb)] = calls.get((m, n, nb), 0) + 1
    if dev.type == "cuda":
        from triton.testing import do_bench
    else:

        def do_bench(fn, warmup=0, rep=0, return_mode="median"):
            return statistics.median(cuda_time_steps(fn, 1, 0))

    print("\nNewton-Schulz alone (bf16, 5 steps), per call shape; per-head config", flush=True)
    print(f"{'block':>11s} {'batch':>6s} {'calls':>5s} {'bmm ms':>8s} {'TF/s':>6s} {'triton ms':>10s} {'TF/s':>6s} "
          f"{'rel diff':>9s}")
    tot_bmm = tot_best = 0.0
    for (m, n, nb), ncall in sorted(calls.items(), key=lambda kv: -kv[0][0] * kv[0][0] * kv[0][1] * kv[0][2] * kv[1]):
        G = torch.randn(nb, m, n, device=dev)
        sc = muon_update_scale(m, n)
        t_bmm = do_bench(lambda: newton_schulz(G, scale=sc), warmup=10, rep=40, return_mode="median")
        row = {"block": [m, n], "batch": nb, "calls_per_step": ncall, "bmm_ms": t_bmm,
               "bmm_tflops": ns_flops(nb, m, n) / t_bmm / 1e9}
        best = t_bmm
        line = f"{m:>4d}x{n:<6d} {nb:>6d} {ncall:>5d} {t_bmm:8.3f} {row['bmm_tflops']:6.0f}"
        if newton_schulz_triton is not None and m <= 128 and dev.type == "cuda":
            try:
                out_t = newton_schulz_triton(G, scale=sc)
                out_b = newton_schulz(G, scale=sc)
                rel = float((out_t.float() - out_b.float()).norm() / out_b.float().norm())
                t_tr = do_bench(lambda: newton_schulz_triton(G, scale=sc), warmup=10, rep=40, return_mode="median")
                row.update(triton_ms=t_tr, triton_tflops=ns_flops(nb, m, n) / t_tr / 1e9, rel_diff_vs_bmm=rel)
                line += f" {t_tr:10.3f} {row['triton_tflops']:6.0f} {rel:9.2e}"
                best = min(best, t_tr)
            except Exception as exc:  # noqa: BLE001
                row["triton_error"] = repr(exc)
                line += f"   triton failed: {exc!r}"[:150]
        tot_bmm += ncall * t_bmm
        tot_best += ncall * best
        ns_rows.append(row)
        print(line, flush=True)
        del G
    print(f"NS per optimizer step (sum over calls): bmm {tot_bmm:.2f} ms, best backend per call {tot_best:.2f} ms")
    res["ns_total_bmm_ms"] = tot_bmm
    res["ns_total_best_ms"] = tot_best
    res["ns_buckets"] = ns_rows

    # ---- 3. NS work of the most loaded DP rank -----------------------------------------
    bl = [(_Bucket(shape, 5, [0], [nb])) for shape, nb in buckets_for(cfg_ph["per_head_groups"])]
    data = [torch.randn(b.num_blocks, *b.shape, device=dev) for b in bl]
    dp_rows = []
    print("\nper-rank Newton-Schulz time when blocks are spread over DP ranks (per-head config, bmm)")
    def even_split(buckets, dp):  # the first plan: every bucket cut over all ranks
        return [[b.num_blocks // dp + (1 if r < b.num_blocks % dp else 0) for r in range(dp)] for b in buckets]

    for dp in (1, 2, 4, 8):
        row = {"dp": dp}
        for plan_name, plan in (("lpt", assign_blocks), ("even", even_split)):
            counts = plan(bl, dp) if plan is even_split else plan(bl, dp, NS_CALL_OVERHEAD if dev.type == "cuda" else 0.0)
            ts = []
            for r in range(dp):  # time every rank's share; report the slowest
                work = [(d[: c[r]], muon_update_scale(*b.shape)) for b, c, d in zip(bl, counts, data) if c[r]]

                def run(work=work):
                    for x, sc in work:
                        newton_schulz(x, scale=sc)

                ts.append(do_bench(run, warmup=5, rep=20, return_mode="median") if work else 0.0)
            row[f"{plan_name}_max_rank_ms"] = max(ts)
            row[f"{plan_name}_calls_max_rank"] = max(sum(1 for c in counts if c[r]) for r in range(dp))
        dp_rows.append(row)
        print(f"  DP={dp}: busiest rank {row['lpt_max_rank_ms']:7.3f} ms ({row['lpt_calls_max_rank']} calls) with "
              f"assign_blocks; {row['even_max_rank_ms']:7.3f} ms ({row['even_calls_max_rank']} calls) cutting every "
              f"bucket evenly", flush=True)
    res["dp_ns"] = dp_rows

    # ---- table ------------------------------------------------------------------------
    print(f"\n== k3_bench_1b optimizer step on {res['gpu']} ({nparams / 1e9:.3f}B fp32 params) ==")
    print(f"{'variant':36s} {'median ms':>10s} {'x AdamW':>8s} {'peak GB':>8s}")
    for r in rows:
        if "median_ms" in r:
            print(f"{r['variant']:36s} {r['median_ms']:10.2f} {r.get('x_fused_adamw', float('nan')):8.2f} "
                  f"{r['peak_mem_gb']:8.1f}")
        else:
            print(f"{r['variant']:36s} FAILED")
    if res["adamw_gb_per_s"]:
        print(f"fused AdamW moves {res['adamw_gb_per_s']:.0f} GB/s (ceiling measured here: 4200 GB/s)")
    path = args.json or (os.path.join(os.environ["OUT"], "muon_bench.json") if os.environ.get("OUT") else None)
    print("JSON " + json.dumps(res))
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
