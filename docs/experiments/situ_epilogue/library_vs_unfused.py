"""Issue 10, session 34: the library's two products with SiTU in their epilogues
(``kernels.grouped_gemm_sm90.expert_tiled_situ_forward`` / ``_backward``, what ``grouped_gemm = "fused:1"`` runs)
against the same expert-tiled products followed by the Triton SiTU kernels, bench-1B MoE dims (E=128, k=8, ℓ=512,
I=256, 16384 tokens), natural routing, rows padded per expert to 64, the gate weights as the row scale; µs per
call from CUDA-graph replays (``../graph_timing.py``). The session-33 prototype this replaced (eight epilogue
variants, docs/moe_notes.md §2) is in git history (commit e65a91e, docs/experiments/situ_epilogue/).

    K3_GROUPED_GEMM_LIB=build/k3gg/libk3gg.so python docs/experiments/situ_epilogue/library_vs_unfused.py out.json
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
from kernels.moe_plan import group_offsets  # noqa: E402
from kernels.situ.triton_situ import situ_backward, situ_forward  # noqa: E402

dev = torch.device("cuda")
N, E, k, ell, I = 16384, 128, 8, 512, 256
experts, weights = make_routing("natural", N, E, k, 1024)
disp = LocalTokenDispatcher(E)
z = torch.randn(N, ell, device=dev, dtype=torch.bfloat16)
x, group_rows, handle = disp.dispatch(z, experts.to(dev), 64, weights.to(dev))
M = x.shape[0]
_, tile_expert = group_offsets(group_rows, 64, M // 64)
scale = disp.grouped_weights(handle).float()
w13 = (torch.randn(E, 2 * I, ell, device=dev) * 0.05).to(torch.bfloat16)  # rows interleaved (gate_j, up_j)
w2 = (torch.randn(E, ell, I, device=dev) * 0.05).to(torch.bfloat16)
dy = torch.randn(M, ell, device=dev, dtype=torch.bfloat16)
w13t = w13.transpose(1, 2)
res = {}


def rec(name, fn):
    res[name] = t = graph_us(fn)
    print(f"{t:9.1f}  {name}", flush=True)


def unfused_forward(halves):
    gu = gg.expert_tiled_mm(x, w13t, tile_expert, 1)
    gate, up = (gu[:, :I], gu[:, I:]) if halves else (gu[:, 0::2], gu[:, 1::2])
    return situ_forward(gate, up, 4.0, 25.0, scale)


rec("plain W13 forward + SiTU kernel (row scale), blocked halves", lambda: unfused_forward(True))
rec("plain W13 forward + SiTU kernel (row scale), interleaved", lambda: unfused_forward(False))
rec("fused W13 + SiTU (row scale)", lambda: gg.expert_tiled_situ_forward(x, w13, tile_expert, scale))
gu = gg.expert_tiled_mm(x, w13t, tile_expert, 1)
dgu = torch.empty_like(gu)
rec("plain W2 dgrad + SiTU backward kernel (row scale, ds), blocked halves",
    lambda: situ_backward(gu[:, :I], gu[:, I:], gg.expert_tiled_mm(dy, w2, tile_expert, 1), dgu[:, :I], dgu[:, I:],
                          4.0, 25.0, scale))
rec("plain W2 dgrad + SiTU backward kernel (row scale, ds), interleaved",
    lambda: situ_backward(gu[:, 0::2], gu[:, 1::2], gg.expert_tiled_mm(dy, w2, tile_expert, 1), dgu[:, 0::2],
                          dgu[:, 1::2], 4.0, 25.0, scale))
pre, _ = gg.expert_tiled_situ_forward(x, w13, tile_expert, scale)
rec("fused W2 dgrad + SiTU backward (row scale, ds)", lambda: gg.expert_tiled_situ_backward(dy, w2, pre, tile_expert, scale))
rec("fused W2 dgrad + SiTU backward (no scale)", lambda: gg.expert_tiled_situ_backward(dy, w2, pre, tile_expert, None))
json.dump(dict(gpu=torch.cuda.get_device_name(), M=M, rows_used=int(group_rows.sum()), us=res,
               date=time.strftime("%F %T")), open(sys.argv[1], "w"), indent=1)
