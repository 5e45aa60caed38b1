"""Kernel launches of one training step by module and op, counted on CPU: a proxy of the GPU step's
launch count (the eager step is host-bound, so launches cost time) for when no GPU is at hand.

    TRITON_INTERPRET=1 python benchmarks/launch_census.py --model k3_tiny --seq 32 [--json out.json]

The step is the trainer's micro-batch without the optimizer: bf16 parameters with fp32 main
gradients (``MainParams``, ``GradBuffers``), forward under bf16 autocast on packed documents,
backward, the gradient buffers' reduce. It runs within ``kernels.backend.triton_on_cpu()``, so our
Triton kernels run through the interpreter and each launch counts as one kernel, as on the GPU. Every other leaf aten op that computes counts as one kernel; views, allocations and
metadata ops count none. What the CPU does differently is left out: the copy behind a mixed-dtype
add or multiply (CUDA casts inside the kernel), the fill a CPU reduction starts with, and the
insides of the CPU grouped GEMM loop and of the math SDPA (each counted as one kernel). The
count is a proxy: compare trees with it, and measure on the GPU with ``train_step.py --profile``.
Ops are charged to modules as ``k3train.training.module_time`` does (backward ops to the module
whose forward recorded them).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.backend import triton_on_cpu  # noqa: E402
from k3train.model.k3 import K3Model  # noqa: E402
from k3train.parallel.grad_buffers import GradBuffers  # noqa: E402
from k3train.precision.main_params import MainParams  # noqa: E402
from k3train.training.module_time import ancestors, attribute, module_ranges  # noqa: E402

NO_KERNEL = set("""as_strided view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as
unsqueeze squeeze select slice split split_with_sizes chunk narrow unbind alias detach lift_fresh
empty empty_like empty_strided resolve_conj resolve_neg view_as result_type contiguous to _to_copy
clone flatten unflatten movedim diagonal zeros zeros_like ones_like new_zeros new_empty full full_like
scalar_tensor lift_fresh_copy set_ resize_ item _local_scalar_dense numpy_T""".split())
ONE_KERNEL = ("aten::_grouped_mm", "aten::_scaled_dot_product_attention_math")  # CPU loops / math paths
REDUCTIONS = ("aten::sum", "aten::mean", "aten::max", "aten::min", "aten::amax", "aten::amin",
              "aten::linalg_vector_norm", "aten::norm")
MIXED = ("aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::mul", "aten::mul_", "aten::div",
         "aten::div_", "aten::maximum", "aten::minimum", "aten::where")


def trace_triton_launches() -> None:
    """Each interpreted Triton launch becomes a ``triton::<kernel>`` profiler range."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def traced(self, *args, grid, warmup, **kw):
        with record_function("triton::" + getattr(self.fn, "__name__", "kernel")):
            return run(self, *args, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = traced


def kernel_name(event) -> str | None:
    """The kernel ``event`` stands for on the GPU, or None (no kernel, or one counted elsewhere)."""
    name = event.name
    outer = [a.name for a in ancestors(event)]
    if any(a.startswith("triton::") or a in ONE_KERNEL for a in outer):
        return None  # inside an interpreted launch or a CPU-only loop: counted as that one kernel
    if name.startswith("triton::") or name in ONE_KERNEL:
        return name
    if not name.startswith("aten::") or name[6:] in NO_KERNEL:
        return None
    if name == "aten::fill_" and outer and outer[0] in REDUCTIONS:
        return None
    if name == "aten::copy_" and next((a for a in outer if a not in ("aten::to", "aten::_to_copy")), None) in MIXED:
        return None
    return name


def census(model_name: str, seq: int, batch: int) -> tuple[dict, Counter]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import model_config

    cfg = model_config(model_name)
    torch.manual_seed(0)
    model = K3Model(cfg)
    main = MainParams(model, torch.bfloat16)
    grads = GradBuffers(model, None)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    lengths = [seq // 3, seq // 2, seq - seq // 3 - seq // 2]  # three packed documents a row
    position_ids = torch.cat([torch.arange(n) for n in lengths]).repeat(batch, 1)

    def step():
        grads.zero()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, position_ids, labels=tokens)
        loss.backward()
        grads.reduce()

    step()  # warm: lazy initialisation stays out of the count
    with profile(activities=[ProfilerActivity.CPU]) as prof, module_ranges(model):
        step()
    del main
    events = list(prof.events())
    # an op with a kernel-op child is not itself a kernel (aten::linear over its addmm)
    composite = {e.cpu_parent.id for e in events if e.cpu_parent is not None and kernel_name(e)}
    by_module: dict[str, Counter] = defaultdict(Counter)
    ops: Counter = Counter()
    for e, path, phase in attribute(events):
        name = kernel_name(e)
        if name is None or e.id in composite:
            continue
        key = "/".join(path[:3])
        by_module[key][phase] += 1
        ops[(key, phase, name)] += 1
    return by_module, ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="k3_tiny")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trace_triton_launches()
    with triton_on_cpu():  # every kernel folder's Triton path, through the interpreter
        by_module, ops = census(args.model, args.seq, args.batch)
    total = sum(sum(c.values()) for c in by_module.values())
    print(f"{args.model}, {args.batch}×{args.seq} tokens (3 documents a row): {total} kernels per micro-batch step "
          f"(CPU proxy: forward + backward + gradient reduce)")
    print(f"  {'module':<50} {'fwd':>6} {'bwd':>6}  top ops")
    rows = sorted(by_module.items(), key=lambda kv: -sum(kv[1].values()))
    for path, c in rows:
        top = sorted(((n, k) for (m, _, n), k in ops.items() if m == path), key=lambda x: -x[1])
        merged = Counter()
        for n, k in top:
            merged[n.split("::", 1)[1]] += k
        print(f"  {path[:50]:<50} {c['fwd']:>6} {c['bwd']:>6}  "
              + ", ".join(f"{n}:{k}" for n, k in merged.most_common(6)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "seq": args.seq, "total": total,
                       "by_module": {m: dict(c) for m, c in rows},
                       "ops": [{"module": m, "phase": ph, "op": n, "count": k} for (m, ph, n), k in ops.items()]},
                      f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
