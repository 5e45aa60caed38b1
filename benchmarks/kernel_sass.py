"""Our Triton kernels' machine code for a GPU we need not have: instructions, registers and spills.

    python benchmarks/kernel_sass.py [--kernels situ attn_res] [--arch 90] [--json kernel_sass.json]

Each kernel is compiled for ``sm_<arch>`` by the installed Triton (its bundled ptxas; pointers 16-byte
aligned, as the JIT specializes them at run time) and its cubin read with Triton's bundled cuobjdump:
registers and stack bytes a thread, and the static SASS instruction count without NOPs. Integer
arguments are taken as multiples of 16 too (the JIT specializes them so; every bench shape is one). For a kernel
without loops (SiTU) that count is what every thread issues, so it is also given per element a thread
handles. The figures belong to the installed Triton (the H200 machines run 3.6; pip install
``triton==3.6.0`` into a separate environment and put it first on ``PYTHONPATH`` to match them).

Used for kernels bound by instruction issue rather than bytes (``docs/decisions.md``, "Elementwise
kernels keep the accuracy their output can hold") and for register pressure of the AttnRes row kernels
(``docs/kernels_attn_res.md``). Needs ``TRITON_INTERPRET`` unset (the interpreter has no compiler).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_sass.py compiles kernels: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.attn_res import triton_attn_res as attn_res  # noqa: E402
from kernels.situ import triton_situ as situ  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_kernel(kernel, types: dict[str, str], constexprs: dict, num_warps: int, arch: int) -> dict:
    """Registers, stack bytes and SASS instructions (NOPs left out) of ``kernel`` for ``sm_<arch>``.
    ``types`` gives every runtime argument's Triton type ("*bf16", "i32", "fp32", ...); the rest of
    ``kernel``'s arguments are the constexprs."""
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name].startswith("*") or signature[name] == "i32"}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":") for line in usage.splitlines() if "REG:" in line for tok in line.split()
                  if ":" in tok and tok.split(":")[1].isdigit())
    instructions = [line.split("*/")[1].split()[0] for line in sass.splitlines()
                    if line.strip().startswith("/*") and "*/" in line and len(line.split("*/")) > 2]
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
            "instructions": sum(1 for op in instructions if not op.startswith("NOP"))}


def situ_rows(arch: int) -> list[dict]:
    """SiTU-GLU forward and backward at the GPU launch config, bf16 and fp32 tensors, on interleaved (gate, up)
    pairs (``PAIRS``: the routed experts' layout)."""
    block_n = situ.GPU_MAX_BLOCK_N
    block_m, warps = situ.GPU_BLOCK_ELEMS // block_n, situ.GPU_NUM_WARPS
    per_thread = block_m * block_n / (warps * 32)
    rows = []
    for dtype in ("bf16", "fp32"):
        for name, kernel in (("situ fwd", situ._situ_fwd_kernel), ("situ bwd", situ._situ_bwd_kernel)):
            types = {arg: ("i32" if arg in ("M", "I") or arg.startswith("stride") else
                           "fp32" if "beta" in arg else f"*{dtype}") for arg in kernel.arg_names
                     if arg not in ("BLOCK_M", "BLOCK_N", "PAIRS")}
            r = compile_kernel(kernel, types, {"BLOCK_M": block_m, "BLOCK_N": block_n, "PAIRS": True}, warps, arch)
            rows.append({"kernel": name, "dtype": dtype, "tile": f"{block_m}x{block_n}x{warps}w", **r,
                         "instructions_per_element": r["instructions"] / per_thread})
    return rows


def attn_res_rows(arch: int, sources: list[int], tiles: list[tuple[int, int]], d: int = 1024) -> list[dict]:
    """The AttnRes row kernels as the model runs most of its sites: the norm, fp32 sources, a bf16 output, a
    bf16 residual added to the last source, every source passed on (backward), at d features and each
    (tokens, warps) tile."""
    rows = []
    for name, kernel in (("attn_res rows fwd", attn_res._attn_res_fwd_rows_kernel),
                         ("attn_res rows bwd", attn_res._attn_res_bwd_rows_kernel)):
        types = {arg: ("i32" if arg in ("M", "D") else "fp32" if arg in ("eps", "norm_eps") else
                       "*bf16" if arg in ("O", "G", "RES", "DRES") else "*fp32") for arg in kernel.arg_names
                 if arg not in ("S", "S_PAD", "NORM", "GRAD_IN", "ADD_LAST", "BLOCK_M", "BLOCK_D")}
        for S in sources:
            for block_m, warps in tiles:
                consts = {"S": S, "S_PAD": max(2, triton.next_power_of_2(S)), "NORM": True, "ADD_LAST": True,
                          "BLOCK_M": block_m, "BLOCK_D": d}
                if "GRAD_IN" in kernel.arg_names:
                    consts["GRAD_IN"] = (1 << S) - 1
                r = compile_kernel(kernel, types, consts, warps, arch)
                rows.append({"kernel": name, "sources": S, "tile": f"{block_m}x{warps}w", **r})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", nargs="+", choices=("situ", "attn_res"), default=["situ", "attn_res"])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    p.add_argument("--sources", type=int, nargs="+", default=[2, 5, 8], help="AttnRes source counts")
    p.add_argument("--tiles", nargs="+", default=["1x4", "2x4"], help="AttnRes tiles, tokens x warps")
    p.add_argument("--json", default="kernel_sass.json")
    args = p.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles]
    rows = (situ_rows(args.arch) if "situ" in args.kernels else []) + (
        attn_res_rows(args.arch, args.sources, tiles) if "attn_res" in args.kernels else [])
    print(f"sm_{args.arch}, triton {triton.__version__}")
    print(f"{'kernel':>18} {'dtype/S':>8} {'tile':>12} {'regs':>5} {'stack B':>8} {'instr':>6} {'instr/elem':>10}")
    for r in rows:
        per = f"{r['instructions_per_element']:.1f}" if "instructions_per_element" in r else ""
        print(f"{r['kernel']:>18} {r.get('dtype', r.get('sources')):>8} {r['tile']:>12} {r['registers']:>5} "
              f"{r['stack_bytes']:>8} {r['instructions']:>6} {per:>10}")
    with open(args.json, "w") as f:
        json.dump({"arch": args.arch, "triton": triton.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
