"""Grouped bf16 GEMMs on Hopper with a chosen CUTLASS schedule (``grouped_gemm.cu``): what
``torch._grouped_mm`` computes for the routed experts, with the kernel configuration as an argument.

    out = grouped_mm(a, b, offsets, config=0)
    a [M, K] bf16 contiguous; b [G, K, N] bf16, each b[g] packed either way: k-major (a transposed view of a
    [G, N, K] weight, as the experts' forward passes W13 and W2) or n-major (a [G, K, N] contiguous tensor, as
    their dgrad passes the weights); offsets [G] int32 cumulative row counts on the GPU → out [M, N] bf16,
    out[rows of g] = a[rows of g] @ b[g].

    dw = grouped_wgrad(g, x, offsets, config=0)
    g [M, O], x [M, C] bf16 contiguous → dw [G, O, C] bf16, dw[e] = g[rows of e]ᵀ x[rows of e] (0 for a group
    without rows): the weight gradient, as ``kernels.grouped_wgrad``.
    dw1, dw2 = grouped_wgrad_pair(g1, x1, g2, x2, offsets, config=0)
    Two such gradients over the same groups in one launch (the routed experts' W13 and W2), the groups of both
    placed by row count, largest first, so that the longest K loops start first.

torch 2.11 builds one CUTLASS pointer-array kernel for this with its configuration fixed by the group sizes
(cooperative 128×256×64 tiles in 2×1 clusters at the experts' sizes); ``CONFIGS`` here are the ones
``grouped_gemm.cu`` instantiates, to measure which suits K = 256–512 (``benchmarks/moe_components.py
--gemm-products``). Measured on one H200 (docs/moe_notes.md §2, session 24): on the forward and dgrad products
none beats torch's by more than 2%. The weight gradients: in the layer (``fused:1:j``, session 37), the W13 and
W2 pair in one launch of configuration 3 took 5–17 µs less than ``kernels.grouped_wgrad``'s pair under natural
routing across three leases and 15–23 µs more under skewed routing (an overloaded expert's tile runs its whole K on
one CTA).
Experimental: the model runs it only where ``RoutedExperts.grouped_gemm`` names a configuration
(``benchmarks/moe.py --grouped-gemms``).

    dw1, dw2 = expert_tiled_wgrad([(g1, x1), (g2, x2)], offsets)
    The same on CUTLASS's plain cooperative kernel (TMA descriptors built once), each tile given only its expert's
    K tiles by the scheduler (``ExpertWgradScheduler``): rows padded per expert to ``EXPERT_WGRAD_ROW_TILE``, as
    the expert-tiled layout pads them. In the layer (``fused:1:w``, session 37) 0–14 µs under configuration 3's
    pair under natural routing, 37–42 µs over it under skew.

    out = batched_mm(a, b, config=0)
    a [L, M, K] bf16 contiguous, b [L, K, N] a transposed view of a packed [L, N, K] → out [L, M, N] = a @ b:
    the same configurations on CUTLASS's plain persistent kernels (not pointer-array), to measure what the
    grouped kernels' per-group machinery costs on the same tiles (L = 1: one dense GEMM; L = E: equal groups).

    row_dest, tile_expert = expert_tiles(offsets, tile_m, capacity_tiles(M, G, tile_m))
    out = expert_tiled_mm(a_padded, b, tile_expert, config=0)
    The grouped product on CUTLASS's plain persistent kernel (configurations with one-CTA clusters): each group's
    rows padded to a multiple of the config's tile rows (row r of the group-sorted [M, K] goes to a_padded[row_dest[r]];
    tile_expert[m] is the group of M tile m, -1 past the last), so every M tile lies in one group and only B's
    batch index moves between tiles: out[tile m] = a_padded[tile m] @ b[tile_expert[m]], out [M_pad, N]; padding
    rows' outputs are unspecified. On one H200 (session 27, ``--gemm-products``) its four products at bench-1B
    took 0.096 ms less than ``torch._grouped_mm``'s, 8–17% behind dense cuBLAS (docs/moe_notes.md §2).

    pre, h = expert_tiled_situ_forward(x_padded, w13, tile_expert, row_scale)
    d_pre, ds = expert_tiled_situ_backward(dy, w2, pre, tile_expert, row_scale)
    The routed experts' two products that SiTU-GLU follows and precedes, with SiTU in their CUTLASS epilogues
    (``situ_epilogue.cuh``, configuration ``SITU_CONFIG``): W13 (rows interleaved gate_j, up_j) gives the
    pre-activations and h = s·SiTU from its fp32 accumulators; the W2 dgrad gives the pre-activations' gradient and
    the row scale's (ds). ``expert_tiled_situ_reference`` is the same in fp32 torch. On one H200 at bench-1B
    (session 34, natural routing, row scale) they took 154.7 and 133.4 µs against 211.6 and 201.0 µs for the plain
    products followed by the Triton SiTU kernels (docs/moe_notes.md §2).

``grouped_mm_op`` and ``expert_tiled_mm_op`` (both the custom op ``k3::grouped_mm_sm90``), ``grouped_wgrad_op``
(``k3::grouped_wgrad_sm90``) and ``expert_tiled_situ_forward_op`` / ``_backward_op`` (``k3::situ_forward_sm90``,
``k3::situ_backward_sm90``) are the same for torch.compile, with fakes.

The library is built ahead with nvcc and CUTLASS's headers (``python -m kernels.grouped_gemm_sm90.build``;
sm_90a code, so the build needs no GPU) and found at ``$K3_GROUPED_GEMM_LIB`` or ``LIB_DEFAULT``. The call
launches on torch's current stream through ctypes; the per-group arrays and CUTLASS's workspace are torch
allocations, so nothing synchronises and the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.situ import reference as situ_reference

LIB_DEFAULT = Path(os.environ.get("K3TRAIN_CACHE", Path.home() / ".cache" / "k3train")) / "grouped_gemm_sm90" / \
    "libk3gg.so"


class Config(NamedTuple):
    """A kernel configuration: schedule, CTA tile (M × N × K) and CTAs a cluster along M."""
    ping_pong: bool
    tile: tuple[int, int, int]
    cluster_m: int

    @property
    def name(self) -> str:
        m, n, k = self.tile
        return f"{'ping-pong' if self.ping_pong else 'cooperative'} {m}x{n}x{k} c{self.cluster_m}"


# In grouped_gemm.cu's order (its K3_CONFIGS); 3 is what torch 2.11 runs at the experts' sizes.
CONFIGS = (Config(True, (128, 128, 64), 1), Config(True, (64, 256, 64), 1), Config(True, (64, 128, 128), 2),
           Config(False, (128, 256, 64), 2), Config(False, (128, 128, 64), 1))
MODES = {"k-major": 0, "n-major": 1, "wgrad": 2}  # grouped_gemm.cu's modes
_STEPS = {1: "a launch before the GEMM", 2: "workspace too small", 3: "CUTLASS can_implement",
          4: "CUTLASS initialize", 5: "CUTLASS run", 6: "a launch error", -1: "unknown configuration"}

ABI_VERSION = 5  # grouped_gemm.cu's k3gg_abi_version: the entry points' arguments (2 had a pdl flag, since removed;
# 4 runs the weight gradients through k3gg_wgrad_run, one or two products a launch; 5 adds k3gg_expert_wgrad)
EXPERT_WGRAD_ROW_TILE = 64  # the expert-tiled weight gradient reads each expert's rows 64 at a time

_lib = None


def _preload_cudart(soname: str) -> bool:
    """Load ``soname`` (e.g. libcudart.so.13) from torch's pip wheels (``nvidia/*/lib/``) globally; False if
    none is there."""
    for root in sys.path:
        for lib in glob.glob(os.path.join(root, "nvidia", "*", "lib", soname)):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return True
    return False


def library_path() -> Path:
    return Path(os.environ.get("K3_GROUPED_GEMM_LIB", LIB_DEFAULT))


def available() -> bool:
    """The library is built and a Hopper GPU is there."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and library_path().is_file()


def _load():
    global _lib
    if _lib is None:
        path = library_path()
        if not path.is_file():
            raise FileNotFoundError(f"{path} is not built: python -m kernels.grouped_gemm_sm90.build --out {path} "
                                    f"(or set K3_GROUPED_GEMM_LIB)")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as err:  # the CUDA runtime it links is not loaded yet: take the one torch's wheel brings
            soname = re.search(r"libcudart\.so\.\d+", str(err))
            if soname is None or not _preload_cudart(soname.group()):
                raise
            lib = ctypes.CDLL(str(path))
        size_t, i32, i64, ptr = ctypes.c_size_t, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.k3gg_num_configs.restype = i32
        lib.k3gg_array_bytes.argtypes, lib.k3gg_array_bytes.restype = [i32, i32, i32], size_t
        lib.k3gg_workspace_bytes.argtypes, lib.k3gg_workspace_bytes.restype = [i32, i32, i32, i32], size_t
        lib.k3gg_run.argtypes = [i32, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i64, ptr, ptr, size_t, i32, ptr]
        lib.k3gg_run.restype = i32
        lib.k3gg_wgrad_run.argtypes = [i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, ptr, ptr, size_t, i32, ptr]
        lib.k3gg_wgrad_run.restype = i32
        lib.k3gg_expert_wgrad.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, ptr, ptr, size_t, i32, ptr]
        lib.k3gg_expert_wgrad.restype = i64
        lib.k3gg_batched_workspace_bytes.argtypes = [i32, i32, i32, i32, i32, i32]
        lib.k3gg_batched_workspace_bytes.restype = size_t
        lib.k3gg_batched_run.argtypes = [i32, ptr, ptr, ptr, i32, i32, i32, i32, ptr, size_t, i32, ptr]
        lib.k3gg_batched_run.restype = i32
        lib.k3gg_expert_tiled_workspace_bytes.argtypes = [i32, i32, i32, i32, i32, i32, i32]
        lib.k3gg_expert_tiled_workspace_bytes.restype = i64
        lib.k3gg_expert_tiled_run.argtypes = [i32, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr, size_t, i32, ptr]
        lib.k3gg_expert_tiled_run.restype = i32
        f32 = ctypes.c_float
        lib.k3gg_situ_forward.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr, f32, f32, ptr, size_t,
                                          i32, ptr]
        lib.k3gg_situ_forward.restype = i64
        lib.k3gg_situ_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr, ptr, f32, f32, ptr,
                                           size_t, i32, ptr]
        lib.k3gg_situ_backward.restype = i64
        abi = lib.k3gg_abi_version() if hasattr(lib, "k3gg_abi_version") else 1
        if abi != ABI_VERSION:
            raise RuntimeError(f"{path} has the entry points of version {abi}, this module calls version "
                               f"{ABI_VERSION}: rebuild it (python -m kernels.grouped_gemm_sm90.build --out {path})")
        if lib.k3gg_num_configs() != len(CONFIGS):
            raise RuntimeError(f"{path} holds {lib.k3gg_num_configs()} configurations, this module lists "
                               f"{len(CONFIGS)}: rebuild it")
        _lib = lib
    return _lib


def b_layout(b: torch.Tensor) -> str:
    """"k-major" (b[g] is a transposed packed [N, K]) or "n-major" (b[g] a packed [K, N]); ValueError else."""
    if b.dim() != 3:
        raise ValueError(f"b must be [G, K, N], got {tuple(b.shape)}")
    _, K, N = b.shape
    if b.stride(1) == 1 and b.stride(2) == K:
        return "k-major"
    if b.stride(2) == 1 and b.stride(1) == N:
        return "n-major"
    raise ValueError(f"each b[g] must be a packed [K, N] or a transposed packed [N, K]; got strides {b.stride()} "
                     f"for shape {tuple(b.shape)}")


def _check(tensors: dict[str, torch.Tensor], offsets: torch.Tensor, groups: int, config: int) -> None:
    if any(t.dtype != torch.bfloat16 for t in tensors.values()):
        raise ValueError(f"{' and '.join(tensors)} must be bf16, got {[t.dtype for t in tensors.values()]}")
    if offsets.shape != (groups,) or offsets.dtype != torch.int32 or not offsets.is_contiguous():
        raise ValueError(f"offsets must be a contiguous int32 [{groups}], got {offsets.dtype} {tuple(offsets.shape)}")
    devices = {t.device for t in (*tensors.values(), offsets)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"{', '.join(tensors)} and offsets must be on one CUDA device, got {devices}")
    if not 0 <= config < len(CONFIGS):
        raise ValueError(f"config {config}: choose 0..{len(CONFIGS) - 1} ({[c.name for c in CONFIGS]})")


def _check_status(status: int, what: str) -> None:
    """RuntimeError naming ``what`` and the step a library entry point failed at (``_STEPS``), if status ≠ 0."""
    if status:
        raise RuntimeError(f"{what}: failed at {_STEPS.get(status, status)}")


def _buffers(lib, config: int, mode: str, groups: int, device: torch.device):
    """The per-group array buffer and CUTLASS's workspace for ``groups`` groups: (arrays, workspace, its bytes,
    SM count)."""
    m = MODES[mode]
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    arrays = torch.empty(lib.k3gg_array_bytes(config, m, groups), dtype=torch.uint8, device=device)
    ws_bytes = lib.k3gg_workspace_bytes(config, m, groups, sm_count)
    workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=device)
    return arrays, workspace, ws_bytes, sm_count


def _run(config: int, mode: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor,
         N: int, K: int, b_group_stride: int) -> torch.Tensor:
    lib = _load()
    groups = offsets.shape[0]
    arrays, workspace, ws_bytes, sm_count = _buffers(lib, config, mode, groups, a.device)
    status = lib.k3gg_run(config, MODES[mode], a.data_ptr(), b.data_ptr(), out.data_ptr(), offsets.data_ptr(),
                          groups, N, K, b_group_stride, arrays.data_ptr(), workspace.data_ptr(), ws_bytes, sm_count,
                          torch.cuda.current_stream(a.device).cuda_stream)
    _check_status(status, f"grouped GEMM {CONFIGS[config].name}, {mode}, G={groups} N={N} K={K}")
    return out


def _wgrad(products: list[tuple[torch.Tensor, torch.Tensor]], offsets: torch.Tensor, config: int
           ) -> list[torch.Tensor]:
    """dw_p[e] = g_p[rows of e]ᵀ x_p[rows of e] for each (g_p, x_p) of ``products`` (one or two) in one launch."""
    _check_wgrad_products(products, offsets, config)
    experts, g0 = offsets.shape[0], products[0][0]
    outs = [g.new_empty(experts, g.shape[1], x.shape[1]) for g, x in products]
    if g0.shape[0] == 0:
        return [out.zero_() for out in outs]
    lib = _load()
    P = len(products)
    arrays, workspace, ws_bytes, sm_count = _buffers(lib, config, "wgrad", experts * P, g0.device)
    status = lib.k3gg_wgrad_run(config, *_c_products(products, outs), offsets.data_ptr(), experts, arrays.data_ptr(),
                                workspace.data_ptr(), ws_bytes, sm_count,
                                torch.cuda.current_stream(g0.device).cuda_stream)
    _check_status(status, f"grouped wgrad {CONFIGS[config].name}, {P} product(s), E={experts}")
    return outs


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, config: int = 0) -> torch.Tensor:
    """out[rows of g] = a[rows of g] @ b[g] (module docstring), with ``CONFIGS[config]``."""
    layout = b_layout(b)
    G, K, N = b.shape
    if a.dim() != 2 or a.shape[1] != K or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [M, {K}], got {tuple(a.shape)} with strides {a.stride()}")
    _check({"a": a, "b": b}, offsets, G, config)
    out = a.new_empty(a.shape[0], N)
    if a.shape[0] == 0:
        return out
    return _run(config, layout, a, b, out, offsets, N, K, b.stride(0))


def _c_products(products: list[tuple[torch.Tensor, torch.Tensor]], outs: list[torch.Tensor]) -> tuple:
    """The weight-gradient entry points' product arguments: (P, g pointers, x pointers, dw pointers, O, C) as C
    arrays of length P."""
    P = len(products)
    ptrs, ints = ctypes.c_void_p * P, ctypes.c_int * P
    return (P, ptrs(*(g.data_ptr() for g, _ in products)), ptrs(*(x.data_ptr() for _, x in products)),
            ptrs(*(o.data_ptr() for o in outs)), ints(*(g.shape[1] for g, _ in products)),
            ints(*(x.shape[1] for _, x in products)))


def _check_wgrad_products(products: list[tuple[torch.Tensor, torch.Tensor]], offsets: torch.Tensor,
                          config: int) -> None:
    for i, (g, x) in enumerate(products):
        if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0] or not (g.is_contiguous() and x.is_contiguous()):
            raise ValueError(f"product {i}: g and x must be contiguous [M, O] and [M, C], got {tuple(g.shape)} and "
                             f"{tuple(x.shape)}")
        _check({"g": g, "x": x}, offsets, offsets.shape[0] if offsets.dim() == 1 else -1, config)
    if len({g.shape[0] for g, _ in products}) != 1:
        raise ValueError(f"the products' rows differ: {[tuple(g.shape) for g, _ in products]}")


def expert_tiled_wgrad(products: list[tuple[torch.Tensor, torch.Tensor]], offsets: torch.Tensor) -> list[torch.Tensor]:
    """dw_p[e] = g_p[rows of e]ᵀ x_p[rows of e] for each (g_p, x_p) of ``products`` (one or two) on the expert-tiled
    kernel: every expert's rows start and end on a multiple of ``EXPERT_WGRAD_ROW_TILE`` (the padded layout's
    offsets; not checked, it would read the host), one launch ordering the experts, one GEMM launch a product."""
    _check_wgrad_products(products, offsets, 0)
    experts, (g0, _) = offsets.shape[0], products[0]
    if g0.shape[0] % EXPERT_WGRAD_ROW_TILE:
        raise ValueError(f"the expert-tiled weight gradient reads rows padded per expert to a multiple of "
                         f"{EXPERT_WGRAD_ROW_TILE}; got {g0.shape[0]} rows")
    outs = [g.new_empty(experts, g.shape[1], x.shape[1]) for g, x in products]
    if g0.shape[0] == 0:
        return [out.zero_() for out in outs]
    lib, P = _load(), len(products)
    sm_count = torch.cuda.get_device_properties(g0.device).multi_processor_count
    args = (*_c_products(products, outs), offsets.data_ptr(), experts, g0.shape[0])
    ws_bytes = lib.k3gg_expert_wgrad(*args, None, None, 0, sm_count, None)
    workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=g0.device)
    order = torch.empty(experts, dtype=torch.int32, device=g0.device)
    status = lib.k3gg_expert_wgrad(*args, order.data_ptr(), workspace.data_ptr(), ws_bytes, sm_count,
                                   torch.cuda.current_stream(g0.device).cuda_stream)
    _check_status(status, f"expert-tiled wgrad, {P} product(s), E={experts}")
    return outs


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, config: int = 0) -> torch.Tensor:
    """dw[e] = g[rows of e]ᵀ x[rows of e] (module docstring), with ``CONFIGS[config]``."""
    return _wgrad([(g, x)], offsets, config)[0]


def grouped_wgrad_pair(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, offsets: torch.Tensor,
                       config: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(``grouped_wgrad``(g1, x1), ``grouped_wgrad``(g2, x2)) in one launch (module docstring)."""
    dw1, dw2 = _wgrad([(g1, x1), (g2, x2)], offsets, config)
    return dw1, dw2


def batched_mm(a: torch.Tensor, b: torch.Tensor, config: int = 0) -> torch.Tensor:
    """out[l] = a[l] @ b[l] on the plain batched kernel of ``CONFIGS[config]`` (module docstring)."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1] or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [L, M, K] and b an [L, K, N], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if b_layout(b) != "k-major" or not b.transpose(1, 2).is_contiguous():
        raise ValueError("b must be the transposed view of a packed [L, N, K] tensor")
    (L, M, K), N = a.shape, b.shape[2]
    _check({"a": a, "b": b}, torch.zeros(1, dtype=torch.int32, device=a.device), 1, config)
    out = a.new_empty(L, M, N)
    lib = _load()
    sm_count = torch.cuda.get_device_properties(a.device).multi_processor_count
    ws_bytes = lib.k3gg_batched_workspace_bytes(config, L, M, N, K, sm_count)
    workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=a.device)
    status = lib.k3gg_batched_run(config, a.data_ptr(), b.data_ptr(), out.data_ptr(), L, M, N, K,
                                  workspace.data_ptr(), ws_bytes, sm_count,
                                  torch.cuda.current_stream(a.device).cuda_stream)
    _check_status(status, f"batched GEMM {CONFIGS[config].name}, L={L} M={M} N={N} K={K}")
    return out


def capacity_tiles(rows: int, groups: int, tile_m: int) -> int:
    """M tiles enough for ``rows`` rows in ``groups`` groups each padded to a multiple of ``tile_m``, whatever
    the split: Σ⌈c_g / t⌉ ≤ ⌊(rows + groups·(t − 1)) / t⌋."""
    return (rows + groups * (tile_m - 1)) // tile_m


def padding_shift(counts: torch.Tensor, tile_m: int) -> torch.Tensor:
    """[G] int64: how far each group's rows move when every group is padded to a multiple of ``tile_m``
    (group g then starts at row tile_m · Σ_{j<g} ⌈c_j / tile_m⌉ instead of Σ_{j<g} c_j); ``counts`` [G]."""
    counts = counts.long()
    tiles = (counts + tile_m - 1) // tile_m
    return (tile_m * tiles - counts).cumsum(0) - (tile_m * tiles - counts)


def padded_rows(offsets: torch.Tensor, rows: int, tile_m: int) -> torch.Tensor:
    """[rows] int64: where each of ``rows`` group-sorted rows (cumulative counts ``offsets`` [G], offsets[-1] ==
    rows) goes in the padded layout (``padding_shift``). On the device, no host read."""
    ends = offsets.long()
    row = torch.arange(rows, device=ends.device)
    return row + padding_shift(torch.diff(ends, prepend=ends.new_zeros(1)), tile_m)[
        torch.searchsorted(ends, row, right=True)]


def expert_tiles(offsets: torch.Tensor, rows: int, tile_m: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded layout of ``expert_tiled_mm``: ``padded_rows`` and ``tile_groups`` ([capacity] int32, the
    group of each M tile, -1 past the last)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    return padded_rows(offsets, rows, tile_m), tile_groups(torch.cumsum((counts + tile_m - 1) // tile_m, 0), capacity)


def tile_groups(tile_end: torch.Tensor, capacity: int) -> torch.Tensor:
    """[capacity] int32: the group of each M tile, from the groups' cumulative tile counts ``tile_end`` [G]
    (for rows already padded per group: the cumulative row counts // tile_m); -1 past the last."""
    group = torch.searchsorted(tile_end.long(), torch.arange(capacity, device=tile_end.device), right=True)
    return torch.where(group < tile_end.numel(), group, -1).to(torch.int32)


def expert_tiled_mm(a: torch.Tensor, b: torch.Tensor, tile_expert: torch.Tensor, config: int = 0) -> torch.Tensor:
    """out[tile m] = a[tile m] @ b[tile_expert[m]] (module docstring) on the expert-tiled kernel of
    ``CONFIGS[config]``: a [capacity · tile_m, K] bf16 contiguous, b [G, K, N] either layout, tile_expert
    [capacity] int32 → out [capacity · tile_m, N]."""
    layout = b_layout(b)
    G, K, N = b.shape
    config_ok = 0 <= config < len(CONFIGS) and CONFIGS[config].cluster_m == 1
    if not config_ok:
        raise ValueError(f"config {config}: the expert-tiled kernels are the one-CTA-cluster configurations "
                         f"{[i for i, c in enumerate(CONFIGS) if c.cluster_m == 1]}")
    tile_m = CONFIGS[config].tile[0]
    if tile_expert.dim() != 1 or a.dim() != 2 or a.shape != (tile_expert.shape[0] * tile_m, K) or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [len(tile_expert) * {tile_m}, {K}] = "
                         f"[{tile_expert.shape[0] * tile_m}, {K}], got {tuple(a.shape)}")
    _check({"a": a, "b": b}, tile_expert, tile_expert.shape[0], config)
    out = a.new_empty(a.shape[0], N)
    if a.shape[0] == 0:
        return out
    lib = _load()
    mode = MODES[layout]
    sm_count = torch.cuda.get_device_properties(a.device).multi_processor_count
    ws_bytes = lib.k3gg_expert_tiled_workspace_bytes(config, mode, G, a.shape[0], N, K, sm_count)
    workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=a.device)
    status = lib.k3gg_expert_tiled_run(config, mode, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                                       tile_expert.data_ptr(), G, a.shape[0], N, K, workspace.data_ptr(), ws_bytes,
                                       sm_count, torch.cuda.current_stream(a.device).cuda_stream)
    _check_status(status, f"expert-tiled GEMM {CONFIGS[config].name}, {layout}, G={G} M={a.shape[0]} N={N} K={K}")
    return out


def expert_tiled_mm_reference(a: torch.Tensor, b: torch.Tensor, tile_expert: torch.Tensor, tile_m: int) -> torch.Tensor:
    """What ``expert_tiled_mm`` computes, tile by tile in plain torch (any device); padding tiles give 0."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    for m, group in enumerate(tile_expert.tolist()):
        if group >= 0:
            out[m * tile_m:(m + 1) * tile_m] = a[m * tile_m:(m + 1) * tile_m] @ b[group]
    return out


SITU_CONFIG = 1  # the configuration whose expert-tiled products carry SiTU in their epilogues (situ_epilogue.cuh)


def _situ_operands(a: torch.Tensor, w: torch.Tensor, tile_expert: torch.Tensor, row_scale: torch.Tensor | None,
                   width: int) -> torch.Tensor | None:
    """Checks the SiTU products' operands (a [capacity · 64, K], w [G, ., .] packed, SiTU ``width`` I); row_scale as
    fp32 [M] (or None)."""
    tile_m = CONFIGS[SITU_CONFIG].tile[0]
    if a.dim() != 2 or w.dim() != 3 or not (a.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"a and w must be a contiguous [M, K] and [G, ., .], got {tuple(a.shape)} and {tuple(w.shape)}")
    if tile_expert.dim() != 1 or a.shape[0] != tile_expert.shape[0] * tile_m:
        raise ValueError(f"a must have len(tile_expert) * {tile_m} = {tile_expert.shape[0] * tile_m} rows, got "
                         f"{a.shape[0]}")
    if width % 8:
        raise ValueError(f"the SiTU width (I = {width}) must be a multiple of 8 (16-byte rows of h)")
    _check({"a": a, "w": w}, tile_expert, tile_expert.shape[0], SITU_CONFIG)
    if row_scale is None:
        return None
    if row_scale.shape != (a.shape[0],) or row_scale.device != a.device:
        raise ValueError(f"row_scale must be [{a.shape[0]}] on {a.device}, got {tuple(row_scale.shape)} on "
                         f"{row_scale.device}")
    return row_scale.float().contiguous()


def _situ_call(fn, name: str, shape: str, *args) -> None:
    """Runs a SiTU entry point of the library (workspace query first) on torch's current stream."""
    device = args[0].device
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    ws_bytes = fn(*ptrs, None, 0, sm_count, None)
    workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=device)
    status = fn(*ptrs, workspace.data_ptr(), ws_bytes, sm_count, torch.cuda.current_stream(device).cuda_stream)
    _check_status(status, f"{name} {shape}")


def expert_tiled_situ_forward(x: torch.Tensor, w13: torch.Tensor, tile_expert: torch.Tensor,
                              row_scale: torch.Tensor | None = None, beta: float = 4.0,
                              linear_beta: float = 25.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre, h): pre = x @ w13[e]ᵀ tile by tile (``expert_tiled_mm`` on configuration ``SITU_CONFIG``) and
    h[m, j] = s_m · SiTU(pre[m, 2j], pre[m, 2j + 1]) from the product's fp32 accumulators, in its epilogue.

    x [capacity · 64, ℓ] bf16; w13 [G, 2I, ℓ] bf16 with interleaved rows (2j: gate_j, 2j + 1: up_j), both
    contiguous; tile_expert [capacity] int32; row_scale [M] (fp32 or bf16) or None (1) → pre [M, 2I], h [M, I] bf16;
    padding rows and tiles past the last group are unspecified."""
    G, two_i, ell = w13.shape
    s = _situ_operands(x, w13, tile_expert, row_scale, two_i // 2)
    if x.shape[1] != ell or two_i % 2:
        raise ValueError(f"x [M, {x.shape[1]}] and w13 {tuple(w13.shape)}: need w13 [G, 2I, {x.shape[1]}]")
    M = x.shape[0]
    pre, h = x.new_empty(M, two_i), x.new_empty(M, two_i // 2)
    if M:
        _situ_call(_load().k3gg_situ_forward, "expert-tiled W13 + SiTU", f"G={G} M={M} N={two_i} K={ell}",
                   x, w13, pre, h, tile_expert, G, M, two_i, ell, s, float(beta), float(linear_beta))
    return pre, h


def expert_tiled_situ_backward(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, tile_expert: torch.Tensor,
                               row_scale: torch.Tensor | None = None, beta: float = 4.0, linear_beta: float = 25.0
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d_pre, ds): with dh = dy @ w2[e] tile by tile (the W2 dgrad, kept in the epilogue's fp32 accumulators),
    (d_pre[m, 2j], d_pre[m, 2j + 1]) = s_m · dh[m, j] · ∇SiTU(pre[m, 2j], pre[m, 2j + 1]) and
    ds[m] = Σ_j dh[m, j] · SiTU(pre[m, 2j], pre[m, 2j + 1]), the gradient of row_scale (None without one).

    dy [capacity · 64, ℓ], w2 [G, ℓ, I] and pre [M, 2I] (``expert_tiled_situ_forward``'s) bf16 contiguous →
    d_pre [M, 2I] bf16 (interleaved as pre), ds [M] fp32; padding rows and tiles past the last group unspecified."""
    G, ell, width = w2.shape
    s = _situ_operands(dy, w2, tile_expert, row_scale, width)
    M = dy.shape[0]
    if dy.shape[1] != ell or pre.shape != (M, 2 * width) or pre.dtype != torch.bfloat16 or not pre.is_contiguous():
        raise ValueError(f"dy {tuple(dy.shape)}, w2 {tuple(w2.shape)}, pre {tuple(pre.shape)} {pre.dtype}: need dy "
                         f"[M, {ell}] and a contiguous bf16 pre [M, {2 * width}]")
    d_pre = pre.new_empty(M, 2 * width)
    ds = None if s is None else (torch.zeros if width > CONFIGS[SITU_CONFIG].tile[1] else torch.empty)(
        M, dtype=torch.float32, device=dy.device)  # summed over N tiles where there are several
    if M:
        _situ_call(_load().k3gg_situ_backward, "expert-tiled W2 dgrad + SiTU backward",
                   f"G={G} M={M} N={width} K={ell}", dy, w2, pre, d_pre, tile_expert, G, M, width, ell, s,
                   0 if ds is None else ds, float(beta), float(linear_beta))
    return d_pre, ds


def expert_tiled_situ_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, tile_expert: torch.Tensor,
                                dy: torch.Tensor, row_scale: torch.Tensor | None = None, beta: float = 4.0,
                                linear_beta: float = 25.0) -> dict[str, torch.Tensor]:
    """What the two SiTU products compute, in fp32 plain torch (any device; padding tiles give 0): "pre" and "h" of
    ``expert_tiled_situ_forward``, and "d_pre" and "ds" of ``expert_tiled_situ_backward`` at dy and that pre
    rounded to bf16 (what the backward reads)."""
    tile_m = CONFIGS[SITU_CONFIG].tile[0]
    s = torch.ones(x.shape[0], device=x.device) if row_scale is None else row_scale.float()
    pre = expert_tiled_mm_reference(x.float(), w13.float().transpose(1, 2), tile_expert, tile_m)
    h = situ_reference.situ_forward(pre[:, 0::2], pre[:, 1::2], beta, linear_beta, s)
    pre_read = pre.bfloat16().float()
    gate, up = pre_read[:, 0::2], pre_read[:, 1::2]
    dh = expert_tiled_mm_reference(dy.float(), w2.float(), tile_expert, tile_m)
    d_gate, d_up = situ_reference.situ_backward(gate, up, dh * s.unsqueeze(1), beta, linear_beta)
    ds = (dh * situ_reference.situ_forward(gate, up, beta, linear_beta)).sum(1)
    return {"pre": pre, "h": h, "d_pre": torch.stack((d_gate, d_up), 2).flatten(1), "ds": ds}


@torch.library.custom_op("k3::grouped_mm_sm90", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, groups: torch.Tensor, config: int, tiled: bool) -> torch.Tensor:
    """``grouped_mm`` (``groups`` = offsets) or, ``tiled``, ``expert_tiled_mm`` (``groups`` = tile_expert)."""
    return (expert_tiled_mm if tiled else grouped_mm)(a, b, groups, config)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a, b, groups, config, tiled):
    return a.new_empty(a.shape[0], b.shape[2])


def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, config: int = 0) -> torch.Tensor:
    """``grouped_mm`` as the custom op ``k3::grouped_mm_sm90``: what compiled graphs call."""
    return _grouped_mm_op(a, b, offsets, config, False)


def expert_tiled_mm_op(a: torch.Tensor, b: torch.Tensor, tile_expert: torch.Tensor, config: int = 0) -> torch.Tensor:
    """``expert_tiled_mm`` as the same custom op: what compiled graphs call."""
    return _grouped_mm_op(a, b, tile_expert, config, True)


@torch.library.custom_op("k3::grouped_wgrad_sm90", mutates_args=())
def _grouped_wgrad_op(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, config: int) -> torch.Tensor:
    return grouped_wgrad(g, x, offsets, config)


@_grouped_wgrad_op.register_fake
def _grouped_wgrad_fake(g, x, offsets, config):
    return g.new_empty(offsets.shape[0], g.shape[1], x.shape[1])


def grouped_wgrad_op(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, config: int = 0) -> torch.Tensor:
    """``grouped_wgrad`` as the custom op ``k3::grouped_wgrad_sm90``: what compiled graphs call."""
    return _grouped_wgrad_op(g, x, offsets, config)


@torch.library.custom_op("k3::grouped_wgrad_pair_sm90", mutates_args=())
def _grouped_wgrad_pair_op(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                           offsets: torch.Tensor, config: int) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_wgrad_pair(g1, x1, g2, x2, offsets, config)


@_grouped_wgrad_pair_op.register_fake
def _grouped_wgrad_pair_fake(g1, x1, g2, x2, offsets, config):
    return _grouped_wgrad_fake(g1, x1, offsets, config), _grouped_wgrad_fake(g2, x2, offsets, config)


def grouped_wgrad_pair_op(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                          offsets: torch.Tensor, config: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_wgrad_pair`` as the custom op ``k3::grouped_wgrad_pair_sm90``: what compiled graphs call."""
    return _grouped_wgrad_pair_op(g1, x1, g2, x2, offsets, config)


@torch.library.custom_op("k3::expert_wgrad_pair_sm90", mutates_args=())
def _expert_wgrad_pair_op(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                          offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dw1, dw2 = expert_tiled_wgrad([(g1, x1), (g2, x2)], offsets)
    return dw1, dw2


@_expert_wgrad_pair_op.register_fake
def _expert_wgrad_pair_fake(g1, x1, g2, x2, offsets):
    return _grouped_wgrad_fake(g1, x1, offsets, 0), _grouped_wgrad_fake(g2, x2, offsets, 0)


def expert_wgrad_pair_op(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                         offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_tiled_wgrad`` of the two products as the custom op ``k3::expert_wgrad_pair_sm90``."""
    return _expert_wgrad_pair_op(g1, x1, g2, x2, offsets)


@torch.library.custom_op("k3::expert_wgrad_sm90", mutates_args=())
def _expert_wgrad_op(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return expert_tiled_wgrad([(g, x)], offsets)[0]


@_expert_wgrad_op.register_fake
def _expert_wgrad_fake(g, x, offsets):
    return _grouped_wgrad_fake(g, x, offsets, 0)


def expert_wgrad_op(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``expert_tiled_wgrad`` of one product as the custom op ``k3::expert_wgrad_sm90``."""
    return _expert_wgrad_op(g, x, offsets)


@torch.library.custom_op("k3::situ_forward_sm90", mutates_args=())
def _situ_forward_op(x: torch.Tensor, w13: torch.Tensor, tile_expert: torch.Tensor, row_scale: torch.Tensor | None,
                     beta: float, linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return expert_tiled_situ_forward(x, w13, tile_expert, row_scale, beta, linear_beta)


@_situ_forward_op.register_fake
def _situ_forward_fake(x, w13, tile_expert, row_scale, beta, linear_beta):
    return x.new_empty(x.shape[0], w13.shape[1]), x.new_empty(x.shape[0], w13.shape[1] // 2)


@torch.library.custom_op("k3::situ_backward_sm90", mutates_args=())
def _situ_backward_op(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, tile_expert: torch.Tensor,
                      row_scale: torch.Tensor | None, beta: float, linear_beta: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    d_pre, ds = expert_tiled_situ_backward(dy, w2, pre, tile_expert, row_scale, beta, linear_beta)
    return d_pre, dy.new_empty(0, dtype=torch.float32) if ds is None else ds


@_situ_backward_op.register_fake
def _situ_backward_fake(dy, w2, pre, tile_expert, row_scale, beta, linear_beta):
    return pre.new_empty(pre.shape), dy.new_empty(0 if row_scale is None else dy.shape[0], dtype=torch.float32)


def expert_tiled_situ_forward_op(x: torch.Tensor, w13: torch.Tensor, tile_expert: torch.Tensor,
                                 row_scale: torch.Tensor | None, beta: float,
                                 linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_tiled_situ_forward`` as the custom op ``k3::situ_forward_sm90``: what compiled graphs call."""
    return _situ_forward_op(x, w13, tile_expert, row_scale, float(beta), float(linear_beta))


def expert_tiled_situ_backward_op(dy: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, tile_expert: torch.Tensor,
                                  row_scale: torch.Tensor | None, beta: float,
                                  linear_beta: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``expert_tiled_situ_backward`` as the custom op ``k3::situ_backward_sm90`` (ds None without row_scale)."""
    d_pre, ds = _situ_backward_op(dy, w2, pre, tile_expert, row_scale, float(beta), float(linear_beta))
    return d_pre, None if row_scale is None else ds
