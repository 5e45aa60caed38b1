"""benchmarks/op_timing.py: the profile's kernel keys."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from op_timing import kernel_key  # noqa: E402


def test_kernel_keys_keep_long_names_apart():
    """Two template kernels that share their first 80 characters (CUTLASS's mangled names do) get two keys, each
    the shared prefix and a hash of the whole name, the same on every call; short names stay as they are."""
    prefix = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIN4cute5tupleIJiiiiEEENS_1"
    a, b = prefix + "Cooperative", prefix + "Pingpong"
    assert kernel_key(a) != kernel_key(b)
    assert kernel_key(a) == kernel_key(a) and kernel_key(a).startswith(prefix[:80] + " #")
    assert kernel_key("_dispatch_fwd_kernel") == "_dispatch_fwd_kernel"
    assert kernel_key(a, name_chars=200) == a
