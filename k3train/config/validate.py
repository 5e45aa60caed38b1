"""Start-up validation of the whole config tree.

Runs once, before any process group exists. Every error names the field and the fix.
``world_size`` is the number of processes the job was launched with.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

from k3train.config.schema import (COMPILE_MODES, PRECISION_RECIPES, RECOMPUTE_POLICIES, K3Config, ModelConfig,
                                   PrecisionConfig)
from k3train.parallel.pipeline.layout import layout_error


class ConfigError(ValueError):
    """A config field is invalid; the message names the field and how to fix it."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def k3_mla_layers(num_layers: int) -> list[int]:
    """1-based MLA layers of the K3 pattern: every 4th layer, plus the last."""
    return sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})


def validate_model(m: ModelConfig, tp: int = 1, ep: int = 1) -> None:
    for name in ("hidden_size", "num_layers", "vocab_size", "kda_num_heads", "kda_head_dim", "mla_num_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "dense_intermediate_size",
                 "num_experts", "num_experts_per_token", "latent_size", "moe_intermediate_size",
                 "kda_conv_size", "qb_bins"):
        _need(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be positive")
    _need(m.qk_rope_head_dim >= 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be >= 0")
    _need(m.attn_res_block_size > 0,
          f"model.attn_res_block_size={m.attn_res_block_size} must be positive (K3 uses 12; proxies use 2 or 4)")
    bad = [i for i in m.full_attn_layers if not 1 <= i <= m.num_layers]
    _need(not bad, f"model.full_attn_layers has {bad} outside 1..num_layers={m.num_layers} (indices are 1-based)")
    if m.require_k3_layer_pattern:
        want = k3_mla_layers(m.num_layers)
        _need(sorted(m.full_attn_layers) == want,
              f"model.full_attn_layers={sorted(m.full_attn_layers)} is not the K3 3:1 pattern with a final MLA "
              f"layer for num_layers={m.num_layers}; set it to {want} or set model.require_k3_layer_pattern=false")
    _need(m.num_experts_per_token < m.num_experts,
          f"model.num_experts_per_token={m.num_experts_per_token} must be below model.num_experts={m.num_experts} "
          f"(Quantile Balancing reads the (k+1)-th score)")
    _need(0 <= m.first_k_dense <= m.num_layers, f"model.first_k_dense={m.first_k_dense} must be in 0..num_layers")
    _need(-5.0 <= m.kda_gate_lower_bound < 0.0,
          f"model.kda_gate_lower_bound={m.kda_gate_lower_bound} must be in [-5, 0): the chunked KDA kernel is "
          f"exact only there (K3 uses -5)")
    _need(m.qb_estimator in ("histogram", "exact"), f"model.qb_estimator={m.qb_estimator!r}: use histogram or exact")
    _need(0.0 <= m.qb_ema < 1.0, f"model.qb_ema={m.qb_ema} must be in [0, 1)")
    _need(0.0 <= m.qb_step_feedback <= 4.0, f"model.qb_step_feedback={m.qb_step_feedback} must be in [0, 4] "
                                            f"(0 turns it off, 1 corrects over the windows left)")
    _need(m.qb_rescore_stride >= 0, f"model.qb_rescore_stride={m.qb_rescore_stride} must be >= 0 "
                                    f"(0 = the forward's scores, s = re-score every s-th position)")
    for name in ("kda_num_heads", "mla_num_heads", "vocab_size", "dense_intermediate_size",
                 "moe_intermediate_size"):
        value = getattr(m, name)
        _need(value % tp == 0, f"model.{name}={value} is not divisible by parallel.tensor={tp}; "
                               f"choose a tensor-parallel size that divides it")
    _need(m.num_experts % ep == 0, f"model.num_experts={m.num_experts} is not divisible by parallel.expert={ep}; "
                                   f"choose an expert-parallel size that divides it")


def validate_keys(raw) -> None:
    """Refuse keys the schema lacks (a Hydra ``+train.save_evry=1`` typo), naming the closest field.

    ``raw`` is the composed DictConfig (or a nested dict), checked before it becomes a ``K3Config``.
    """
    from omegaconf import DictConfig, OmegaConf

    tree = OmegaConf.to_container(raw, resolve=False) if isinstance(raw, DictConfig) else raw
    _check_keys({k: v for k, v in tree.items() if k != "hydra"}, K3Config, "")


def _check_keys(tree: dict, cls: type, prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in tree.items():
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"the fields are: {', '.join(names)}"
            raise ConfigError(f"{prefix}{key} is not a config field; {hint} (fix or remove the override)")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            _check_keys(value, hints[key], f"{prefix}{key}.")


def validate(cfg: K3Config, world_size: int = 1) -> None:
    p = cfg.parallel
    for name in ("tensor", "pipeline", "context", "expert", "expert_tensor"):
        _need(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be >= 1")
    _need(p.backend in ("auto", "gloo", "nccl"), f"parallel.backend={p.backend!r}: use auto, gloo or nccl")
    _need(p.ep_dispatcher in ("alltoall", "balanced"),
          f"parallel.ep_dispatcher={p.ep_dispatcher!r}: use alltoall or balanced")
    validate_model(cfg.model, p.tensor, p.expert)
    _need(p.virtual_stages >= 1, f"parallel.virtual_stages={p.virtual_stages} must be >= 1")
    layout_problem = layout_error(cfg.model.num_layers, p.pipeline, p.virtual_stages, list(p.pipeline_layout))
    _need(layout_problem is None, layout_problem or "")
    _need(p.expert_tensor == p.tensor, f"parallel.expert_tensor={p.expert_tensor} must equal parallel.tensor="
                                       f"{p.tensor} (routed experts are split like dense layers)")
    model_parallel = p.tensor * p.pipeline * p.context
    _need(world_size % model_parallel == 0,
          f"world size {world_size} is not divisible by parallel.tensor*pipeline*context={model_parallel}; "
          f"launch a multiple of {model_parallel} processes")
    data_context = world_size // (p.tensor * p.pipeline)
    _need(data_context % p.expert == 0,
          f"parallel.expert={p.expert} must divide the {data_context} data×context-parallel ranks (world size "
          f"{world_size} / parallel.tensor*pipeline={p.tensor * p.pipeline}); launch "
          f"{p.tensor * p.pipeline * p.expert}·n processes or lower parallel.expert")

    lg = cfg.logging
    _need(lg.wandb_mode in ("auto", "online", "offline", "disabled"),
          f"logging.wandb_mode={lg.wandb_mode!r}: use auto, online, offline or disabled")

    o = cfg.optim
    _need(o.name in ("adamw", "muon"), f"optim.name={o.name!r}: use adamw or muon")
    _need(o.lr > 0, f"optim.lr={o.lr} must be positive")
    _need(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _need(0.0 <= o.warmup_fraction < 1.0, f"optim.warmup_fraction={o.warmup_fraction} must be in [0, 1)")
    _need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)} must be two "
                                                                   f"values in [0, 1)")
    _need(o.muon_ns_backend in ("auto", "torch", "triton", "tiled", "inductor"),
          f"optim.muon_ns_backend={o.muon_ns_backend!r}: use auto, torch, triton, tiled or inductor")
    _need(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    _need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0 (0 disables weight decay)")
    _need(o.qk_clip_tau is None or o.qk_clip_tau >= 0,
          f"optim.qk_clip_tau={o.qk_clip_tau} must be >= 0 (null or 0 turns QK-clip off)")

    t = cfg.train
    dp = world_size // model_parallel
    _need(t.steps > 0, f"train.steps={t.steps} must be positive")
    _need(t.micro_batch_size > 0, f"train.micro_batch_size={t.micro_batch_size} must be positive")
    _need(t.global_batch_size % (t.micro_batch_size * dp) == 0,
          f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
          f"{t.micro_batch_size} x data-parallel size {dp}; make it a multiple of {t.micro_batch_size * dp}")
    n_micro = t.global_batch_size // (t.micro_batch_size * dp)
    u = cfg.model.qb_updates_per_step
    _need(u == 0 or (u >= 1 and n_micro % u == 0),
          f"model.qb_updates_per_step={u} must divide the {n_micro} micro-batches of a step (train.global_batch_"
          f"size / (train.micro_batch_size x data-parallel size {dp})); use a divisor of {n_micro}, or 0 (after "
          f"every micro-batch)")
    if p.pipeline > 1:
        _need(u <= 1, f"model.qb_updates_per_step={u}: under parallel.pipeline={p.pipeline} the micro-batches of a "
                      f"step interleave across stages, so Quantile Balancing updates once per step; set "
                      f"model.qb_updates_per_step=1 (0, the default, also means once a step there)")
        _need(p.virtual_stages == 1 or n_micro % p.pipeline == 0,
              f"the {n_micro} micro-batches of a step (train.global_batch_size / (train.micro_batch_size x data-"
              f"parallel size {dp})) are not a multiple of parallel.pipeline={p.pipeline}, which the interleaved "
              f"schedule (parallel.virtual_stages={p.virtual_stages}) needs; make train.global_batch_size a multiple "
              f"of {t.micro_batch_size * dp * p.pipeline} or set parallel.virtual_stages=1")
    _need(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r}: use auto, cpu or cuda")
    _need(t.eval_every >= 0 and t.save_every >= 0 and t.log_every > 0,
          "train.eval_every and train.save_every must be >= 0 (0 disables) and train.log_every > 0")
    _need(t.exit_after_steps >= 0,
          f"train.exit_after_steps={t.exit_after_steps} must be >= 0 (0 = run to train.steps)")
    _need(t.exit_after_minutes >= 0,
          f"train.exit_after_minutes={t.exit_after_minutes} must be >= 0 (0 = no time limit)")
    _need(t.keep_last >= 0, f"train.keep_last={t.keep_last} must be >= 0 (0 keeps every checkpoint)")
    _need(not t.eval_every or t.eval_iters > 0, f"train.eval_iters={t.eval_iters} must be positive when "
                                                f"train.eval_every={t.eval_every}; set it >= 1 or train.eval_every=0")
    _need(t.max_consecutive_skips >= 0, f"train.max_consecutive_skips={t.max_consecutive_skips} must be >= 0 "
                                        f"(0 = stop at the first skipped step)")
    _need(t.loss_spike_factor == 0 or t.loss_spike_factor > 1,
          f"train.loss_spike_factor={t.loss_spike_factor} must be 0 (off) or above 1, e.g. 3")
    _need(t.loss_spike_window >= 1, f"train.loss_spike_window={t.loss_spike_window} must be >= 1")
    _need(t.loss_spike_action in ("skip", "stop"),
          f"train.loss_spike_action={t.loss_spike_action!r}: use skip or stop")
    _need(t.collective_timeout_s > 0, f"train.collective_timeout_s={t.collective_timeout_s} must be positive "
                                      f"(seconds a collective may wait, e.g. 600)")
    _need(t.recompute in RECOMPUTE_POLICIES,
          f"train.recompute={t.recompute!r}: use one of {', '.join(RECOMPUTE_POLICIES)}")
    ps = list(t.profile_steps)
    _need(not ps or (len(ps) == 2 and 1 <= ps[0] <= ps[1] <= t.steps),
          f"train.profile_steps={ps} must be [] (off) or [first, last] with 1 <= first <= last <= train.steps="
          f"{t.steps}, e.g. [5,7]")

    d = cfg.data
    _need(d.seq_len > 0, f"data.seq_len={d.seq_len} must be positive")
    _need(d.seq_len % (2 * p.context) == 0,
          f"data.seq_len={d.seq_len} is not divisible by 2*parallel.context={2 * p.context} (each context-parallel "
          f"rank holds 2 of 2*context equal chunks); choose a multiple of {2 * p.context}")
    _need(not d.weights or len(d.weights) == len(d.paths),
          f"data.weights has {len(d.weights)} entries but data.paths has {len(d.paths)}; give one weight per path "
          f"or none")
    parts = d.split.split(",")
    _need(len(parts) == 3 and all(x.strip().replace(".", "", 1).isdigit() for x in parts),
          f"data.split={d.split!r} must be three comma-separated weights, e.g. '98,2,0'")
    _need(not t.eval_every or float(parts[1]) > 0,
          f"data.split={d.split!r} gives validation no share but train.eval_every={t.eval_every}; give it a share "
          f"(e.g. data.split=98,2,0) or set train.eval_every=0")

    pr = cfg.precision
    _need(pr.dtype in ("auto", "fp32", "bf16"), f"precision.dtype={pr.dtype!r}: use auto, fp32 or bf16")
    _need(pr.params in ("auto", "fp32", "bf16"), f"precision.params={pr.params!r}: use auto, fp32 or bf16")
    precision_dtypes(pr, _device_type(t.device))
    _need(pr.linear_backend in ("auto", "torch", "megatron", "te"),
          f"precision.linear_backend={pr.linear_backend!r}: use auto, megatron or te")
    _need(pr.recipe in PRECISION_RECIPES,
          f"precision.recipe={pr.recipe!r}: use one of {', '.join(PRECISION_RECIPES)} "
          f"(or pick a preset: precision=bf16|mxfp8|fp8_block)")
    _need(t.compile_mode in COMPILE_MODES,
          f"train.compile_mode={t.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}")
    if t.compile:
        for name in ("tensor", "pipeline", "context", "expert"):
            _need(getattr(p, name) == 1,
                  f"parallel.{name}={getattr(p, name)}: train.compile=true is built and tested with parallel.tensor, "
                  f"pipeline, context and expert at 1 (data parallelism only: TP, CP and EP put collectives and "
                  f"host-planned exchanges inside the layers); set train.compile=false")
        _need(pr.linear_backend in ("auto", "torch"),
              f"precision.linear_backend={pr.linear_backend}: train.compile=true builds torch linears (auto resolves "
              f"to torch; Megatron-Core's linears warn on every call, a graph break each, and at parallel.tensor=1 "
              f"they run the same GEMMs); set precision.linear_backend=auto or train.compile=false")
        _need(pr.recipe == "bf16" and not pr.expert_qat,
              f"precision.recipe={pr.recipe}, precision.expert_qat={pr.expert_qat}: train.compile=true is built and "
              f"tested with the plain bf16 GEMMs (precision.recipe=bf16, precision.expert_qat=false); set those or "
              f"train.compile=false")
        _need(t.recompute == "none",
              f"train.recompute={t.recompute}: train.compile=true is not built or tested with activation recompute "
              f"(a recomputed module's replay flag is a Python global the compiled graphs would guard on); set "
              f"train.recompute=none or train.compile=false")
        compute, _ = precision_dtypes(pr, _device_type(t.device))
        _need(compute == "bf16", f"precision.dtype={pr.dtype} with train.device={t.device} runs fp32 activations, "
                                 f"and torch.compile traces the routed experts' grouped GEMM (torch._grouped_mm) in "
                                 f"bf16 only; set precision.dtype=bf16 or train.compile=false")
    if t.optimizer_cuda_graph:
        _need(_device_type(t.device) == "cuda",
              f"train.optimizer_cuda_graph=true captures the optimizer step in a CUDA graph, but train.device="
              f"{t.device} is not a GPU; set train.optimizer_cuda_graph=false")
        _need(cfg.optim.name == "muon",
              f"optim.name={cfg.optim.name}: train.optimizer_cuda_graph=true captures K3Muon's step (which reads its "
              f"learning rates from the device); use optim=muon or set train.optimizer_cuda_graph=false")
        _need(world_size == 1,
              f"world size {world_size}: train.optimizer_cuda_graph=true is built for one rank (the step's "
              f"collectives, Newton–Schulz shared over DP and the TP gathers, are not captured); launch one "
              f"process or set train.optimizer_cuda_graph=false")
    _need(not (pr.recipe == "fp8_block" and t.device == "cpu"),
          "precision.recipe=fp8_block runs on the GPU only (torch._scaled_mm with block scales); on CPU use "
          "precision.recipe=mxfp8 or bf16")
    validate_expert_gemm(pr, p.expert, _device_type(t.device))


def validate_expert_gemm(pr: PrecisionConfig, expert_parallel: int, device_type: str) -> None:
    """``precision.expert_gemm``: a name ``grouped_gemm_configs`` parses; a CUTLASS one needs one process's experts,
    and on CUDA the built library, an sm_90 GPU and bf16 compute; on CPU only the expert-tiled kernel's torch
    reference runs ("tiles:<t>", the weight gradients on the default kernel)."""
    if pr.expert_gemm == "torch":
        return
    from k3train.model.moe import grouped_gemm_configs

    try:
        gemm = grouped_gemm_configs(pr.expert_gemm)
    except ValueError as err:
        raise ConfigError(f"precision.expert_gemm={pr.expert_gemm!r}: {err}") from None
    _need(expert_parallel == 1,
          f"precision.expert_gemm={pr.expert_gemm} with parallel.expert={expert_parallel}: the CUTLASS expert GEMMs "
          f"are built for one process's experts (the EP dispatchers do not pad rows per expert); set "
          f"precision.expert_gemm=torch or parallel.expert=1")
    if device_type == "cuda":
        from kernels import grouped_gemm_sm90

        _need(grouped_gemm_sm90.available(),
              f"precision.expert_gemm={pr.expert_gemm} needs an sm_90 GPU and the CUTLASS library at "
              f"{grouped_gemm_sm90.library_path()}: build it (python -m kernels.grouped_gemm_sm90.build --out <path>, "
              f"then K3_GROUPED_GEMM_LIB=<path>) or set precision.expert_gemm=torch")
        _need(precision_dtypes(pr, device_type)[0] == "bf16",
              f"precision.expert_gemm={pr.expert_gemm} runs bf16 GEMMs, but precision.dtype={pr.dtype} is fp32; "
              f"set precision.dtype=auto or bf16, or precision.expert_gemm=torch")
    else:
        _need(gemm.tiled and gemm.wgrad is None and not gemm.tiled_wgrad,
              f"precision.expert_gemm={pr.expert_gemm} on {device_type}: the CUTLASS kernels run on CUDA only (on CPU "
              f"\"tiles:<t>\" runs its torch reference); set precision.expert_gemm=torch or tiles:<t>")


def _device_type(device: str) -> str:
    """The device type ``train.device`` resolves to (``k3train.parallel.state.pick_device``)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def precision_dtypes(pr: PrecisionConfig, device_type: str) -> tuple[str, str]:
    """(compute, parameter) dtypes, each "bf16" or "fp32", that ``precision.dtype`` and ``precision.params``
    mean on ``device_type``: compute "auto" is bf16 on CUDA and fp32 on CPU; parameters "auto" follow the
    compute dtype. Refused: bf16 parameters under fp32 compute (nothing would cast the fp32 activations for
    the bf16 weights), and fp32 parameters under bf16 compute on CPU (Megatron-Core's linears restore
    autocast in their backward on CUDA only, so a bf16 gradient would meet an fp32 weight)."""
    compute = pr.dtype if pr.dtype != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    params = pr.params if pr.params != "auto" else compute
    _need(params == "fp32" or compute == "bf16",
          f"precision.params=bf16 needs bf16 compute, but precision.dtype={pr.dtype} is fp32 on {device_type}; "
          f"set precision.dtype=bf16 or precision.params=fp32")
    _need(not (params == "fp32" and compute == "bf16" and device_type == "cpu"),
          "precision.params=fp32 with bf16 compute (precision.dtype=bf16) does not run on CPU (Megatron-Core's "
          "linears restore autocast in the backward on CUDA only); set precision.params=auto or bf16")
    return compute, params
