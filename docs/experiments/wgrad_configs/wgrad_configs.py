"""Session 37: the CUTLASS weight-gradient pair (W13 + W2 in one launch, groups by size) in eight configurations
beyond the library's five, against the Triton pair and dense mm at bench-1B's dims (row tile 64), CUDA-graph µs
(docs/results/grouped_wgrad_cutlass_configs_s37_h200_2026-12-03.json). The extra configurations are wgrad-only
(configs 5-12 below) in a build of the library with extra_configs.patch applied:

    git apply docs/experiments/wgrad_configs/extra_configs.patch   # on a scratch copy
    nvcc <the flags of kernels/grouped_gemm_sm90/build.py> kernels/grouped_gemm_sm90/grouped_gemm.cu -o LIB
    python docs/experiments/wgrad_configs/wgrad_configs.py LIB OUT.json
"""
import ctypes, json, sys
import torch
sys.path[:0] = [".", "docs/experiments"]
from graph_timing import graph_us
from wgrad_operands import pair_operands
from kernels.grouped_wgrad import grouped_wgrad_pair
from kernels.grouped_wgrad import reference

lib = ctypes.CDLL(sys.argv[1])
size_t, i32, ptr = ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
lib.k3gg_array_bytes.argtypes, lib.k3gg_array_bytes.restype = [i32, i32, i32], size_t
lib.k3gg_workspace_bytes.argtypes, lib.k3gg_workspace_bytes.restype = [i32, i32, i32, i32], size_t
lib.k3gg_wgrad_run.argtypes = [i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, ptr, ptr, size_t, i32, ptr]
lib.k3gg_wgrad_run.restype = i32
SMS = torch.cuda.get_device_properties(0).multi_processor_count
NAMES = {0: "pp 128x128 c1", 1: "pp 64x256 c1", 2: "pp 64x128x128 c2x1", 3: "coop 128x256 c2x1", 4: "coop 128x128 c1",
         5: "coop 128x128 c1x2", 6: "pp 128x128 c1x2", 7: "coop 128x256 c1", 8: "coop 256x128 c1",
         9: "coop 256x128 c2x1", 10: "pp 128x128 c2x1", 11: "coop 128x128 c2x1", 12: "coop 128x256 c1x2"}


def pair(config, products, offsets):
    E, P = offsets.shape[0], len(products)
    outs = [g.new_empty(E, g.shape[1], x.shape[1]) for g, x in products]
    arrays = torch.empty(lib.k3gg_array_bytes(config, 2, E * P), dtype=torch.uint8, device="cuda")
    wsb = lib.k3gg_workspace_bytes(config, 2, E * P, SMS)
    ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device="cuda")
    ptrs, ints = ctypes.c_void_p * P, ctypes.c_int * P
    st = lib.k3gg_wgrad_run(config, P, ptrs(*(g.data_ptr() for g, _ in products)), ptrs(*(x.data_ptr() for _, x in products)),
                            ptrs(*(o.data_ptr() for o in outs)), ints(*(g.shape[1] for g, _ in products)),
                            ints(*(x.shape[1] for _, x in products)), offsets.data_ptr(), E, arrays.data_ptr(),
                            ws.data_ptr(), wsb, SMS, torch.cuda.current_stream().cuda_stream)
    if st:
        raise RuntimeError(f"status {st}")
    return outs


torch.manual_seed(0)
res = {}
for routing in ("natural", "skewed"):
    g1, x1, g2, x2, offsets = pair_operands(routing)
    products = [(g1, x1), (g2, x2)]
    want = [reference.grouped_wgrad_aten(g, x, offsets) for g, x in products]
    res[f"{routing} triton pair"] = graph_us(lambda: grouped_wgrad_pair(g1, x1, g2, x2, offsets), reps=20)
    res[f"{routing} dense mm"] = graph_us(lambda: (g1.t() @ x1, g2.t() @ x2), reps=20)
    for config in NAMES:
        name = f"{routing} cutlass {config} {NAMES[config]}"
        try:
            got = pair(config, products, offsets)
            err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want))
            res[name] = graph_us(lambda: pair(config, products, offsets), reps=20) if err < 1e-2 else f"WRONG {err:.3g}"
        except Exception as e:  # noqa: BLE001
            res[name] = f"{type(e).__name__}: {str(e)[:100]}"
        print(f"{name:48s} {res[name] if isinstance(res[name], str) else f'{res[name]:7.1f}'}", flush=True)
    print(f"{routing} triton pair {res[f'{routing} triton pair']:.1f}  dense mm {res[f'{routing} dense mm']:.1f}", flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
