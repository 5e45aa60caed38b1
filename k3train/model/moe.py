"""Stable LatentMoE (K3_SPEC.md §2.4).

For the MoE input x [N, d] (after ``post_attention_layernorm``):

    (T, p)  = router(x)                               top-k experts and renormalised weights
    z       = W↓ x                                    latent [N, ℓ], ℓ = d/2
    u       = Σ_{j∈T} p_j · W2_j SiTU(W1_j z, W3_j z)  routed experts in the latent
    y       = Shared(x) + W↑ · RMSNorm_γ(u)

Under tensor parallelism each routed expert is split along its width I (W1/W3 rows,
W2 columns), so u is a partial sum per rank; it is all-reduced *before* the norm.

W1 and W3 are stored fused and interleaved, ``w13`` [E, 2I, ℓ] with row 2j = W1's row j (gate_j) and row
2j + 1 = W3's row j (up_j), so that z @ w13ᵀ holds (gate_j, up_j) in adjacent columns (a GEMM epilogue can
apply SiTU per pair) and a TP shard is a contiguous run of pairs.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from k3train.config.schema import ModelConfig
from k3train.model.expert_load import ExpertLoad
from k3train.model.mlp import SiTUMLP, situ_glu
from k3train.model.norm import RMSNorm
from k3train.model.quantile_balancing import QuantileBalancer, update_biases
from k3train.model.replay import replaying
from k3train.model.roles import Kind, ParamRole, interleave_rows, set_role
from k3train.model.router import SigmoidRouter
from k3train.parallel.tensor_parallel import TPSpec
from k3train.parallel.token_dispatcher import token_dispatcher
from kernels.grouped_gemm_sm90 import CONFIGS as CUTLASS_CONFIGS
from kernels.grouped_gemm_sm90 import SITU_CONFIG
from kernels.grouped_gemm_sm90 import expert_tiled_mm_op as cutlass_expert_tiled_mm
from kernels.grouped_gemm_sm90 import expert_tiled_mm_reference
from kernels.grouped_gemm_sm90 import expert_wgrad_op as cutlass_expert_wgrad
from kernels.grouped_gemm_sm90 import expert_wgrad_pair_op as cutlass_expert_wgrad_pair
from kernels.grouped_gemm_sm90 import expert_tiled_situ_backward_op as cutlass_situ_backward
from kernels.grouped_gemm_sm90 import expert_tiled_situ_forward_op as cutlass_situ_forward
from kernels.grouped_gemm_sm90 import grouped_mm_op as cutlass_grouped_mm
from kernels.grouped_gemm_sm90 import grouped_wgrad_op as cutlass_grouped_wgrad
from kernels.grouped_gemm_sm90 import grouped_wgrad_pair_op as cutlass_grouped_wgrad_pair
from kernels.grouped_gemm_sm90 import library_path as cutlass_library_path
from kernels.grouped_wgrad import grouped_wgrad, grouped_wgrad_pair
from kernels.moe_plan import group_offsets
from kernels.situ import situ_glu_interleaved


class GroupedGemm(NamedTuple):
    """Which kernels run the routed experts' GEMMs (``RoutedExperts.grouped_gemm`` parsed): ``mm``, the CUTLASS
    configuration of the forward and dgrad products (None: ``torch._grouped_mm``); ``wgrad``, that of the weight
    gradients (None: ``kernels.grouped_wgrad``); ``tiled``: the products on the expert-tiled kernel, over rows
    padded per expert to ``row_tile``; ``situ_epilogue``: SiTU computed in the epilogues of the W13 forward and the
    W2 dgrad (``_SiTUExperts``)."""
    mm: int | None = None
    wgrad: int | None = None
    tiled: bool = False
    situ_epilogue: bool = False
    tiled_wgrad: bool = False  # the weight gradients on the expert-tiled CUTLASS kernel (":w")

    @property
    def row_tile(self) -> int:
        return CUTLASS_CONFIGS[self.mm].tile[0] if self.tiled else 1


def grouped_gemm_configs(gemm: str) -> GroupedGemm:
    """RoutedExperts.grouped_gemm → GroupedGemm: "torch" → ``torch._grouped_mm`` and ``kernels.grouped_wgrad``;
    "cutlass:i" → configuration i of ``kernels.grouped_gemm_sm90`` for the forward and dgrad products;
    "tiles:i" → its expert-tiled kernel (one-CTA-cluster configurations; rows padded per expert); "fused:1" →
    the expert-tiled configuration 1 with SiTU in its products' epilogues (``kernels.grouped_gemm_sm90.
    expert_tiled_situ_forward``; the fastest on one H200, docs/moe_notes.md §2); each with ":j" →
    configuration j for the weight gradients too ("fused:1:j": W13's and W2's in one launch), or with ":w" the
    weight gradients on the expert-tiled kernel (``expert_tiled_wgrad``; "fused:1:w" and "fused:1:3" the fastest
    under natural routing, session 37)."""
    parts = gemm.split(":")
    tiled_wgrad = len(parts) == 3 and parts[2] == "w" and parts[0] in ("tiles", "fused")
    numbers = parts[1:2] if tiled_wgrad else parts[1:]
    ok = parts == ["torch"] or (parts[0] in ("cutlass", "tiles", "fused") and len(parts) in (2, 3) and
                                all(p.isdigit() and int(p) < len(CUTLASS_CONFIGS) for p in numbers))
    if ok and parts[0] == "tiles" and CUTLASS_CONFIGS[int(parts[1])].cluster_m != 1:
        ok = False
    if ok and parts[0] == "fused" and int(parts[1]) != SITU_CONFIG:
        ok = False
    if not ok:
        tiled = [i for i, c in enumerate(CUTLASS_CONFIGS) if c.cluster_m == 1]
        raise ValueError(f"grouped GEMM {gemm!r}: 'torch', 'cutlass:<i>[:<j>]', 'tiles:<t>[:<j>|:w]' or "
                         f"'fused:{SITU_CONFIG}[:<j>|:w]' with i, j in 0..{len(CUTLASS_CONFIGS) - 1} and t in {tiled} "
                         f"(kernels.grouped_gemm_sm90.CONFIGS; w: the weight gradients on the expert-tiled kernel)")
    if parts == ["torch"]:
        return GroupedGemm()
    return GroupedGemm(int(parts[1]), int(parts[2]) if len(parts) == 3 and not tiled_wgrad else None,
                       parts[0] in ("tiles", "fused"), parts[0] == "fused", tiled_wgrad)


def expert_gemm_line(gemm: str, device: torch.device, expert_qat: bool, expert_parallel: int) -> str | None:
    """The trainer's start-up line on the routed experts' GEMMs (``precision.expert_gemm``), or None where there is
    nothing to say: for a CUTLASS ``gemm`` its padded layout and where SiTU runs; for "torch" on a Hopper GPU
    without expert parallelism, the faster CUTLASS form and whether its library is built."""
    if gemm != "torch":
        parsed = grouped_gemm_configs(gemm)
        situ = ""
        if parsed.situ_epilogue:
            situ = ("; SiTU in the products' epilogues" if device.type == "cuda" and not expert_qat else
                    "; SiTU in a pass of its own (the epilogues need CUDA and no expert QAT)")
        return (f"Routed experts: grouped GEMMs on {gemm} (precision.expert_gemm), each expert's rows padded to a "
                f"multiple of {parsed.row_tile}{situ}")
    if device.type != "cuda" or expert_parallel != 1 or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    path = cutlass_library_path()
    library = (f"its library is at {path}" if path.is_file() else
               "build its library first (python -m kernels.grouped_gemm_sm90.build --out <path>, then "
               "K3_GROUPED_GEMM_LIB=<path>)")
    return ("Routed experts: grouped GEMMs on torch._grouped_mm (precision.expert_gemm=torch); on this Hopper GPU "
            "precision.expert_gemm=fused:1:w is faster (bench-1B's MoE layer fwd+bwd on an H200: 1.19x the time of "
            f"the same GEMMs without routing, against 1.50x for torch; docs/operating.md): {library}")


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, gemm: GroupedGemm,
                tile_expert: torch.Tensor | None) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e] by ``gemm``'s kernel; the expert-tiled one reads ``tile_expert``
    (each M tile's expert) instead of the offsets, and runs as its plain-torch reference on CPU."""
    if gemm.tiled:
        if a.device.type == "cpu":
            return expert_tiled_mm_reference(a, b, tile_expert, gemm.row_tile)
        return cutlass_expert_tiled_mm(a.contiguous(), b, tile_expert, gemm.mm)
    if gemm.mm is None:
        return torch._grouped_mm(a, b, offs=offsets)
    return cutlass_grouped_mm(a.contiguous(), b, offsets, gemm.mm)


class _GroupedLinear(torch.autograd.Function):
    """y = x W_eᵀ per group; dx by the same grouped GEMM, dW by ``kernels.grouped_wgrad`` (its Triton kernel on
    sm_90+, where ``torch._grouped_mm``'s K-grouped GEMM is slow; the same aten product elsewhere), each
    unless a CUTLASS configuration is given for it (``grouped_gemm_configs``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, gemm: GroupedGemm,
                tile_expert: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets, tile_expert)
        ctx.gemm = gemm
        return _grouped_mm(x, w.transpose(-2, -1), offsets, gemm, tile_expert)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, w, offsets, tile_expert = ctx.saved_tensors
        gemm = ctx.gemm
        grad_x = _grouped_mm(grad_y, w, offsets, gemm, tile_expert) if ctx.needs_input_grad[0] else None
        grad_w = _grouped_wgrad(grad_y, x, offsets, gemm) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


def _grouped_wgrad(grad_y: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, gemm: GroupedGemm) -> torch.Tensor:
    """dW[e] = grad_y[rows of e]ᵀ x[rows of e] by ``gemm``'s weight-gradient kernel."""
    if gemm.tiled_wgrad:
        return cutlass_expert_wgrad(grad_y.contiguous(), x.contiguous(), offsets)
    if gemm.wgrad is None:
        return grouped_wgrad(grad_y, x, offsets)
    return cutlass_grouped_wgrad(grad_y.contiguous(), x.contiguous(), offsets, gemm.wgrad)


class _SiTUExperts(torch.autograd.Function):
    """y = W2_e · (s ⊙ SiTU(W13_e x)) row by row, with SiTU in the products' epilogues (expert-tiled configuration
    ``SITU_CONFIG``): the W13 forward writes the pre-activations P [M, 2I] and h [M, I]; the backward's W2 dgrad
    writes dP and ds (the row scale's gradient) from the saved P, so SiTU costs no pass of its own. Saves x, P and
    h, as the unfused path does. x [M, ℓ], w13 [G, 2I, ℓ] (rows interleaved), w2 [G, ℓ, I], bf16; row_scale [M]
    or None."""

    @staticmethod
    def forward(ctx, x, w13, w2, row_scale, offsets, tile_expert, gemm, betas):
        pre, h = cutlass_situ_forward(x, w13, tile_expert, row_scale, *betas)
        ctx.save_for_backward(x, w13, w2, row_scale, offsets, tile_expert, pre, h)
        ctx.gemm, ctx.betas = gemm, betas
        return cutlass_expert_tiled_mm(h, w2.transpose(1, 2), tile_expert, gemm.mm)

    @staticmethod
    def backward(ctx, grad_y):
        x, w13, w2, row_scale, offsets, tile_expert, pre, h = ctx.saved_tensors
        gemm, grad_y = ctx.gemm, grad_y.contiguous()
        d_pre, d_scale = cutlass_situ_backward(grad_y, w2, pre, tile_expert, row_scale, *ctx.betas)
        grad_x = cutlass_expert_tiled_mm(d_pre, w13, tile_expert, gemm.mm)
        want_w13, want_w2 = ctx.needs_input_grad[1:3]
        if want_w13 and want_w2 and gemm.tiled_wgrad:
            grad_w13, grad_w2 = cutlass_expert_wgrad_pair(d_pre, x, grad_y, h, offsets)
        elif want_w13 and want_w2:  # both in one launch
            grad_w13, grad_w2 = (grouped_wgrad_pair(d_pre, x, grad_y, h, offsets) if gemm.wgrad is None else
                                 cutlass_grouped_wgrad_pair(d_pre, x, grad_y, h, offsets, gemm.wgrad))
        else:
            grad_w13 = _grouped_wgrad(d_pre, x, offsets, gemm) if want_w13 else None
            grad_w2 = _grouped_wgrad(grad_y, h, offsets, gemm) if want_w2 else None
        if d_scale is not None:
            d_scale = d_scale.to(row_scale.dtype)
        return grad_x, grad_w13, grad_w2, d_scale, None, None, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, gemm: str | GroupedGemm = "torch",
                   tile_expert: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of x grouped by expert times each expert's weight: one grouped GEMM.

    x [M, K] (rows offsets[e-1]:offsets[e] belong to expert e), w [E, O, K], offsets [E] int32
    cumulative row counts → [M, O], row m = x[m] @ w[e(m)]ᵀ. Runs in x.dtype (bf16 under autocast).
    torch's fast path is bf16 on sm_90/sm_100; other dtypes and GPUs take its per-group fallback,
    which reads the offsets on the host (torch ≥ 2.10), as the CPU path does. ``gemm``: "torch", or
    CUTLASS configurations of ``kernels.grouped_gemm_sm90`` ("cutlass:<i>[:<j>]", "tiles:<i>[:<j>]",
    ``grouped_gemm_configs``; experimental: bf16 on sm_90 with its library built; ``benchmarks/moe.py
    --grouped-gemms``). "tiles" needs rows padded per expert to its ``row_tile`` (zero padding rows, rows past
    the last expert's ignored) and ``tile_expert`` [M / row_tile] (``moe_plan.group_offsets``).
    """
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm; the routed experts need torch>=2.9")
    if not isinstance(gemm, GroupedGemm):
        gemm = grouped_gemm_configs(gemm)
    return _GroupedLinear.apply(x, w.to(x.dtype), offsets, gemm, tile_expert)


class RoutedExperts(nn.Module):
    """E experts in the latent space, stacked for grouped GEMMs.

    w13: [E_l, 2·I_local, ℓ], rows interleaved: row 2j = gate_j (HF's w1 row j), row 2j + 1 = up_j (w3 row
    j), for this rank's pairs j (a contiguous run: tp_rank·I_local …); w2: [E_l, ℓ, I_local], for this rank's
    E_l = E / parallel.expert experts (global ids ep_rank·E_l …); the full stacks are drawn first, so the
    model is the same at any TP and EP size.
    ``weight_fake_quant`` / ``input_fake_quant``: optional callables applied to every expert
    weight and GEMM input (quantization-aware training; None means full precision). ``grouped_gemm``:
    which grouped GEMM runs the forward and dgrad products (``grouped_linear``; "torch" unless set); the
    dispatcher pads each expert's rows to ``row_tile`` for the expert-tiled ones.
    """

    def __init__(self, cfg: ModelConfig, tp: TPSpec):
        super().__init__()
        E, ell, I = cfg.num_experts, cfg.latent_size, cfg.moe_intermediate_size
        ep_size, ep_rank = (tp.groups.ep_size, tp.groups.ep_rank) if tp.groups else (1, 0)
        self.num_experts = E // ep_size  # local experts
        mine = slice(ep_rank * self.num_experts, (ep_rank + 1) * self.num_experts)
        self.width = tp.local(I, "model.moe_intermediate_size")
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta
        w1_w3 = torch.empty(E, 2, I, ell).normal_(0.0, cfg.init_std)[mine]  # [expert, gate|up, j, ℓ]
        w2 = torch.empty(E, ell, I).normal_(0.0, cfg.init_std)[mine]
        self.w13 = set_role(nn.Parameter(tp.shard(interleave_rows(w1_w3), 1).contiguous()),
                            ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=1, row_interleave=2, ep_partition_dim=0))
        self.w2 = set_role(nn.Parameter(tp.shard(w2, 2).contiguous()),
                           ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=2, ep_partition_dim=0))
        self.weight_fake_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.input_fake_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.grouped_gemm = "torch"

    @property
    def grouped_gemm(self) -> str:
        """grouped_linear's gemm by name (``grouped_gemm_configs``; checked when set)."""
        return self._grouped_gemm_name

    @grouped_gemm.setter
    def grouped_gemm(self, name: str) -> None:
        self._gemm = grouped_gemm_configs(name)
        self._grouped_gemm_name = name

    @property
    def row_tile(self) -> int:
        """The rows each expert's group is padded to a multiple of (1: no padding)."""
        return self._gemm.row_tile

    @property
    def takes_row_weights(self) -> bool:
        """Whether the gate weights can ride in SiTU's pass (``row_weights``): not where QAT quantises the inputs,
        SiTU's unweighted output among them."""
        return self.input_fake_quant is None

    def _operands(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_fake_quant is not None:
            x = self.input_fake_quant(x)
        if self.weight_fake_quant is not None:
            w = self.weight_fake_quant(w)
        return x, w

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor | None = None,
                w2: torch.Tensor | None = None, row_weights: torch.Tensor | None = None,
                layout: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """x [M, ℓ] token copies sorted by group, tokens_per_expert [G] → y [M, ℓ] (TP partial sums); with
        ``row_tile`` > 1, each group's count a multiple of it (the padded layout of the dispatcher).

        y_m = W2_g · SiTU(W1_g x_m, W3_g x_m) for the group g of row m (times row_weights[m], [M], inside
        SiTU's pass, where given: the gate weights folded in); two grouped GEMMs, the first giving
        [M, 2·I_local] with (gate_j, up_j) in columns (2j, 2j + 1). The groups are this rank's experts, or the
        stacks ``w13`` [G, 2·I_local, ℓ] (rows interleaved) / ``w2`` [G, ℓ, I_local] the dispatcher gives (its
        experts plus fetched replicas). With ``grouped_gemm`` "fused:1" on CUDA and no fake quantisation, SiTU
        runs in the two products' epilogues (``_SiTUExperts``); elsewhere it is a pass of its own. ``layout``:
        the rows' (offsets, tile_group) where the dispatcher's routing plan made them (else ``group_offsets``).
        """
        w13 = self.w13 if w13 is None else w13
        w2 = self.w2 if w2 is None else w2
        if x.shape[0] == 0:  # no token reached this rank's experts: stay in the graph, since the
            # dispatcher's backward all-to-alls must run on every rank
            return x + 0.0 * (w13.sum() + w2.sum())
        tile = self.row_tile
        if layout is None:
            layout = group_offsets(tokens_per_expert, tile, x.shape[0] // tile if tile > 1 else 0)
        offsets, tile_expert = layout[0], layout[1] if tile > 1 else None
        if self._gemm.situ_epilogue and x.is_cuda and self.input_fake_quant is None and self.weight_fake_quant is None:
            return _SiTUExperts.apply(x, w13.to(x.dtype).contiguous(), w2.to(x.dtype).contiguous(), row_weights,
                                      offsets, tile_expert, self._gemm, (self.beta, self.linear_beta))
        h = situ_glu_interleaved(grouped_linear(*self._operands(x, w13), offsets, self._gemm, tile_expert),
                                 self.beta, self.linear_beta, row_scale=row_weights)
        return grouped_linear(*self._operands(h, w2), offsets, self._gemm, tile_expert)

    def forward_looped(self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference: z [N, ℓ], experts/weights [N, k] → u [N, ℓ], one GEMM per expert in a Python
        loop (host syncs). Tests and benchmarks compare the grouped path against it."""
        k = experts.shape[1]
        flat_expert = experts.flatten()
        order = flat_expert.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        x_sorted = z[token_of]
        outputs = []
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            xe, w13 = self._operands(x_sorted[start:start + count], self.w13[e])
            gate_up = xe @ w13.t()  # columns (gate_0, up_0, gate_1, up_1, ...)
            h, w2 = self._operands(situ_glu(gate_up[:, 0::2], gate_up[:, 1::2], self.beta, self.linear_beta),
                                   self.w2[e])
            outputs.append(h @ w2.t())
            start += count
        y = torch.cat(outputs) * weights.flatten()[order].unsqueeze(-1).to(z.dtype)
        return torch.zeros_like(z).index_add_(0, token_of, y.to(z.dtype))


def experts_and_combine(dispatcher, experts: RoutedExperts, grouped: torch.Tensor, tokens_per_expert: torch.Tensor,
                        weights: torch.Tensor, handle) -> torch.Tensor:
    """u [N, ℓ], u_i = Σ_j weights_ij · y_(i,j): the routed experts on ``dispatcher.dispatch``'s rows and the
    weighted sum back. Where the dispatcher gives each row its weight (``grouped_weights``: dispatch was given the
    weights) and the experts take them (``takes_row_weights``), the weights ride in SiTU's pass and the combine is
    unweighted, so its backward no longer reads the expert outputs again."""
    row_weights = dispatcher.grouped_weights(handle) if experts.takes_row_weights else None
    y = experts(grouped, tokens_per_expert, *dispatcher.expert_stacks(experts, handle), row_weights=row_weights,
                layout=dispatcher.group_layout(handle))
    return dispatcher.combine(y, weights if row_weights is None else None, handle)


def set_expert_gemm(model: nn.Module, gemm: str) -> None:
    """Every ``RoutedExperts`` of ``model`` runs its grouped GEMMs on ``gemm`` (``precision.expert_gemm``,
    ``grouped_gemm_configs``); the MoE layers' dispatch pads rows to its ``row_tile``."""
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.grouped_gemm = gemm


class LatentMoE(nn.Module):
    """Input/output [B, T, d]. ``load`` counts tokens per expert over the step's micro-batches.

    Quantile Balancing (``update_bias``) sets the router bias from the micro-batches routed since the
    last update: after the optimizer step, and (the trainer's call, ``model.qb_updates_per_step``) also within
    the step. With ``qb_rescore_stride = s > 0`` the router inputs at every s-th position of
    every sequence are kept, and the update after the optimizer step scores them again with the
    updated router (same tokens, new weights); with s = 0 it uses the forward's scores. Either way a
    bias never routes the tokens it was estimated from, and the pooled token set does not depend on
    the data-parallel layout.
    """

    def __init__(self, cfg: ModelConfig, tp: TPSpec):
        super().__init__()
        self.tp = tp
        d, ell = cfg.hidden_size, cfg.latent_size
        self.gate = SigmoidRouter(d, cfg.num_experts, cfg.num_experts_per_token, cfg.routed_scaling_factor,
                                  cfg.init_std)
        self.routed_expert_down_proj = tp.replicated(d, ell)
        groups = tp.groups
        self.dispatcher = token_dispatcher(cfg.num_experts, groups.ep if groups else None,
                                           groups.ep_size if groups else 1, tp.ep_dispatcher)
        self.experts = RoutedExperts(cfg, tp)
        self.routed_expert_norm = RMSNorm(ell, cfg.rms_norm_eps, autocast_output=True)  # feeds W↑ only
        self.routed_expert_up_proj = tp.replicated(ell, d)
        self.shared_experts = SiTUMLP(tp, d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                      cfg.situ_beta, cfg.situ_linear_beta)
        self.balancer = QuantileBalancer(cfg.num_experts, cfg.num_experts_per_token, cfg.qb_estimator,
                                         cfg.qb_bins, cfg.qb_ema, cfg.qb_step_feedback)
        self.qb_rescore_stride = cfg.qb_rescore_stride
        self.router_inputs: list[torch.Tensor] = []  # [tokens, d] per micro-batch, detached
        self.load = ExpertLoad(cfg.num_experts)

    @torch.compiler.disable
    def _keep_router_inputs(self, x: torch.Tensor) -> None:
        """Keep a copy of every s-th position's router input for re-scoring (a list that grows each
        micro-batch: run eagerly, a graph break under torch.compile when re-scoring is on). A copy, never a
        view: under CUDA graphs x lives in the graph pool, which the next micro-batch's replay overwrites."""
        kept = x[:, ::self.qb_rescore_stride].detach().clone(memory_format=torch.contiguous_format)
        self.router_inputs.append(kept.view(-1, x.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        observe = self.training and not replaying()  # once per micro-batch, not again in a recompute
        if observe and self.qb_rescore_stride:
            self._keep_router_inputs(x)
        x = x.reshape(-1, shape[-1])
        routing = self.gate(x)
        z = self.tp.copy_to_tp(self.routed_expert_down_proj(x))
        weights = self.tp.copy_to_tp(routing.weights)
        grouped, tokens_per_expert, handle = self.dispatcher.dispatch(
            z, routing.experts, self.experts.row_tile, weights if self.experts.takes_row_weights else None)
        if observe:
            self.load.add(handle.tokens_per_expert, routing.experts.numel(), grouped.shape[0])
            self.balancer.observe(routing.scores, routing.cutoff, self.gate.e_score_correction_bias,
                                  handle.tokens_per_expert)
        u = experts_and_combine(self.dispatcher, self.experts, grouped, tokens_per_expert, weights, handle)
        u = self.tp.reduce_from_tp(u)
        y = self.shared_experts(x) + self.routed_expert_up_proj(self.routed_expert_norm(u))
        return y.view(shape)

    def update_bias(self, group: dist.ProcessGroup | None = None, windows_left: int | None = None) -> None:
        """Quantile Balancing from the micro-batches since the last update, pooled over ``group``
        (``update_router_biases`` for this layer alone)."""
        update_router_biases([self], group, windows_left)

    @torch.no_grad()
    def prepare_bias_update(self, windows_left: int | None) -> None:
        """The layer's part of an update before the pooling.

        Within a step (``windows_left``: the windows of the step still to route) the update uses the forward's
        scores: the weights have not moved. After the optimizer step (None), with re-scoring on, the kept
        router inputs are scored here by the updated router instead.
        """
        if windows_left is None and self.router_inputs:
            self.balancer.reset()
            for x in self.router_inputs:
                routing = self.gate(x)
                self.balancer.observe(routing.scores, routing.cutoff, self.gate.e_score_correction_bias)
        self.router_inputs.clear()


@torch.no_grad()
def update_router_biases(layers: list[LatentMoE], group: dist.ProcessGroup | None = None,
                         windows_left: int | None = None) -> None:
    """Quantile Balancing of every layer in ``layers`` (``LatentMoE.prepare_bias_update``, then
    ``quantile_balancing.update_biases``): one all-reduce over ``group`` for all of them. ``windows_left``:
    None after the optimizer step; within a step, the windows (groups of micro-batches) still to route, which
    step feedback spreads the step's running per-expert deficit over."""
    for layer in layers:
        layer.prepare_bias_update(windows_left)
    update_biases([(layer.balancer, layer.gate.e_score_correction_bias, windows_left) for layer in layers], group)
