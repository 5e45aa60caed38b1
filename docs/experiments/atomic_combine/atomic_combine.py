"""Session 36 experiment (issue 10, docs/moe_notes.md §2): would a combine by atomic adds pay, as the W2 forward's
epilogue scatter-adding its rows into the tokens' outputs would do? Timed here as a pass of its own: y [R, 512]
bf16 in the padded expert layout (bench-1B dims, natural routing), out[token] += y[row] for each used row, scalar
atomics into bf16 or fp32 outputs and sm_90's red.global.add.v4.f32 (inline PTX), against the gather combine of
kernels.moe_permute; CUDA-graph replays, µs. On one H200 (docs/results/moe_atomic_combine_s36_h200_2026-12-03.json):
gather 41.2, bf16 atomics 69-71, fp32 124-125, v4 fp32 197-199. From the repository root:

    python docs/experiments/atomic_combine/atomic_combine.py out.json
"""
import json
import sys

import torch
import triton
import triton.language as tl

sys.path[:0] = [".", "benchmarks"]
from op_timing import graph_ms  # noqa: E402

from kernels import moe_plan  # noqa: E402
from kernels.moe_permute import triton_permute as tp  # noqa: E402


@triton.jit
def scatter_add(Y, ROW_TOKEN, OUT, R, L: tl.constexpr, BR: tl.constexpr, BL: tl.constexpr, V4: tl.constexpr):
    """OUT[ROW_TOKEN[r]] += Y[r] for rows with a token (≥ 0): scalar atomics, or (V4, fp32 OUT) one
    red.global.add.v4.f32 per 4 consecutive columns of a thread (inline PTX, sm_90)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    tok = tl.load(ROW_TOKEN + r, mask=r < R, other=-1).to(tl.int64)
    ok = (tok >= 0)[:, None]
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        y = tl.load(Y + r.to(tl.int64)[:, None] * L + cols[None, :], mask=ok).to(OUT.dtype.element_ty)
        if V4:
            ptr = (OUT + tl.where(ok, tok[:, None], 0) * L + cols[None, :]).to(tl.int64, bitcast=True)
            flag = tl.broadcast_to(ok, (BR, BL)).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $12, 0; @p red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, "
                "$11}; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }",
                "=r,=r,=r,=r,l,l,l,l,f,f,f,f,r,r,r,r", [ptr, y, flag], dtype=tl.int32, is_pure=False, pack=4)
        else:
            tl.atomic_add(OUT + tok[:, None] * L + cols[None, :], y, mask=ok, sem="relaxed")


torch.manual_seed(0)
N, k, E, L = 16384, 8, 128, 512
experts = torch.randn(N, E, device="cuda").topk(k, dim=-1).indices
plan = moe_plan.routing_plan(experts, E, 64)
inv, pad = plan[1], plan[4]
R = N * k + pad.numel()
row_token = torch.full((R,), -1, dtype=torch.int32, device="cuda")
row_token[inv] = (torch.arange(N * k, device="cuda") // k).int()
y = torch.randn(R, L, device="cuda", dtype=torch.bfloat16)
w = torch.ones(N, k, device="cuda", dtype=torch.bfloat16)
want = tp.combine_forward(y, w, inv).float()
res = {"gather combine (moe_permute)": graph_ms(lambda: tp.combine_forward(y, w, inv)) * 1e3}


def time_scatter(v4: bool, label: str, dtype: torch.dtype, br: int, bl: int, warps: int) -> None:
    """res[name] = µs of zeroing out and one scatter-add launch; res[name + " err"] = its error against the gather."""
    out = torch.zeros(N, L, device="cuda", dtype=dtype)

    def run():
        out.zero_()
        scatter_add[(triton.cdiv(R, br),)](y, row_token, out, R, L=L, BR=br, BL=bl, V4=v4, num_warps=warps)
    run()
    name = f"atomics {label} BR{br} BL{bl} w{warps} (incl. zero_)"
    res[name + " err"] = err = float((out.float() - want).abs().max() / want.abs().max())
    res[name] = graph_ms(run) * 1e3
    print(name, f"{res[name]:.1f} us err {err:.2g}", flush=True)


TILES = ((8, 512, 4), (16, 256, 4), (4, 512, 4), (8, 512, 8))
for dt in (torch.float32, torch.bfloat16):
    for tile in TILES + ((32, 128, 4),):
        time_scatter(False, str(dt)[6:], dt, *tile)
for tile in TILES:
    time_scatter(True, "v4 fp32", torch.float32, *tile)
res["zero_ of out fp32"] = graph_ms(lambda: torch.zeros(N, L, device="cuda").zero_()) * 1e3
o32 = torch.zeros(N, L, device="cuda")
res["fp32 -> bf16 of out"] = graph_ms(lambda: o32.to(torch.bfloat16)) * 1e3
for kk, v in res.items():
    print(f"{kk:50s} {v:.3g}")
json.dump(res, open(sys.argv[1], "w"), indent=1)
