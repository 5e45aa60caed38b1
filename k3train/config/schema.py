"""Typed configuration schema. Hydra fills these dataclasses from ``conf/``.

Every field has a default so that a structured config can be built from Python
(tests, benchmarks) without Hydra. ``k3train.config.validate`` checks the whole
tree once at start-up, before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    """K3 backbone hyper-parameters (K3_SPEC.md §1, §5). Defaults are ``k3_tiny``."""

    name: str = "k3_tiny"
    hidden_size: int = 64
    num_layers: int = 9
    vocab_size: int = 512
    # 1-based indices of the MLA layers, as in the HF ``full_attn_layers`` field.
    full_attn_layers: list[int] = field(default_factory=lambda: [4, 8, 9])
    # Require the K3 pattern: MLA iff (l+1) % 4 == 0 or l is the last layer.
    require_k3_layer_pattern: bool = True

    # KDA
    kda_num_heads: int = 2
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_gate_lower_bound: float = -5.0

    # Gated NoPE MLA
    mla_num_heads: int = 2
    q_lora_rank: int = 32
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16

    # Block Attention Residuals
    attn_res_block_size: int = 4

    # FFNs
    first_k_dense: int = 1
    dense_intermediate_size: int = 192
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 2
    moe_intermediate_size: int = 32
    latent_size: int = 32  # routed_expert_hidden_size (ℓ)
    routed_scaling_factor: float = 1.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    # Quantile Balancing (§2.5)
    qb_estimator: str = "histogram"  # "histogram" (App. D) or "exact"
    qb_bins: int = 1000
    qb_ema: float = 0.0  # 0 disables the EMA of the estimates
    # Re-score the router inputs at every s-th position of the step's sequences with the router
    # weights after the optimizer step, and estimate the next bias from those scores
    # (docs/moe_notes.md). Memory: d values per kept token per MoE layer. 0: the forward's scores.
    qb_rescore_stride: int = 0
    # Bias updates per optimizer step on a rank: U = 1 once, after the step (as published); U > 1 also
    # after every n/U of the rank's n micro-batches, from their forward scores (U must divide n); 0 (the
    # default): after every micro-batch, U = n (once a step under pipeline parallelism, whose schedule
    # interleaves the micro-batches). Under data parallelism the windows pool the ranks' micro-
    # batches, so a fixed U routes alike at any DP size and 0 does not (docs/moe_notes.md §3, §5).
    qb_updates_per_step: int = 0
    # Step feedback g (k3train/model/quantile_balancing.py): each update within the step also steers the
    # step's running per-expert counts back to their mean (g = 1: in equal parts over the windows left).
    # 0: each window is balanced on its own. No effect with one update a step.
    qb_step_feedback: float = 0.5

    rms_norm_eps: float = 1e-5
    init_std: float = 0.006
    max_seq_len: int = 1048576

    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the MLA layers."""
        return sorted(i - 1 for i in self.full_attn_layers)

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    def qb_windows(self, micro_batches: int) -> int:
        """Quantile Balancing's bias updates a step (windows) on a rank that runs ``micro_batches`` a step."""
        return self.qb_updates_per_step or micro_batches


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int = 1
    # Pipeline parallelism (docs/parallelism.md): the layers are cut into pipeline·virtual_stages chunks;
    # stage p runs chunks p, p+P, p+2P, ... (interleaved 1F1B when virtual_stages > 1).
    virtual_stages: int = 1
    # Layers per chunk in pipeline order (pipeline·virtual_stages entries summing to model.num_layers;
    # uneven is fine). A 0 first / last entry puts the embedding / the output head on a chunk of its own.
    # Empty: equal chunks.
    pipeline_layout: list[int] = field(default_factory=list)
    # MoE token dispatcher when expert > 1: "alltoall" (every token copy computed on its expert's
    # home rank) or "balanced" (replicas of hot experts: every rank computes the same load).
    ep_dispatcher: str = "alltoall"
    # "auto": nccl when CUDA is available, else gloo.
    backend: str = "auto"


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw" or "muon"; the Hydra default is conf/optim/muon.yaml (conf/config.yaml)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_fraction: float = 0.01
    grad_clip: float = 1.0
    # Muon (issue 4)
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_ns_backend: str = "auto"  # Newton–Schulz: "auto" (on CUDA the fused Triton kernel for ≤128-row blocks,
    # the tiled Triton GEMMs for large calls, bmm otherwise), "torch", "triton", "tiled" (the tiled kernel for
    # every call over 128 rows) or "inductor" (those through torch.compile max-autotune); see
    # k3train.optim.muon.ns_backend
    per_head_groups: list[str] = field(default_factory=lambda: ["kda_qkv", "mla_q_b", "mla_kv_b"])
    qk_clip_tau: Optional[float] = None
    # QK-clip reads each MLA head's exact max logit only where its attention log-sum-exp bound reaches tau
    # (the bound is at most log T above it; k3train/model/mla.py); true: the exact maximum for every head
    qk_clip_exact_max: bool = False


@dataclass
class DataConfig:
    # Prefixes of Megatron indexed datasets (path without .bin/.idx); weights optional.
    # Empty: build the embedded default corpus into ``cache_dir`` on first use.
    paths: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    tokenizer: Optional[str] = None  # a tokenizer.json or tiktoken BPE file; None uses the one built with the data
    cache_dir: str = "${oc.env:K3TRAIN_CACHE,'~/.cache/k3train'}"
    seq_len: int = 128
    split: str = "98,2,0"
    seed: int = 1234


PRECISION_RECIPES = ("bf16", "mxfp8", "fp8_block")  # precision.recipe (k3train/precision/recipes.py)


@dataclass
class PrecisionConfig:
    # Compute dtype (bf16 autocast or none). "auto": bf16 on GPU, fp32 on CPU. Or "fp32" / "bf16".
    dtype: str = "auto"
    # Parameter storage (docs/precision.md): "bf16" is Megatron's mixed precision (bf16 model weights; fp32
    # main weights, main gradients and optimizer state; checkpoints hold the fp32 main weights), "fp32"
    # keeps fp32 model weights (cast to bf16 by autocast at every use). "auto": bf16 when the compute
    # dtype is bf16 (GPU), else fp32. bf16 needs a bf16 compute dtype.
    params: str = "auto"
    # "auto": Transformer Engine when importable, else torch. Or "torch" / "te".
    linear_backend: str = "auto"
    # The routed experts' grouped GEMMs (``k3train.model.moe.grouped_gemm_configs``): "torch" (torch._grouped_mm
    # and the Triton wgrad), or kernels.grouped_gemm_sm90's CUTLASS kernels, an optional build for bf16 on sm_90:
    # "tiles:1" (the expert-tiled kernel, rows padded per expert: 1.30x the dense GEMMs against torch's 1.40x on
    # bench-1B's MoE, docs/moe_notes.md §2), "fused:1" (the same with SiTU in the products' epilogues: 1.24x),
    # "cutlass:<i>", each with ":<j>" for the wgrad. One process's experts only (parallel.expert = 1).
    expert_gemm: str = "torch"
    # Quantization-aware training of routed experts (issue 5): MXFP4 weights, MXFP8 inputs.
    expert_qat: bool = False
    # GEMM format of the linear layers (LM head and routed experts excluded): "bf16" (plain), "mxfp8"
    # (TE on sm_100+, else exact emulation) or "fp8_block" (DeepSeek-V3 FP8 via torch._scaled_mm, GPU).
    recipe: str = "bf16"


RECOMPUTE_POLICIES = ("none", "attn_res", "kda", "full")  # train.recompute (k3train/training/recompute.py)
COMPILE_MODES = ("default", "reduce-overhead")  # train.compile_mode: torch.compile's mode


@dataclass
class TrainConfig:
    steps: int = 200  # total optimizer steps of the run (the LR schedule spans these)
    # Leave after this many steps in this process, with a checkpoint (SLURM time slices); 0 = never.
    exit_after_steps: int = 0
    # Leave after this many minutes of training in this process, with a checkpoint; 0 = never.
    exit_after_minutes: float = 0.0
    global_batch_size: int = 16
    micro_batch_size: int = 4
    seed: int = 1234
    eval_every: int = 50
    eval_iters: int = 4
    log_every: int = 1
    save_every: int = 100
    keep_last: int = 0  # keep only the newest N checkpoints of the run (0 = all)
    out_dir: str = "runs/${model.name}"
    # "auto": resume from the latest checkpoint in out_dir if one exists; "none"; or a path.
    resume: str = "auto"
    # Initialise the model weights only (fresh optimizer, step 0) from an HF Kimi K3 folder or one of
    # our checkpoints; ignored when train.resume finds a checkpoint to resume. None: random init.
    init_from: Optional[str] = None
    device: str = "auto"  # "auto", "cpu" or "cuda"
    deterministic: bool = False  # torch.use_deterministic_algorithms; tests that compare runs set it
    # Guards (docs/operating.md). A step is skipped (no optimizer update) when its loss or gradients are
    # not finite, or on a loss spike with loss_spike_action=skip. The run stops with an error after more
    # than max_consecutive_skips skipped steps in a row; no checkpoint is written during such a streak.
    max_consecutive_skips: int = 5
    # A loss above factor x the median of the last loss_spike_window healthy steps is a spike; 0 = off.
    loss_spike_factor: float = 0.0
    loss_spike_window: int = 20
    loss_spike_action: str = "skip"  # "skip" the step, or "stop" the run
    # Write checkpoints in a background process while training goes on; ``latest`` moves once the files are complete.
    async_save: bool = False
    # A collective that waits longer than this (a hung or lost rank) fails the run instead of hanging it.
    collective_timeout_s: float = 600.0
    # [first, last] steps (1-based, inclusive) to trace with torch.profiler into <out_dir>/profile; [] = off.
    profile_steps: list[int] = field(default_factory=list)
    # torch.compile each decoder layer (k3train/training/compile.py): fuses the elementwise glue around the
    # GEMMs and kernels. Needs bf16 activations, data parallelism only (parallel.tensor = pipeline = context =
    # expert = 1), plain bf16 GEMMs and torch linears (precision.linear_backend=auto resolves to torch).
    compile: bool = False
    # torch.compile's mode for train.compile: "reduce-overhead" (each layer graph also a CUDA graph: the step
    # stops being host-bound; docs/operating.md) or "default" (no CUDA graphs: less memory held in their pool).
    compile_mode: str = "reduce-overhead"
    # Capture the optimizer step in a CUDA graph after two eager steps and replay it (optim=muon, one GPU, one
    # rank; k3train/training/optimizer_graph.py): K3Muon's step issues ~800 kernels and its host time exceeds
    # its GPU time (docs/muon_notes.md). None (the default): on wherever it applies; true: required (start-up
    # says why not); false: off.
    optimizer_cuda_graph: Optional[bool] = None
    # Activation recompute (docs/operating.md): "none", "attn_res" (the AttnRes sites), "kda" (those and the
    # KDA mixers) or "full" (whole decoder layers); each trades a second forward of those parts for memory.
    recompute: str = "none"


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_project: str = "k3train"
    # "auto": online when W&B credentials exist (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry),
    # else offline.
    wandb_mode: str = "auto"
    wandb_entity: Optional[str] = None  # team or user; None: the account's default
    wandb_group: Optional[str] = None  # e.g. a sweep's name, to compare its runs together
    wandb_tags: list[str] = field(default_factory=list)
    wandb_name: Optional[str] = None  # the run's display name; None: W&B picks one
    console: bool = True


@dataclass
class K3Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
