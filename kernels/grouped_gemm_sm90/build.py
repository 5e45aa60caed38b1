"""Build ``grouped_gemm.cu`` into the shared library ``kernels.grouped_gemm_sm90`` loads (sm_90a; no GPU needed).

    pip install nvidia-cutlass==4.2.0.0     # CUTLASS's C++ headers (6.4 MB), or pass --cutlass DIR
    python -m kernels.grouped_gemm_sm90.build [--out PATH] [--cutlass DIR] [--nvcc nvcc]

DIR holds CUTLASS's ``include/`` and ``tools/util/include/`` (a CUTLASS checkout, or the installed
``cutlass_library/source``). The library links the CUDA runtime as a shared library, the one torch loads.
Building takes ~3 minutes on two cores (five kernel configurations: grouped in three modes, plain batched,
and expert-tiled in two B layouts where the cluster is one CTA; and configuration 1's two products with SiTU in
their epilogues, ``situ_epilogue.cuh``, included by ``grouped_gemm.cu``).
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from kernels.grouped_gemm_sm90 import LIB_DEFAULT

SOURCE = Path(__file__).with_name("grouped_gemm.cu")


def cutlass_root(given: str | None) -> Path:
    """The folder with CUTLASS's include/ and tools/util/include/."""
    if given:
        root = Path(given)
    else:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("no CUTLASS headers: pip install nvidia-cutlass==4.2.0.0, or pass --cutlass DIR")
        root = Path(next(iter(spec.submodule_search_locations))) / "source"
    for sub in ("include/cutlass/cutlass.h", "tools/util/include/cutlass/util/packed_stride.hpp"):
        if not (root / sub).is_file():
            raise SystemExit(f"{root} has no {sub}: --cutlass must name a folder with CUTLASS's include/ and "
                             f"tools/util/include/")
    return root


def nvcc_command(nvcc: str, root: Path, out: Path) -> list[str]:
    return [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-gencode", "arch=compute_90a,code=sm_90a",
            "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared", "-cudart", "shared",
            f"-I{root / 'include'}", f"-I{root / 'tools' / 'util' / 'include'}", str(SOURCE), "-o", str(out)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(LIB_DEFAULT))
    ap.add_argument("--cutlass", help="folder with CUTLASS's include/ and tools/util/include/")
    ap.add_argument("--nvcc", default="nvcc")
    args = ap.parse_args(argv)
    if shutil.which(args.nvcc) is None:
        raise SystemExit(f"{args.nvcc} is not on PATH: the build needs CUDA's compiler (12.3 or newer)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = nvcc_command(args.nvcc, cutlass_root(args.cutlass), out)
    print(shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    print(f"built {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
