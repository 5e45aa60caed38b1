"""Optimizer step time on k3_bench_1b's parameters: per-head Muon, whole-matrix Muon, fused AdamW.

    python benchmarks/muon.py [--steps 10] [--warmup 3] [--json out.json] [--no-profile]

One process, one GPU. Parameters are fp32 (master weights) with random fp32 gradients;
shapes and roles are K3_SPEC.md §5's bench-1B column, laid out as ``k3train.model`` does
(fused expert ``w13`` [E, 2I, ℓ] with interleaved gate/up rows, ``w2`` [E, ℓ, I]);
``--check-model`` compares the table with ``K3Model`` built on the meta device.

Prints, then writes as JSON:
1. optimizer step time (median over ``--steps`` timed steps after ``--warmup``) for torch fused
   AdamW and per-head Muon (default; its step captured in a CUDA graph and replayed, as the trainer
   runs it on one GPU; with the torch elementwise passes; with bmm NS only; with the
   tiled Triton NS; with inductor's NS under ``--inductor``; with NS replaced by a cast) and
   whole-matrix Muon, each as a multiple of fused AdamW in the same
   run, with the step's floor: its bytes at fused AdamW's bandwidth plus its NS FLOPs at the
   bf16 GEMM ceiling;
2. Newton–Schulz alone per block-shape bucket (bf16 input, as the optimizer's stack), bmm vs
   Triton (the fused kernel for ≤ 128 rows, the tiled one above), with TFLOP/s; then the three GEMMs
   of one NS step on the expert bucket, that bucket in chunks, and (``--ns-tiles``) the tiled kernel
   on it at other tiles;
3. the NS work of the most loaded rank when the buckets are split over DP ranks;
4. a profile of one default per-head Muon step: GPU busy vs wall time, kernels by kind and the
   top kernels (``benchmarks/train_step.py``'s profiler).

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
from k3train.optim.muon import NS_CALL_OVERHEAD, _Bucket, assign_blocks, build_muon, ns_backend, ns_flops  # noqa: E402
from k3train.optim.newton_schulz import NS_COEFFS, default_ns_dtype, muon_update_scale, newton_schulz  # noqa: E402
from k3train.optim.param_groups import muon_spec, split_params  # noqa: E402
from k3train.training.optimizer_graph import CapturedOptimizerStep  # noqa: E402

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
                    (f + "experts.w13", (E, 2 * I, ell), ParamRole(EXP, tp_partition_dim=1, row_interleave=2)),
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write results here (default: $OUT/muon_bench.json when $OUT is set)")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--ns-tiles", nargs="*", default=[], metavar="BMxBKxWARPSxSTAGES",
                    help="time the tiled NS kernel on the biggest bucket at these tiles (e.g. 128x64x8x3)")
    ap.add_argument("--inductor", action="store_true",
                    help="also time the inductor NS backend (its max-autotune takes minutes at the first step)")
    ap.add_argument("--no-profile", action="store_true", help="skip section 4 (the profiled step)")
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
           "param_dtype": "float32"}
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

    ns_dtype = default_ns_dtype(dev)
    res["ns_dtype"] = str(ns_dtype)
    named = make_params(dev, small=args.cpu_dry_run)
    nparams = sum(p.numel() for _, p in named)
    split = split_params(named)
    res["params"] = nparams
    res["muon_params"] = sum(p.numel() for _, p in split.muon)
    print(f"k3_bench_1b: {nparams:,} params, {res['muon_params']:,} in Muon", flush=True)

    def buckets_for(per_head_groups):
        """[((m, n), blocks)]: K3Muon's NS calls (one per wide block shape) at DP = 1."""
        shapes = {}
        for name, p in split.muon:
            spec = muon_spec(name, p, p.k3_role, per_head_groups)
            shapes[spec.canonical_shape] = shapes.get(spec.canonical_shape, 0) + spec.num_blocks
        return sorted(shapes.items(), key=lambda kv: -ns_flops(kv[1], *kv[0]))

    ph_buckets = buckets_for(["kda_qkv", "mla_q_b", "mla_kv_b"])

    # ---- 1. full optimizer steps ---------------------------------------------------
    rows = []

    def bench(label, make, captured=False):
        """Times make()'s step; ``captured``: through the trainer's CUDA-graph replay of it
        (train.optimizer_cuda_graph: two eager steps, then the captured one; K3Muon's own
        non-finite check off, as in the trainer, whose guard checks before the step)."""
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            opt = make()
            step = CapturedOptimizerStep(opt) if captured else opt.step
            warmup = max(args.warmup, step.eager_steps + 1) if captured else args.warmup  # the capture in it
            times = cuda_time_steps(step, args.steps, warmup)
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
        print(f"{label:42s} {med:8.2f} ms  (min {min(times):.2f}, max {max(times):.2f})", flush=True)
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
    ns_auto = ns_backend("torch" if newton_schulz_triton is None else "auto")
    bench("per-head Muon (default)", lambda: build_muon(named, cfg_ph, ns_fn=ns_auto))
    bench("per-head Muon, torch elementwise passes",
          lambda: build_muon(named, cfg_ph, ns_fn=ns_auto, elementwise_backend="torch"))
    bench("per-head Muon, bmm NS only", lambda: build_muon(named, cfg_ph, ns_fn=newton_schulz))
    if dev.type == "cuda":
        bench("per-head Muon (default), CUDA graph", lambda: build_muon(named, cfg_ph, ns_fn=ns_auto), captured=True)
        bench("per-head Muon, tiled NS", lambda: build_muon(named, cfg_ph, ns_fn=ns_backend("tiled")))
    if dev.type == "cuda" and args.inductor:  # autotuned GEMMs for the > 128-row blocks (tunes in the warm-up)
        bench("per-head Muon, inductor NS", lambda: build_muon(named, cfg_ph, ns_fn=ns_backend("inductor")))
    bench("per-head Muon, NS replaced by a cast", lambda: build_muon(named, cfg_ph, ns_fn=_no_ns))
    bench("whole-matrix Muon (default)", lambda: build_muon(named, cfg_whole, ns_fn=ns_auto))
    for r in rows:
        if base and "median_ms" in r:
            r["x_fused_adamw"] = r["median_ms"] / base
    adam_bytes = nparams * 28  # read p, g, m, v; write p, m, v (fp32)
    res["adamw_gb_per_s"] = adam_bytes / (base * 1e-3) / 1e9 if base else None
    res["steps"] = rows
    # Floor of the per-head Muon step: its unavoidable bytes at fused AdamW's bandwidth plus its NS FLOPs at
    # the bf16 GEMM ceiling (/work/shared/ANCHORS.md: 694 TFLOP/s on the lent H200). Bytes: the non-finite
    # check reads every fp32 gradient (4 B), AdamW 28 B per parameter, Muon 24 B (g, m read; m written;
    # bf16 NS input written; p read and written; bf16 update read).
    n_muon = res["muon_params"]
    floor_gb = (4 * nparams + 28 * (nparams - n_muon) + 24 * n_muon) / 1e9
    ns_tflop = sum(ns_flops(nb, m, n) for (m, n), nb in ph_buckets) / 1e12
    if base:
        floor_ms = floor_gb / res["adamw_gb_per_s"] * 1e3 + ns_tflop / 694.0 * 1e3
        res["floor"] = {"bytes_gb": floor_gb, "ns_tflop": ns_tflop, "ms": floor_ms, "x_fused_adamw": floor_ms / base}

    # ---- 2. Newton–Schulz alone, per bucket ------------------------------------------
    ns_rows = []
    if dev.type == "cuda":
        from triton.testing import do_bench
    else:

        def do_bench(fn, warmup=0, rep=0, return_mode="median"):
            return statistics.median(cuda_time_steps(fn, 1, 0))

    print("\nNewton-Schulz alone (bf16 input as the optimizer's stack, 5 steps), one call per block shape; "
          "per-head config", flush=True)
    print(f"{'block':>11s} {'batch':>6s} {'bmm ms':>8s} {'TF/s':>6s} {'triton ms':>10s} {'TF/s':>6s} {'rel diff':>9s}")
    tot_bmm = tot_best = 0.0
    for (m, n), nb in ph_buckets:
        G = torch.randn(nb, m, n, device=dev, dtype=ns_dtype)
        sc = muon_update_scale(m, n)
        t_bmm = do_bench(lambda: newton_schulz(G, scale=sc), warmup=10, rep=40, return_mode="median")
        row = {"block": [m, n], "batch": nb, "bmm_ms": t_bmm, "bmm_tflops": ns_flops(nb, m, n) / t_bmm / 1e9}
        best = t_bmm
        line = f"{m:>4d}x{n:<6d} {nb:>6d} {t_bmm:8.3f} {row['bmm_tflops']:6.0f}"
        if newton_schulz_triton is not None and dev.type == "cuda":  # fused kernel ≤ 128 rows, tiled above
            kernel = newton_schulz_triton if m <= 128 else ns_backend("tiled")
            try:
                out_t = kernel(G, scale=sc)
                out_b = newton_schulz(G, scale=sc)
                rel = float((out_t.float() - out_b.float()).norm() / out_b.float().norm())
                t_tr = do_bench(lambda: kernel(G, scale=sc), warmup=10, rep=40, return_mode="median")
                row.update(triton_kernel="fused" if m <= 128 else "tiled", triton_ms=t_tr,
                           triton_tflops=ns_flops(nb, m, n) / t_tr / 1e9, rel_diff_vs_bmm=rel)
                line += f" {t_tr:10.3f} {row['triton_tflops']:6.0f} {rel:9.2e}"
                best = min(best, t_tr)
            except Exception as exc:  # noqa: BLE001
                row["triton_error"] = repr(exc)
                line += f"   triton failed: {exc!r}"[:150]
        tot_bmm += t_bmm
        tot_best += best
        ns_rows.append(row)
        print(line, flush=True)
        del G
    print(f"NS per optimizer step (sum over calls): bmm {tot_bmm:.2f} ms, best backend per call {tot_best:.2f} ms")
    res["ns_total_bmm_ms"] = tot_bmm
    res["ns_total_best_ms"] = tot_best
    res["ns_buckets"] = ns_rows

    # ---- 2b. the biggest bucket: one NS step's GEMMs, and the whole NS in chunks -------
    (m, n), nb = ph_buckets[0]
    X = torch.randn(nb, m, n, device=dev, dtype=ns_dtype) / (m * n) ** 0.5
    a, b, c = NS_COEFFS
    A = torch.bmm(X, X.mT)
    B = torch.baddbmm(A, A, A, beta=b, alpha=c)
    el = X.element_size()
    gemms = [("A = X X^T", lambda: torch.bmm(X, X.mT), 2 * m * m * n, m * n + m * m),
             ("B = bA + cA^2 (baddbmm)", lambda: torch.baddbmm(A, A, A, beta=b, alpha=c), 2 * m ** 3, 3 * m * m),
             ("X' = aX + BX (baddbmm)", lambda: torch.baddbmm(X, B, X, beta=a), 2 * m * m * n, m * m + 3 * m * n),
             ("X' = B X (bmm, no C read)", lambda: torch.bmm(B, X), 2 * m * m * n, m * m + 2 * m * n)]
    print(f"\none NS step's GEMMs on the biggest bucket [{nb}, {m}, {n}] (GB/s: operands + output once each)")
    anatomy = []
    for label, fn, flops, elems in gemms:
        t = do_bench(fn, warmup=10, rep=40, return_mode="median")
        anatomy.append({"gemm": label, "ms": t, "tflops": nb * flops / t / 1e9, "gb_per_s": nb * elems * el / t / 1e6})
        print(f"  {label:28s} {t:7.3f} ms {anatomy[-1]['tflops']:6.0f} TF/s {anatomy[-1]['gb_per_s']:6.0f} GB/s")
    sc = muon_update_scale(m, n)
    for chunk in (nb, 1024, 256):
        if chunk > nb:
            continue
        t = do_bench(lambda: [newton_schulz(X[i:i + chunk], scale=sc) for i in range(0, nb, chunk)],
                     warmup=5, rep=40, return_mode="median")
        anatomy.append({"ns_chunk_blocks": chunk, "ms": t})
        print(f"  whole NS (bmm) in chunks of {chunk:5d} blocks: {t:7.3f} ms")
    if args.ns_tiles and dev.type == "cuda":  # the tiled kernel's tile on this bucket (read at each launch)
        from kernels.newton_schulz import triton_tiled_ns
        default = dict(triton_tiled_ns.GPU_TILES)
        for tile in args.ns_tiles:
            bm, bk, warps, stages = (int(v) for v in tile.split("x"))
            triton_tiled_ns.GPU_TILES = dict(BM=bm, BN=bm, BK=bk, num_warps=warps, num_stages=stages)
            t = do_bench(lambda: triton_tiled_ns.newton_schulz_tiled(X, scale=sc), warmup=10, rep=40,
                         return_mode="median")
            anatomy.append({"tiled_ns_tile": tile, "ms": t, "tflops": ns_flops(nb, m, n) / t / 1e9})
            print(f"  tiled NS, tile {tile:>14s} (BM=BN x BK x warps x stages): {t:7.3f} ms "
                  f"{anatomy[-1]['tflops']:6.0f} TF/s")
        triton_tiled_ns.GPU_TILES = default
    res["biggest_bucket_anatomy"] = anatomy
    del X, A, B

    # ---- 3. NS work of the most loaded DP rank -----------------------------------------
    bl = [(_Bucket(shape, 5, [0], [nb])) for shape, nb in ph_buckets]
    data = [torch.randn(b.num_blocks, *b.shape, device=dev, dtype=ns_dtype) for b in bl]
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

    # ---- 4. profile of one default per-head Muon step ------------------------------------
    if dev.type == "cuda" and not args.no_profile:
        from train_step import profile  # benchmarks/ is this script's directory

        print("\nprofile of the default per-head Muon step")
        opt = build_muon(named, cfg_ph, ns_fn=ns_auto)
        opt.step()
        res["profile"] = profile(opt.step)
        del opt

    # ---- table ------------------------------------------------------------------------
    print(f"\n== k3_bench_1b optimizer step on {res['gpu']} ({nparams / 1e9:.3f}B fp32 params) ==")
    print(f"{'variant':42s} {'median ms':>10s} {'x AdamW':>8s} {'peak GB':>8s}")
    for r in rows:
        if "median_ms" in r:
            print(f"{r['variant']:42s} {r['median_ms']:10.2f} {r.get('x_fused_adamw', float('nan')):8.2f} "
                  f"{r['peak_mem_gb']:8.1f}")
        else:
            print(f"{r['variant']:42s} FAILED")
    if "floor" in res:
        f = res["floor"]
        print(f"{'floor of per-head Muon (bytes + NS FLOPs)':42s} {f['ms']:10.2f} {f['x_fused_adamw']:8.2f}"
              f"   ({f['bytes_gb']:.1f} GB at fused AdamW's rate + {f['ns_tflop']:.2f} TFLOP at 694 TFLOP/s)")
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
