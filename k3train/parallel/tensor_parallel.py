"""Tensor-parallel layer spec: builds the linears, embedding and loss of one TP rank.

Model code asks a ``TPSpec`` for ``column``/``row``/``replicated`` linears and never
branches on the backend itself (Megatron-Core's idea of specs that select the
implementation). Backends:

- ``torch``: plain ``nn.Linear``/``nn.Embedding``, one process, no groups. Used for meta-device
  builds, unit tests of single modules, and parameter counting.
- ``megatron``: Megatron-Core ``ColumnParallelLinear``/``RowParallelLinear``/
  ``VocabParallelEmbedding`` and vocab-parallel cross-entropy over an explicit TP group.
  Runs on CPU (gloo) and GPU (NCCL).
- ``te``: Transformer Engine linears over the same TP group, when TE is importable on CUDA.

``recipe`` (``precision.recipe``, ``k3train/precision/recipes.py``) sets the GEMM format of every
linear but the LM head: the torch backend builds ``RecipeLinear``s, the megatron backend keeps
its linears and swaps their GEMM (``_RecipeGemmImpl``), and TE runs MXFP8 natively on sm_100+.

Initialisation draws the *full* matrix from the torch RNG and keeps this rank's slice, so a
model built with the same seed is the same model at any TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role
from k3train.parallel.state import ParallelGroups
from k3train.precision.recipes import RecipeLinear, linear_gemm, recipe_linear, te_mxfp8_forward, te_mxfp8_native
from kernels.cross_entropy import cross_entropy as fused_cross_entropy


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _no_init(weight: torch.Tensor) -> None:
    """Backends are built without drawing from the RNG; ``TPSpec._init`` initialises every weight."""


def _without_rng(cls: type, *args, **kwargs) -> nn.Module:
    """Build a torch module whose own default init leaves the global RNG stream untouched."""
    with torch.random.fork_rng(devices=[]):
        return cls(*args, **kwargs)


def _output_only(cls: type) -> type:
    """A Megatron-Core parallel linear whose forward returns only the output (no bias tuple)."""

    class OutputOnly(cls):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)[0]

    OutputOnly.__name__ = cls.__name__
    return OutputOnly


class _CopyToTP(torch.autograd.Function):
    """y = x; dx = Σ_TP dy. (Megatron-Core 0.16's mapping all-reduces a temporary copy when the
    gradient is non-contiguous, e.g. after ``expand``, and loses the sum; this one does not.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """y = Σ_TP x; dx = dy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _AutocastInputImpl:
    """Mixin for a Megatron-Core parallel linear: its input enters the GEMM in the autocast dtype.

    Megatron's linear saves its input for the wgrad dx·Wᵀ = dyᵀ x and restores autocast in the backward
    on CUDA only (``custom_bwd`` for "cuda"); under CPU bf16 autocast the backward would multiply the bf16
    dy by the saved fp32 x. Casting first (the forward GEMM casts it anyway) makes x bf16 on every
    device, and on CUDA saves the bf16 copy instead of the fp32 input and the backward's second cast.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        device = input.device.type
        if torch.is_autocast_enabled(device):
            input = input.to(torch.get_autocast_dtype(device))
        return super()._forward_impl(input, weight, *args, **kwargs)


class _RecipeGemmImpl:
    """Mixin for a Megatron-Core parallel linear: its GEMM becomes the recipe's ``recipe_gemm``.

    Megatron calls ``_forward_impl`` after its own input handling; a column linear asks for the
    input gradient to be all-reduced over TP there (``allreduce_dgrad``), which ``_CopyToTP`` does.
    """

    recipe_gemm = None

    def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False, sequence_parallel=False,
                      tp_group=None, **_):
        if bias is not None or sequence_parallel:
            raise NotImplementedError("precision.recipe GEMMs take no bias and no sequence parallelism")
        if allreduce_dgrad:
            input = _CopyToTP.apply(input, tp_group)
        return recipe_linear(input, weight, self.recipe_gemm)


class TPSpec:
    """Factory for the layers of one tensor-parallel rank. ``ep_dispatcher`` selects the MoE token
    dispatcher under expert parallelism (``parallel.ep_dispatcher``: alltoall or balanced);
    ``recipe`` the linears' GEMM format (``precision.recipe``)."""

    def __init__(self, groups: ParallelGroups | None, init_std: float, backend: str = "auto",
                 ep_dispatcher: str = "alltoall", recipe: str = "bf16"):
        self.groups = groups
        self.ep_dispatcher = ep_dispatcher
        self.init_std = init_std
        self.size = groups.tp_size if groups else 1
        self.rank = groups.tp_rank if groups else 0
        te_mxfp8 = recipe == "mxfp8" and backend in ("auto", "te") and groups is not None and te_mxfp8_native()
        self.recipe_gemm = linear_gemm(recipe, te_native=te_mxfp8)
        self.te_mxfp8 = te_mxfp8
        if backend == "auto":
            te = te_available() and (recipe == "bf16" or te_mxfp8)
            backend = "torch" if groups is None else ("te" if te else "megatron")
        if backend == "te" and self.recipe_gemm is not None:
            raise ValueError(f"precision.recipe={recipe} runs through our own GEMMs, which Transformer Engine "
                             f"linears cannot take; set precision.linear_backend=auto or megatron")
        if backend != "torch" and groups is None:
            raise ValueError(f"precision.linear_backend={backend} needs initialised process groups")
        if backend == "te" and not te_available():
            raise ValueError("precision.linear_backend=te but transformer_engine is not importable on CUDA; "
                             "install the 'te' extra or set precision.linear_backend=auto")
        self.backend = backend
        self._mcore_config = None
        if backend != "torch":
            from megatron.core.model_parallel_config import ModelParallelConfig

            self._mcore_config = ModelParallelConfig(
                tensor_model_parallel_size=self.size,
                use_cpu_initialization=True,
                perform_initialization=False,
                params_dtype=torch.float32,
            )

    # --- helpers -------------------------------------------------------------------------
    def local(self, n: int, what: str) -> int:
        """Size of this rank's shard of a dimension of size ``n``."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by parallel.tensor={self.size}")
        return n // self.size

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``full`` along ``dim`` (the rank-th of ``size`` equal contiguous parts)."""
        if self.size == 1:
            return full
        return full.chunk(self.size, dim=dim)[self.rank].contiguous()

    def unshard(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Inverse of ``shard``: all-gather the TP shards of ``local`` into the full tensor."""
        if self.size == 1:
            return local
        shards = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(shards, local.contiguous(), group=self.groups.tp)
        return torch.cat(shards, dim=dim)

    def copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, all-reduce of the gradient over TP (a replicated value read by sharded heads)."""
        return x if self.size == 1 else _CopyToTP.apply(x, self.groups.tp)

    def reduce_from_tp(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) over TP forward, identity backward (partial sums of sharded experts)."""
        return x if self.size == 1 else _ReduceFromTP.apply(x, self.groups.tp)

    # --- layers --------------------------------------------------------------------------
    def _init(self, weight: torch.Tensor, role: ParamRole) -> None:
        """Draw the full matrix N(0, init_std²) and keep this rank's shard; set the role.

        Backends are built without their own initialisation, so the RNG stream, and hence the
        model, is the same for every backend and TP size.
        """
        full_shape = list(weight.shape)
        if role.tp_partition_dim is not None:
            full_shape[role.tp_partition_dim] *= self.size
        full = torch.empty(full_shape, device=weight.device).normal_(0.0, self.init_std)
        with torch.no_grad():
            if role.tp_partition_dim is None:
                weight.copy_(full)
            else:
                weight.copy_(self.shard(full, role.tp_partition_dim))
        set_role(weight, role)

    def replicated(self, in_features: int, out_features: int, kind: Kind = Kind.MATRIX) -> nn.Linear:
        if self.recipe_gemm is None:
            lin = _without_rng(nn.Linear, in_features, out_features, bias=False)
        else:
            lin = _without_rng(RecipeLinear, in_features, out_features, self.recipe_gemm)
        self._init(lin.weight, ParamRole(kind))
        return lin

    def column(self, in_features: int, out_features: int, *, what: str, kind: Kind = Kind.MATRIX,
               head_group: str | None = None, head_dim: int | None = None) -> nn.Module:
        """y_local = x W_localᵀ, W sharded on its output rows. Input gradient is all-reduced over TP."""
        mod = self._parallel_linear(in_features, out_features, "column", recipe=kind != Kind.LM_HEAD)
        assert mod.weight.shape == (self.local(out_features, what), in_features)
        self._init(mod.weight, ParamRole(kind, head_group=head_group, head_dim=head_dim, tp_partition_dim=0))
        return mod

    def row(self, in_features: int, out_features: int, *, what: str, kind: Kind = Kind.MATRIX) -> nn.Module:
        """y = all_reduce(x_local W_localᵀ), W sharded on its input columns."""
        mod = self._parallel_linear(in_features, out_features, "row")
        assert mod.weight.shape == (out_features, self.local(in_features, what))
        self._init(mod.weight, ParamRole(kind, tp_partition_dim=1))
        return mod

    def _parallel_linear(self, in_features: int, out_features: int, mode: str, recipe: bool = True) -> nn.Module:
        """The backend's bias-free linear in ``mode`` ("column" or "row"), weights not yet initialised;
        with the precision recipe's GEMMs unless ``recipe`` is False (the LM head)."""
        gemm = self.recipe_gemm if recipe else None
        if self.backend == "torch":
            if gemm is None:
                return _without_rng(nn.Linear, in_features, out_features, bias=False)
            return _without_rng(RecipeLinear, in_features, out_features, gemm)
        if self.backend == "te":
            import transformer_engine.pytorch as te

            lin = te.Linear(in_features, out_features, bias=False, tp_group=self.groups.tp, tp_size=self.size,
                            parallel_mode=mode, init_method=_no_init, params_dtype=torch.float32, device="cuda")
            return te_mxfp8_forward(lin) if self.te_mxfp8 and recipe else lin
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        common = dict(config=self._mcore_config, init_method=_no_init, bias=False, tp_group=self.groups.tp)
        cls = _output_only(ColumnParallelLinear if mode == "column" else RowParallelLinear)
        cls = type(cls.__name__, (_AutocastInputImpl if gemm is None else _RecipeGemmImpl, cls), {})
        if mode == "column":
            mod = cls(in_features, out_features, gather_output=False, **common)
        else:
            mod = cls(in_features, out_features, input_is_parallel=True, skip_bias_add=True, **common)
        if gemm is not None:
            mod.recipe_gemm = gemm
        return mod

    def embedding(self, vocab: int, dim: int) -> nn.Module:
        """Token embedding, vocabulary sharded over TP."""
        self.local(vocab, "model.vocab_size")
        if self.backend == "torch":
            mod = _without_rng(nn.Embedding, vocab, dim)
        else:
            from megatron.core.tensor_parallel import VocabParallelEmbedding

            mod = VocabParallelEmbedding(vocab, dim, init_method=_no_init, config=self._mcore_config,
                                         tp_group=self.groups.tp)
        self._init(mod.weight, ParamRole(Kind.EMBEDDING, tp_partition_dim=0))
        return mod

    def cross_entropy(self, logits_local: torch.Tensor, labels: torch.Tensor,
                      grad_into_logits: bool = False) -> torch.Tensor:
        """Per-token fp32 loss from vocabulary-sharded logits [..., V/tp]. CUDA logits go through the
        fused Triton kernels (``kernels.cross_entropy``: no fp32 copy of the logits, this rank's
        vocabulary slice starts at rank · V/tp; with ``grad_into_logits`` their backward writes the
        gradient over the logits, which the caller then no longer reads); CPU logits through today's
        fp32 path."""
        if logits_local.is_cuda:
            group = self.groups.tp if self.backend != "torch" and self.size > 1 else None
            return fused_cross_entropy(logits_local, labels, group=group,
                                       vocab_start=self.rank * logits_local.shape[-1], backend="triton",
                                       grad_into_logits=grad_into_logits)
        if self.backend == "torch":
            return F.cross_entropy(logits_local.float().flatten(0, -2), labels.flatten(), reduction="none"
                                   ).view(labels.shape)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # Megatron-Core 0.16 reads the global TP group here; it is the same group as self.groups.tp.
        return vocab_parallel_cross_entropy(logits_local.float(), labels)
