"""``train.compile``: ``torch.compile`` each decoder layer, from outside the model.

Each ``K3Layer`` is compiled in place (``nn.Module.compile``: parameter names, state dicts and
checkpoints are unchanged) with ``dynamic=False``: sequence length and micro-batch size are fixed
within a run. Dynamo inlines the layer's modules, so parameters are graph inputs and layers of one
kind (same attention-residual bank length, block write, mixer and FFN) share one compiled graph;
the pointwise and reduction glue between the GEMMs and our Triton kernels (RMSNorm, gates, router
sigmoid/top-k normalisation, AttnRes glue, residual adds, casts) fuses into few Triton kernels.
Under compilation the Triton kernels are ``torch.library`` custom ops with fake shapes
(``kernels.backend.eager_or_compiled``; eager calls launch them directly), so they sit inside the
graphs; nothing in a layer reads a tensor back to the host.

``train.compile_mode`` is torch.compile's ``mode``: "reduce-overhead" (the default), which also
captures each layer graph, forward and backward, as a CUDA graph (inductor's CUDA graph trees), so a
layer's hundreds of launches replay as one and the step stops being host-bound. The graphs'
activations live in a private memory pool and a replay reuses the previous replay's outputs: the
trainer marks each new forward (``begin_forward``), and nothing may keep a tensor allocated inside a
graph past its call. Measured on one H200 (bench-1B, 2x4096, AdamW, ``benchmarks/train_step.py
--compile``): 79.9 ms a step against 130.5 ms eager in the same process. The trainer's first run
with it stopped at the first evaluation on four tensors of the pool that no graph output accounts
for: KDA's four chunk tables, which its custom op remembered (a CPU test now asserts that a compiled
step keeps no tensor it allocates). With that, the padded document offsets below and evaluation run
eagerly (``eager_layers``), the trainer's bench-1B run (8x4096 micro-batches, Muon) trained 60 steps
through three evaluations at 345–382 ms a step (docs/operating.md). "default" compiles without CUDA
graphs.

The embedding and the output head stay eager. The number of packed documents changes from batch to
batch: the model pads ``Documents.cu_seqlens`` with empty documents to the next power of two (at
least 16 offsets; ``compile_layers`` sets ``K3Model.bucket_documents``), and marks its length
dynamic, so the layers neither recompile nor, under CUDA graphs, record a graph for every document
count they meet: a few lengths over a whole run. (Unpadded, the trainer's bench-1B run with CUDA
graphs took 2.9 s a step at step 5 and then logged nothing for seven minutes: by every sign, graphs
recorded for each new count.)
"""

from __future__ import annotations

import contextlib

import torch

from k3train.config.schema import COMPILE_MODES
from k3train.model.k3 import K3Model

# Distinct compiled graphs a layer may need: training and evaluation (grad mode, MoE statistics)
# times one document per row or packed documents (MLA's mask, KDA's cu_seqlens).
_GRAPHS_PER_LAYER = 4


def compile_layers(model: K3Model, backend: str = "inductor", mode: str = "default") -> int:
    """Compile every decoder layer of ``model``; returns how many. Raises dynamo's recompile limit so
    that every layer may be a kind of its own.

    ``backend`` is torch.compile's: "inductor" (generated Triton kernels: the speed path) or, to
    check the captured graphs without code generation, "aot_eager" (CPU tests); ``mode`` one of
    ``COMPILE_MODES`` (inductor only)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: use one of {COMPILE_MODES}")
    limit = _GRAPHS_PER_LAYER * len(model.layers)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    options = {"mode": mode} if backend == "inductor" else {}
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=False, **options)
    model.bucket_documents = True
    return len(model.layers)


def eager_layers(compiled: bool):
    """A context in which compiled layers run eagerly (``torch.compiler.set_stance("force_eager")``;
    nothing when ``compiled`` is false). The trainer evaluates in it: a no-grad forward would compile,
    and under CUDA graphs record, a second graph per layer kind, which took longer than the session-10
    bench-1B runs allowed it (70–150 s) for a few forwards of a few micro-batches."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def begin_forward(mode: str) -> None:
    """Before a forward of layers compiled with ``mode``: under CUDA graphs, a new step of the graph
    trees (the previous forward's graph outputs may be overwritten from here on)."""
    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
