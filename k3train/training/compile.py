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

The embedding and the output head stay eager. The number of packed documents (the length of
``Documents.cu_seqlens``) changes from batch to batch: it is marked dynamic where the documents are
built, so it does not recompile.
"""

from __future__ import annotations

import torch

from k3train.model.k3 import K3Model

# Distinct compiled graphs a layer may need: training and evaluation (grad mode, MoE statistics)
# times one document per row or packed documents (MLA's mask, KDA's cu_seqlens).
_GRAPHS_PER_LAYER = 4


def compile_layers(model: K3Model, backend: str = "inductor") -> int:
    """Compile every decoder layer of ``model``; returns how many. Raises dynamo's recompile limit so
    that every layer may be a kind of its own.

    ``backend`` is torch.compile's: "inductor" (generated Triton kernels: the speed path) or, to
    check the captured graphs without code generation, "aot_eager" (CPU tests)."""
    limit = _GRAPHS_PER_LAYER * len(model.layers)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=False)
    return len(model.layers)
