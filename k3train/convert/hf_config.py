"""The Hugging Face ``config.json`` of a Kimi K3 checkpoint ↔ our ``ModelConfig`` (K3_SPEC.md §1, §4).

The top level names the multimodal wrapper (``model_type`` ``kimi_k3``); the backbone fields
sit under ``text_config`` (``model_type`` ``kimi_linear``). Fields that exist only in k3train
(Quantile Balancing settings, the init std, the config name) travel in ``text_config.k3train``
so a round trip restores them; a published config without that block gets our defaults.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from k3train.config.schema import ModelConfig

MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
ARCHITECTURES = ["KimiK3ForConditionalGeneration"]
# ModelConfig fields with no HF counterpart: carried in text_config["k3train"].
K3TRAIN_ONLY = ("name", "require_k3_layer_pattern", "qb_estimator", "qb_bins", "qb_ema", "qb_rescore_stride",
                "qb_updates_per_step", "qb_step_feedback", "init_std")
# Tensors the quantizer leaves alone (compressed-tensors ``ignore``): only routed experts are MXFP4.
MXFP4_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


class HFConfigError(ValueError):
    """config.json is missing, of the wrong model type, or inconsistent with the weights."""


def text_config(cfg: ModelConfig) -> dict[str, Any]:
    """Our model config as the HF ``text_config`` block (keys in a fixed order)."""
    mla = sorted(cfg.full_attn_layers)
    return {
        "model_type": TEXT_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "linear_attn_config": {
            "full_attn_layers": mla,
            "kda_layers": [i for i in range(1, cfg.num_layers + 1) if i not in mla],
            "num_heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.kda_conv_size,
            "gate_lower_bound": cfg.kda_gate_lower_bound,
            "use_full_rank_gate": True,
        },
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "first_k_dense_replace": cfg.first_k_dense,
        "intermediate_size": cfg.dense_intermediate_size,
        "moe_layer_freq": 1,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_shared_experts": cfg.num_shared_experts,
        "routed_expert_hidden_size": cfg.latent_size,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": True,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta,
        "attn_res_block_size": cfg.attn_res_block_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "k3train": {k: getattr(cfg, k) for k in K3TRAIN_ONLY},
    }


def quantization_config() -> dict[str, Any]:
    """compressed-tensors MXFP4 (group 32, E8M0 uint8 scales, weights only) on the routed experts."""
    weights = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
               "dynamic": False, "scale_dtype": "uint8"}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "format": "mxfp4-pack-quantized"}},
            "ignore": MXFP4_IGNORE}


def hf_config(cfg: ModelConfig, experts: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """The whole ``config.json``; ``experts`` is "bf16" or "mxfp4"."""
    out: dict[str, Any] = {"architectures": ARCHITECTURES, "model_type": MODEL_TYPE,
                           "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config"},
                           "torch_dtype": dtype, "text_config": text_config(cfg)}
    if experts == "mxfp4":
        out["quantization_config"] = quantization_config()
    return out


def _get(block: dict, key: str, path: Path) -> Any:
    if key not in block:
        raise HFConfigError(f"{path}: text_config has no field {key!r}; it is not a Kimi K3 config.json")
    return block[key]


def model_config_from_hf(config: dict[str, Any], path: Path) -> ModelConfig:
    """Parse a K3 ``config.json`` dict into our ``ModelConfig``; errors name the file and field."""
    if config.get("model_type") != MODEL_TYPE:
        raise HFConfigError(f"{path}: model_type is {config.get('model_type')!r}, expected {MODEL_TYPE!r} "
                            f"(a Kimi K3 checkpoint); convert only K3-layout checkpoints")
    tc = config.get("text_config")
    if not isinstance(tc, dict):
        raise HFConfigError(f"{path}: no text_config block; a Kimi K3 config.json keeps the backbone there")
    lin = _get(tc, "linear_attn_config", path)
    g = lambda key: _get(tc, key, path)  # noqa: E731
    if g("hidden_act") != "situ":
        raise HFConfigError(f"{path}: text_config.hidden_act={g('hidden_act')!r}; k3train implements only 'situ'")
    fields = dict(
        hidden_size=g("hidden_size"), num_layers=g("num_hidden_layers"), vocab_size=g("vocab_size"),
        full_attn_layers=sorted(_get(lin, "full_attn_layers", path)),
        kda_num_heads=_get(lin, "num_heads", path), kda_head_dim=_get(lin, "head_dim", path),
        kda_conv_size=_get(lin, "short_conv_kernel_size", path),
        kda_gate_lower_bound=float(_get(lin, "gate_lower_bound", path)),
        mla_num_heads=g("num_attention_heads"), q_lora_rank=g("q_lora_rank"), kv_lora_rank=g("kv_lora_rank"),
        qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"), v_head_dim=g("v_head_dim"),
        attn_res_block_size=g("attn_res_block_size"), first_k_dense=g("first_k_dense_replace"),
        dense_intermediate_size=g("intermediate_size"), num_experts=g("num_experts"),
        num_experts_per_token=g("num_experts_per_token"), num_shared_experts=g("num_shared_experts"),
        moe_intermediate_size=g("moe_intermediate_size"), latent_size=g("routed_expert_hidden_size"),
        routed_scaling_factor=float(g("routed_scaling_factor")), situ_beta=float(g("activation_situ_beta")),
        situ_linear_beta=float(g("activation_situ_linear_beta")), rms_norm_eps=float(g("rms_norm_eps")),
        max_seq_len=g("max_position_embeddings"),
    )
    fields["init_std"] = float(tc.get("initializer_range", ModelConfig.init_std))
    extra = tc.get("k3train", {})
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields.update({k: v for k, v in extra.items() if k in known})
    fields.setdefault("name", "hf_import")
    return ModelConfig(**fields)


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path} not found; an HF checkpoint folder holds config.json next to its shards")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFConfigError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); re-download it") from None


def experts_format(config: dict[str, Any]) -> str:
    """"mxfp4" when the config declares the compressed-tensors MXFP4 format, else "bf16"."""
    q = config.get("quantization_config") or {}
    return "mxfp4" if q.get("format") == "mxfp4-pack-quantized" else "bf16"
