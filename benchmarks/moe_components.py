"""Where the grouped MoE path's time goes: each piece forward+backward on its own (GPU, bf16).

    python benchmarks/moe_components.py --json moe_components.json

Pieces at bench-1B MoE dims by default (E=128, k=8, ℓ=512, I=256, 16384 tokens, natural routing):
the dispatch (routing plan, row gather), the routing plan alone (``kernels.moe_plan``), the row gather and the weighted
combine on each ``kernels.moe_permute`` backend (fused Triton, torch reference), the W13 and W2 grouped
GEMMs, the fused SiTU-GLU and Quantile Balancing's histogram update (forward only); medians, ms.
``--permute-tiles 4096x4 16384x8 …`` also times the Triton gather and combine at each tile (elements of a
program's [tokens, k, columns] tile × warps), and ``--situ-tiles 2048x4 …`` the SiTU-GLU kernels at each
tile (elements of a program's tile × warps). ``--gemm-products`` times each of the six GEMM products of
the two grouped layers alone (forward, dgrad, wgrad of W13 and W2) next to one dense cuBLAS product of the
same shape and FLOPs, in TFLOP/s; the forward and dgrad ones also as ``torch._grouped_mm`` over output
slices of at most 128 columns, where torch 2.11 picks its other CUTLASS schedule (ping-pong 64×128×128
tiles instead of cooperative 128×256×64; the slices read A once each), and, where its library is built
(``python -m kernels.grouped_gemm_sm90.build``), through ``kernels.grouped_gemm_sm90`` in each of its
CUTLASS configurations (checked against ``torch._grouped_mm`` first); and ``torch._grouped_mm`` on the same
rows cut into fewer, larger groups (1 and E/8 groups: the same M, K, N and FLOPs), which separates what the
number of groups costs (a persistent CTA that moves to another group's tile rewrites its TMA descriptors)
from what the grouped kernel costs against cuBLAS at one group.
Each piece is captured in a CUDA graph and its replays timed (``triton.testing.do_bench_cudagraph``), so
the figure is GPU time without the host's autograd and launch overhead, which ``do_bench`` alone adds to
pieces this small; a piece that cannot be captured (one that reads back to the host, e.g.
``torch.bincount``) is timed with ``do_bench`` and marked ``*`` (host included). ``benchmarks/moe.py``
times the whole path against the dense ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.config.schema import ModelConfig  # noqa: E402
from k3train.model.moe import RoutedExperts, grouped_linear  # noqa: E402
from k3train.parallel.tensor_parallel import TPSpec  # noqa: E402
from k3train.parallel.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from kernels import grouped_gemm_sm90  # noqa: E402
from kernels.grouped_wgrad import grouped_wgrad  # noqa: E402
from kernels.grouped_wgrad import reference as wgrad_reference  # noqa: E402
from kernels.moe_permute import combine_rows, dispatch_rows, triton_permute  # noqa: E402
from kernels.moe_plan import routing_plan  # noqa: E402
from kernels.qb_histogram import histogram_add  # noqa: E402
from kernels.qb_histogram import reference as qb_reference  # noqa: E402
from kernels.situ import situ_glu_interleaved, triton_situ  # noqa: E402
from moe_shapes import add_moe_dims  # noqa: E402
from op_timing import graph_ms, median_ms  # noqa: E402


def gpu_ms(fn, graph: bool = True) -> tuple[float, str]:
    """(median ms, how): ``fn``'s CUDA-graph replays, or (``graph=False`` or no capture) ``do_bench``'s."""
    ms = graph_ms(fn) if graph else None
    if ms is not None:
        return ms, "cuda graph"
    return median_ms(fn, "cuda", 25, 100), "do_bench (host included)"


def qb_histogram(N: int, E: int, bins: int = 1000) -> dict[str, tuple[float, str]]:
    """Quantile Balancing's histogram update of one micro-batch (forward only, no gradient): the Triton
    kernel, the torch reference eagerly, and the reference compiled (what a compiled layer ran before the
    kernel became the custom op ``k3::qb_histogram_add``; timed with ``do_bench``)."""
    scores = torch.rand(N, E, device="cuda")
    cutoff = torch.rand(N, device="cuda") + 0.5
    lo, width = torch.tensor(-1.0, device="cuda"), torch.tensor(2.0 / bins, device="cuda")
    counts = torch.zeros(E, bins, dtype=torch.int32, device="cuda")
    compiled = torch.compile(qb_reference.histogram_add)
    return {"QB histogram (triton)": gpu_ms(lambda: histogram_add(counts, scores, cutoff, lo, width)),
            "QB histogram (torch)": gpu_ms(lambda: qb_reference.histogram_add(counts, scores, cutoff, lo, width)),
            "QB histogram (torch, compiled)": gpu_ms(lambda: compiled(counts, scores, cutoff, lo, width), graph=False)}


def gemm_products(w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> list[dict]:
    """Each GEMM product of W13 [E, 2I, ℓ] and W2 [E, ℓ, I] on M = offsets[-1] grouped rows, alone: as the
    layers run it (``torch._grouped_mm``, or our wgrad kernel), as ≤ 128-column output slices (forward and
    dgrad), and as one dense ``torch.mm`` of the same [M, K] × [K, N] (cuBLAS); with CUTLASS's kernels
    (``kernels.grouped_gemm_sm90``, where built): grouped, expert-tiled (rows padded per expert) and, for the
    forward products, as E equal batches (``torch.bmm`` beside them); rows of ms and TFLOP/s. The sliced result
    is checked against the whole one, each CUTLASS result against torch's."""
    M = int(offsets[-1])
    (E, two_i, ell), I = w13.shape, w2.shape[2]
    gen = torch.Generator(device=w13.device).manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, device=w13.device, dtype=w13.dtype, generator=gen)  # noqa: E731
    x, h, d_gu, dy = rand(M, ell), rand(M, I), rand(M, two_i), rand(M, ell)
    # name: (A [M, K], B [E, K, N]) for out = A_e @ B_e
    grouped = {"W13 forward": (x, w13.transpose(1, 2)), "W2 forward": (h, w2.transpose(1, 2)),
               "W13 dgrad": (d_gu, w13), "W2 dgrad": (dy, w2)}
    rows = []

    def row(product, how, fn, m, k, n):
        ms, timed_by = gpu_ms(fn)
        rows.append(dict(product=product, how=how, M=m, K=k, N=n, ms=ms, TFLOPs=2 * m * k * n / ms / 1e9,
                         timed_by=timed_by))

    def cutlass_rows(product, ours, want, m, k, n, label=""):
        """``ours(i)`` for each kernels.grouped_gemm_sm90 configuration i (where its library is built): checked
        against ``want``, then timed."""
        for i, config in enumerate(grouped_gemm_sm90.CONFIGS if grouped_gemm_sm90.available() else ()):
            how = f"CUTLASS {config.name}" + (f", {label}" if label else "")
            err = float((ours(i).float() - want.float()).abs().max() / want.float().abs().max())
            assert err <= 1e-2, f"{product}, {how}: {err:.2g} from the reference product"
            row(product, how, lambda: ours(i), m, k, n)

    for name, (a, b) in grouped.items():
        K, N = b.shape[1], b.shape[2]
        slices = [b[..., j:j + 128] for j in range(0, N, 128)]
        whole = torch._grouped_mm(a, b, offs=offsets)
        sliced = torch.cat([torch._grouped_mm(a, part, offs=offsets) for part in slices], dim=1)
        assert torch.equal(whole, sliced) or (whole - sliced).abs().max() <= 1e-2 * whole.abs().max(), name
        row(name, "torch._grouped_mm", lambda: torch._grouped_mm(a, b, offs=offsets), M, K, N)
        row(name, "grouped, 128-col slices", lambda: [torch._grouped_mm(a, part, offs=offsets) for part in slices],
            M, K, N)
        dense_b = b[0].contiguous() if b[0].stride(-1) == 1 else b[0].t().contiguous().t()  # b's layout
        row(name, "dense torch.mm", lambda: a @ dense_b, M, K, N)
        for groups in sorted({1, max(1, E // 8)}):  # the same rows in fewer groups: every E/groups-th boundary
            fewer = offsets[E // groups - 1::E // groups].contiguous()
            row(name, f"torch._grouped_mm, {groups} group(s) of the same rows",
                lambda: torch._grouped_mm(a, b[:groups], offs=fewer), M, K, N)
        cutlass_rows(name, lambda i: grouped_gemm_sm90.grouped_mm(a, b, offsets, i), whole, M, K, N)
        for i, config in enumerate(grouped_gemm_sm90.CONFIGS if grouped_gemm_sm90.available() else ()):
            if config.cluster_m != 1:  # the expert-tiled kernels are built for one-CTA clusters only
                continue
            # the rows padded per expert to the tile, as a dispatch would write them; timed: the GEMM alone
            tile_m = config.tile[0]
            cap = grouped_gemm_sm90.capacity_tiles(M, E, tile_m)
            row_dest, tile_expert = grouped_gemm_sm90.expert_tiles(offsets, M, tile_m, cap)
            padded = a.new_zeros(cap * tile_m, K).index_copy_(0, row_dest, a)
            run = lambda: grouped_gemm_sm90.expert_tiled_mm(padded, b, tile_expert, i)  # noqa: E731
            err = float((run()[row_dest].float() - whole.float()).abs().max() / whole.float().abs().max())
            how = (f"CUTLASS {config.name}, expert tiles ({int((tile_expert >= 0).sum()) * tile_m / M - 1:+.1%} "
                   f"padding rows)")
            assert err <= 1e-2, f"{name}, {how}: {err:.2g} from torch._grouped_mm"
            row(name, how, run, M, K, N)
        if b.stride(1) == 1:  # k-major (the forward products): equal groups as batches, cuBLAS's and CUTLASS's plain
            rows_each = M // E  # kernels against the grouped ones on the same tiles
            batched = (a[:E * rows_each].view(E, rows_each, K), b)
            row(name, f"torch.bmm, {E} batches of {rows_each} rows", lambda: torch.bmm(*batched), M, K, N)
            want_b = torch.bmm(*batched)
            for L in (1, E):
                a_l, b_l = (a[:E * rows_each].view(1, E * rows_each, K), b[:1]) if L == 1 else batched
                cutlass_rows(name, lambda i: grouped_gemm_sm90.batched_mm(a_l, b_l, i).view(E, rows_each, N),
                             want_b if L == E else (a_l @ b_l).view(E, rows_each, N), M, K, N,
                             label=f"batched, {L} batch(es)")
    for name, (g, inp) in {"W13 wgrad": (d_gu, x), "W2 wgrad": (dy, h)}.items():
        O, C = g.shape[1], inp.shape[1]
        # [O, M] x [M, C]: the rows are the reduction dimension here
        row(name, "kernels.grouped_wgrad", lambda: grouped_wgrad(g, inp, offsets), O, M, C)
        row(name, "aten (autograd's)", lambda: wgrad_reference.grouped_wgrad_aten(g, inp, offsets), O, M, C)
        row(name, "dense torch.mm", lambda: g.t() @ inp, O, M, C)
        want = grouped_wgrad(g, inp, offsets)
        cutlass_rows(name, lambda i: grouped_gemm_sm90.grouped_wgrad(g, inp, offsets, i), want, O, M, C)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_moe_dims(ap, tokens=16384)
    ap.add_argument("--permute-tiles", nargs="*", default=[], metavar="ELEMSxWARPS",
                    help="also time the Triton gather and combine at these tiles")
    ap.add_argument("--situ-tiles", nargs="*", default=[], metavar="ELEMSxWARPS",
                    help="also time the Triton SiTU-GLU at these tiles")
    ap.add_argument("--gemm-products", action="store_true",
                    help="also time each grouped GEMM product against a dense one of the same shape")
    ap.add_argument("--json", default="moe_components.json")
    args = ap.parse_args()
    E, k, ell, I, N = args.experts, args.topk, args.latent, args.width, args.tokens
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    cfg = ModelConfig(num_experts=E, num_experts_per_token=k, latent_size=ell, moe_intermediate_size=I)
    experts = RoutedExperts(cfg, TPSpec(None, 0.02)).to(dev, bf16)  # bf16 parameters, as the trainer keeps them on GPU
    idx = torch.randn(N, E, device=dev).topk(k, -1).indices
    disp = LocalTokenDispatcher(E)
    z = torch.randn(N, ell, device=dev, dtype=bf16, requires_grad=True)
    w = torch.rand(N, k, device=dev, requires_grad=True)
    with torch.no_grad():  # a graph kept alive from here would pin z's AccumulateGrad to this stream
        _, tokens_per_expert, handle = disp.dispatch(z, idx)  # and break the captures of backwards below
    offsets = tokens_per_expert.cumsum(0).to(torch.int32)
    rows = torch.randn(N * k, ell, device=dev, dtype=bf16, requires_grad=True)
    gate_up = torch.randn(N * k, 2 * I, device=dev, dtype=bf16, requires_grad=True)
    hidden = torch.randn(N * k, I, device=dev, dtype=bf16, requires_grad=True)

    cpu_gen = torch.Generator().manual_seed(1)

    def fwd_bwd(fn, *leaves) -> tuple[float, str]:
        with torch.no_grad():  # an autograd graph kept alive here would pin its leaves' AccumulateGrad
            out = fn()        # nodes to this stream, and the capture of the backward would fail
        grad = torch.randn(out.shape, generator=cpu_gen).to(out.device, out.dtype)  # CPU RNG: a failed
        # capture before this one leaves the CUDA generator unusable outside capture
        return gpu_ms(lambda: torch.autograd.grad(fn(), leaves, grad))

    times = {
        "dispatch": fwd_bwd(lambda: disp.dispatch(z, idx)[0], z),
        "routing plan": gpu_ms(lambda: routing_plan(idx, E)),
        "grouped GEMM W13": fwd_bwd(lambda: grouped_linear(rows, experts.w13, offsets), rows, experts.w13),
        "SiTU-GLU": fwd_bwd(lambda: situ_glu_interleaved(gate_up), gate_up),
        "grouped GEMM W2": fwd_bwd(lambda: grouped_linear(hidden, experts.w2, offsets), hidden, experts.w2),
    }
    times.update(qb_histogram(N, E))
    for backend in ("triton", "torch"):
        times[f"dispatch rows ({backend})"] = fwd_bwd(
            lambda: dispatch_rows(z, handle.order, handle.inverse, k, backend=backend), z)
        times[f"combine ({backend})"] = fwd_bwd(
            lambda: combine_rows(rows, w, handle.order, handle.inverse, backend=backend), rows, w)
    sweeps = [(triton_permute, "GPU_TILE_ELEMS", args.permute_tiles,
               {"dispatch rows": lambda: fwd_bwd(lambda: dispatch_rows(z, handle.order, handle.inverse, k), z),
                "combine": lambda: fwd_bwd(lambda: combine_rows(rows, w, handle.order, handle.inverse), rows, w)}),
              (triton_situ, "GPU_BLOCK_ELEMS", args.situ_tiles,
               {"SiTU-GLU": lambda: fwd_bwd(lambda: situ_glu_interleaved(gate_up), gate_up)})]
    for module, elems_name, tiles, pieces in sweeps:  # the kernels read the tile at each launch
        default_tile = getattr(module, elems_name), module.GPU_NUM_WARPS
        for tile in tiles:
            elems, module.GPU_NUM_WARPS = (int(v) for v in tile.split("x"))
            setattr(module, elems_name, elems)
            for name, timed in pieces.items():
                times[f"{name} {tile}"] = timed()
        setattr(module, elems_name, default_tile[0])
        module.GPU_NUM_WARPS = default_tile[1]
    products = gemm_products(experts.w13.detach(), experts.w2.detach(), offsets) if args.gemm_products else []
    print(f"{torch.cuda.get_device_name()}, bf16, E={E} k={k} ℓ={ell} I={I} N={N}, fwd+bwd")
    for name, (ms, how) in times.items():
        print(f"{name:>24} {ms:8.3f} ms{'' if how == 'cuda graph' else ' *'}")
    if products:
        print(f"\n{'GEMM product':<12}{'how':<34}{'M x K x N':>20}{'ms':>9}{'TFLOP/s':>9}  (forward only)")
        for r in products:
            print(f"{r['product']:<12}{r['how']:<34}{r['M']:>8}x{r['K']}x{r['N']:<6}{r['ms']:9.4f}{r['TFLOPs']:9.1f}"
                  f"{'' if r['timed_by'] == 'cuda graph' else ' *'}")
    with open(args.json, "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, experts=E, topk=k, latent=ell,
                       width=I, tokens=N, ms={name: ms for name, (ms, _) in times.items()},
                       timed_by={name: how for name, (_, how) in times.items()}, gemm_products=products), fh,
                  indent=1)


if __name__ == "__main__":
    main()
