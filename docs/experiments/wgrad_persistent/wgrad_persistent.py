"""Persistent weight-gradient pair (W13 + W2 over the same padded groups) against kernels.grouped_wgrad's
grouped_wgrad_pair: NUM_PROGS programs walk the by-size tile list, the store through a TMA descriptor (async, so
that it drains while the next tile loads) or pointers (session 36; docs/results/grouped_wgrad_persistent_s36_*).
python docs/experiments/wgrad_persistent/wgrad_persistent.py OUT.json"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _pair_persistent(G1, X1, D1, DP1, O1, C1, G2, X2, D2, DP2, O2, C2, OFFSETS, ORDER, FIRST, TOTAL,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA_STORE: tl.constexpr):
    for q in range(tl.program_id(0), TOTAL, tl.num_programs(0)):
        pid = q
        if pid < FIRST:
            G, X, D, DP, O, C = G1, X1, D1, DP1, O1, C1
        else:
            G, X, D, DP, O, C = G2, X2, D2, DP2, O2, C2
            pid -= FIRST
        tiles_c = tl.cdiv(C, BN)
        per_expert = tl.cdiv(O, BM) * tiles_c
        e = tl.load(ORDER + pid // per_expert)
        tile = pid % per_expert
        o0 = (tile // tiles_c) * BM
        c0 = (tile % tiles_c) * BN
        start = tl.load(OFFSETS + e - 1, mask=e > 0, other=0)
        end = tl.load(OFFSETS + e)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range((end - start) // BK):
            r = start + i * BK
            acc = tl.dot(G.load([r, o0]).T, X.load([r, c0]), acc)
        if TMA_STORE:
            D.store([e * O + o0, c0], acc.to(tl.bfloat16))
        else:
            o = o0 + tl.arange(0, BM)
            c = c0 + tl.arange(0, BN)
            tl.store(DP + e.to(tl.int64) * O * C + (o[:, None] * C + c[None, :]), acc.to(tl.bfloat16))


def pair_persistent(g1, x1, g2, x2, offsets, order, programs, tma_store, tiles=(128, 256, 64, 8, 3)):
    BM, BN, BK, warps, stages = tiles
    E = offsets.shape[0]
    args, counts = [], []
    for g, x in ((g1, x1), (g2, x2)):
        O, C = g.shape[1], x.shape[1]
        dw = torch.empty(E, O, C, dtype=g.dtype, device=g.device)
        args += [TensorDescriptor.from_tensor(g, [BK, BM]), TensorDescriptor.from_tensor(x, [BK, BN]),
                 TensorDescriptor.from_tensor(dw.view(E * O, C), [BM, BN]), dw, O, C]
        counts.append(E * triton.cdiv(O, BM) * triton.cdiv(C, BN))
    _pair_persistent[(programs,)](*args, offsets, order, counts[0], sum(counts), BM=BM, BN=BN, BK=BK,
                                  TMA_STORE=tma_store, num_warps=warps, num_stages=stages)
    return args[3], args[9]


if __name__ == "__main__":
    sys.path[:0] = [".", "benchmarks", "docs/experiments"]
    from op_timing import graph_ms
    from wgrad_operands import pair_operands
    from kernels.grouped_wgrad import grouped_wgrad_pair
    from kernels.grouped_wgrad.triton_grouped_wgrad import experts_by_size

    def alloc(size, align=128):  # TMA descriptors need a global scratch allocator for device-side ones only
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)
    torch.manual_seed(0)
    res = {}
    for routing in ("natural", "skewed"):
        g1, x1, g2, x2, offsets = pair_operands(routing)
        order = experts_by_size(offsets)
        want = grouped_wgrad_pair(g1, x1, g2, x2, offsets)
        res[f"{routing} pair (today)"] = graph_ms(lambda: grouped_wgrad_pair(g1, x1, g2, x2, offsets)) * 1e3
        res[f"{routing} dense mm, same FLOPs"] = graph_ms(lambda: (g1.t() @ x1, g2.t() @ x2)) * 1e3
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for tma in (False, True):
            for programs in (sms, 2 * sms):
                name = f"{routing} persistent {'TMA' if tma else 'pointer'} store, {programs} programs"
                try:
                    got = pair_persistent(g1, x1, g2, x2, offsets, order, programs, tma)
                    same = all(torch.equal(a, b) for a, b in zip(got, want))
                    res[name] = graph_ms(lambda: pair_persistent(g1, x1, g2, x2, offsets, order, programs, tma)) * 1e3
                    res[name + " bit-equal"] = same
                except Exception as err:  # noqa: BLE001
                    res[name] = f"{type(err).__name__}: {str(err)[:200]}"
                print(name, res[name], res.get(name + " bit-equal"), flush=True)
    for key, v in res.items():
        print(f"{key:60s} {v}")
    json.dump(res, open(sys.argv[1], "w"), indent=1)
