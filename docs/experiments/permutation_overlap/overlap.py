"""Session 33 experiment (issue 10, docs/moe_notes.md §2): can the memory-bound permutations run beside the
expert products on a second CUDA stream? bench-1B MoE dims, natural routing, the padded layout of tiles:1 (64
rows); CUDA-graph replays, µs. Needs kernels.grouped_gemm_sm90's library (K3_GROUPED_GEMM_LIB) on an H200:

    K3_GROUPED_GEMM_LIB=build/k3gg/libk3gg.so python docs/experiments/permutation_overlap/overlap.py out.json
"""
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.moe import make_routing  # noqa: E402
from docs.experiments.graph_timing import graph_us  # noqa: E402
from k3train.parallel.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from kernels import grouped_gemm_sm90 as gg  # noqa: E402
from kernels.grouped_wgrad import grouped_wgrad  # noqa: E402
from kernels.moe_permute import triton_permute as tp  # noqa: E402
from kernels.moe_plan import group_offsets  # noqa: E402

dev = torch.device("cuda")
N, E, k, ell, I = 16384, 128, 8, 512, 256
experts, weights = make_routing("natural", N, E, k, 1024)
experts = experts.to(dev)
disp = LocalTokenDispatcher(E)
z = torch.randn(N, ell, device=dev, dtype=torch.bfloat16)
x, group_rows, h = disp.dispatch(z, experts, 64)
M = x.shape[0]
offsets, tile_expert = group_offsets(group_rows, 64, M // 64)
w13 = torch.randn(E, 2 * I, ell, device=dev, dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, ell, I, device=dev, dtype=torch.bfloat16) * 0.02
dh13 = torch.randn(M, 2 * I, device=dev, dtype=torch.bfloat16)
dy = torch.randn(M, ell, device=dev, dtype=torch.bfloat16)
dx = torch.randn(M, ell, device=dev, dtype=torch.bfloat16)
du = torch.randn(N, ell, device=dev, dtype=torch.bfloat16)
ones = torch.ones(N, k, device=dev, dtype=torch.bfloat16)
inv = h.inverse
lib = gg._load()
print("M", M, "rows used", int(group_rows.sum()), flush=True)


def tiled(a, b, cfg, sms):
    """expert_tiled_mm with a chosen sm_count."""
    G, K, Nn = b.shape
    mode = gg.MODES[gg.b_layout(b)]
    out = a.new_empty(a.shape[0], Nn)
    ws = lib.k3gg_expert_tiled_workspace_bytes(cfg, mode, G, a.shape[0], Nn, K, sms)
    work = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
    st = lib.k3gg_expert_tiled_run(cfg, mode, a.data_ptr(), b.data_ptr(), out.data_ptr(), tile_expert.data_ptr(),
                                   G, a.shape[0], Nn, K, work.data_ptr(), ws, sms,
                                   torch.cuda.current_stream().cuda_stream)
    assert st == 0, st
    return out


side = torch.cuda.Stream()


def both(main_fn, side_fn, side_first=False):
    def f():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        if side_first:
            with torch.cuda.stream(side):
                side_fn()
            main_fn()
        else:
            main_fn()
            with torch.cuda.stream(side):
                side_fn()
        cur.wait_stream(side)
    return f


def seq(*fns):
    def f():
        for fn in fns:
            fn()
    return f


disp_fwd = lambda: tp.dispatch_forward(z, inv, k, h.pad_rows)  # noqa: E731
disp_bwd = lambda: tp.dispatch_backward(dx, inv, k)  # noqa: E731
comb_fwd = lambda: tp.combine_forward(dy, ones, inv)  # noqa: E731
comb_bwd = lambda: tp.combine_backward(du, None, ones, inv, k, torch.bfloat16, torch.float32, h.pad_rows)  # noqa: E731
wg_triton = lambda: grouped_wgrad(dh13, x, offsets)  # noqa: E731
wg_cut3 = lambda: gg.grouped_wgrad(dh13, x, offsets, 3)  # noqa: E731
w13t = w13.transpose(1, 2)
w2t = w2.transpose(1, 2)
h_ = torch.randn(M, I, device=dev, dtype=torch.bfloat16)

res = {}


def rec(name, fn):
    t = graph_us(fn)
    res[name] = t
    print(f"{t:9.1f}  {name}", flush=True)


rec("dispatch fwd", disp_fwd)
rec("dispatch bwd", disp_bwd)
rec("combine fwd", comb_fwd)
rec("combine bwd (dy)", comb_bwd)
for sms in (132, 124, 116, 108):
    rec(f"W13 fwd tiles:1 sm{sms}", lambda s=sms: tiled(x, w13t, 1, s))
for sms in (132, 124, 116):
    f = lambda s=sms: tiled(x, w13t, 1, s)  # noqa: E731
    rec(f"W13 fwd sm{sms} || dispatch fwd", both(f, disp_fwd))
    rec(f"W13 fwd sm{sms} || dispatch fwd (side first)", both(f, disp_fwd, True))
rec("W13 fwd sm132 ; dispatch fwd", seq(lambda: tiled(x, w13t, 1, 132), disp_fwd))
rec("W2 dgrad tiles:1", lambda: tiled(dy, w2, 1, 132))
rec("W2 dgrad ; combine bwd", seq(lambda: tiled(dy, w2, 1, 132), comb_bwd))
rec("W2 dgrad || combine bwd", both(lambda: tiled(dy, w2, 1, 132), comb_bwd))
rec("W2 dgrad sm116 || combine bwd", both(lambda: tiled(dy, w2, 1, 116), comb_bwd))
rec("W2 fwd tiles:1", lambda: tiled(h_, w2t, 1, 132))
rec("W2 fwd || combine fwd", both(lambda: tiled(h_, w2t, 1, 132), comb_fwd))
rec("W13 wgrad triton", wg_triton)
rec("W13 wgrad triton ; dispatch bwd", seq(wg_triton, disp_bwd))
rec("W13 wgrad triton || dispatch bwd", both(wg_triton, disp_bwd))
rec("W13 wgrad triton || dispatch bwd (side first)", both(wg_triton, disp_bwd, True))
rec("W13 wgrad cutlass:3", wg_cut3)
rec("W13 wgrad cutlass:3 ; dispatch bwd", seq(wg_cut3, disp_bwd))
rec("W13 wgrad cutlass:3 || dispatch bwd", both(wg_cut3, disp_bwd))
rec("W13 dgrad tiles:1", lambda: tiled(dh13, w13, 1, 132))
rec("W13 dgrad || W13 wgrad triton", both(lambda: tiled(dh13, w13, 1, 132), wg_triton))
rec("W13 dgrad ; W13 wgrad triton", seq(lambda: tiled(dh13, w13, 1, 132), wg_triton))
json.dump(dict(gpu=torch.cuda.get_device_name(), M=M, us=res, date=time.strftime("%F %T")),
          open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/overlap.json", "w"), indent=1)
