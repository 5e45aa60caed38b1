"""Programmatic dependent launch (``kernels.grid_dependency``): the CPU tests run the MoE layer's Triton kernels
through the interpreter with ``PDL`` off, so here each of them is compiled for sm_90 with it on (Triton's own
ptxas, no GPU) and its PTX checked: ``griddepcontrol.launch_dependents`` then ``griddepcontrol.wait`` before the
first global load or store; with it off, neither."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from kernels.grid_dependency import launch_options

REPO = Path(__file__).resolve().parents[2]

_COMPILE = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.grouped_wgrad import triton_grouped_wgrad
from kernels.moe_permute import triton_permute
from kernels.moe_plan import triton_plan

FLOATS = {"Z", "X", "DX", "DZ", "Y", "W", "U", "DU", "DY", "DW", "DW1", "DW2"}
SCALARS = {"N", "P", "L", "M", "NB", "G", "E", "O", "C", "O1", "C1", "O2", "C2", "ROWS", "TILES", "FIRST"}
PERMUTE = dict(TOP_K=8, KP=8, BLOCK_T=2, BLOCK_L=512)
WGRAD = dict(BM=128, BN=256, BK=64)
KERNELS = [
    (triton_permute._dispatch_fwd_kernel, PERMUTE), (triton_permute._dispatch_bwd_kernel, PERMUTE),
    (triton_permute._combine_fwd_kernel, PERMUTE),
    (triton_permute._combine_bwd_kernel, dict(PERMUTE, NEED_DY=True, NEED_DW=True)),
    (triton_plan._block_counts_kernel, dict(BLOCK=128, GP=128)),
    (triton_plan._scan_blocks_kernel, dict(T=64, CHUNK=1024)),
    (triton_plan._group_starts_kernel, dict(GP=128)), (triton_plan._place_kernel, dict(BLOCK=128, TP=64)),
    (triton_plan._group_offsets_kernel, dict(T=64, GP=128, TB=128)),
    (triton_grouped_wgrad._by_size_kernel, dict(BLOCK=128)), (triton_grouped_wgrad._grouped_wgrad_kernel, WGRAD),
    (triton_grouped_wgrad._grouped_wgrad_pair_kernel, WGRAD),
]


def kind(kernel, name, constexprs):
    if name in constexprs or name == "PDL":
        return "constexpr"
    if constexprs is WGRAD and name in ("G", "G1", "G2", "X", "X1", "X2"):
        return "tensordesc<bf16[64, 128]>" if name[0] == "G" else "tensordesc<bf16[64, 256]>"
    if name in SCALARS or name.startswith("stride"):
        return "i32"
    int32 = {"N_BLOCK", "BEFORE", "OFFSETS", "TILE_GROUP"} | ({"ORDER"} if "wgrad" in kernel.fn.__module__ else set())
    return "*bf16" if name in FLOATS else "*i32" if name in int32 else "*i64"


for kernel, constexprs in KERNELS:
    for pdl in (True, False):
        signature = {a: kind(kernel, a, constexprs) for a in kernel.arg_names}
        src = ASTSource(kernel, signature, constexprs=dict(constexprs, PDL=pdl))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
        body = ptx[ptx.index("{", ptx.index(".entry")):]
        first_memory = min((m.start() for m in re.finditer(r"\\b(ld|st|cp)\\.(global|async)|cp\\.async", body)),
                           default=len(body))
        marks = [body.find(i) for i in ("griddepcontrol.launch_dependents", "griddepcontrol.wait")]
        print(kernel.fn.__name__, pdl, *marks, first_memory)
"""


def test_pdl_kernels_signal_and_wait_before_touching_memory():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line]
    assert len(rows) == 24, r.stdout
    for name, pdl, launch, wait, first_memory in rows:
        launch, wait, first_memory = int(launch), int(wait), int(first_memory)
        if pdl == "True":
            assert 0 <= launch < wait < first_memory, (name, launch, wait, first_memory)
        else:
            assert launch == wait == -1, name


def test_launch_options_are_off_on_cpu(monkeypatch):
    """Opt-in with K3_PDL=1, and never for CPU tensors (the interpreter runs no PTX)."""
    assert launch_options(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setenv("K3_PDL", "1")
    assert launch_options(torch.zeros(1)) == {"PDL": False}
