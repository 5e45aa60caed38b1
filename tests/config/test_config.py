"""Hydra config tree, start-up validation, parameter counts and the FLOP counter."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3train.config.load import load_config
from k3train.config.param_count import count_params
from k3train.config.schema import K3Config, ModelConfig
from k3train.config.validate import ConfigError, k3_mla_layers, validate
from k3train.model.k3 import K3Model
from k3train.model.roles import Kind, get_role
from k3train.training.flops import forward_flops_per_token

REPO = Path(__file__).resolve().parents[2]

SPEC_COUNTS = {  # K3_SPEC.md §1 and §5
    "k3_tiny": (622_428, 442_204),
    "k3_tiny_kernel": (7_082_822, 4_461_382),
    "k3_bench_1b": (1_053_058_248, 319_055_048),
    "k3_bench_3b": (2_632_534_928, 682_183_568),
    "k3": (2_779_484_476_000, 104_189_612_640),
}


def test_overrides_reach_the_typed_config():
    cfg = load_config(["model=k3_tiny", "train.steps=50", "optim.lr=3e-4"])
    assert isinstance(cfg, K3Config)
    assert (cfg.model.name, cfg.train.steps, cfg.optim.lr) == ("k3_tiny", 50, 3e-4)
    validate(cfg)


def test_override_of_unknown_field_or_wrong_type_fails():
    with pytest.raises(Exception, match="no_such_field"):
        load_config(["train.no_such_field=1"])
    with pytest.raises(Exception, match="steps"):
        load_config(["train.steps=many"])


@pytest.mark.parametrize("name", sorted(SPEC_COUNTS))
def test_param_counts_match_spec(name):
    cfg = load_config([f"model={name}"])
    validate(cfg)
    counts = count_params(cfg.model)
    assert (counts.total, counts.active) == SPEC_COUNTS[name]
    if name in ("k3_tiny", "k3_tiny_kernel"):  # the real modules hold exactly that many
        model = K3Model(cfg.model)
        n = sum(p.numel() for p in model.parameters()) + sum(
            m.gate.e_score_correction_bias.numel() for m in model.moe_layers())
        assert n == counts.total


def test_params_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "k3train.params", "model=k3"], cwd=REPO, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout
    row = json.loads(out.strip().splitlines()[-1])
    assert (row["total"], row["active"]) == SPEC_COUNTS["k3"]


def _cfg(**sections) -> K3Config:
    cfg = load_config([])
    for section, fields in sections.items():
        obj = getattr(cfg, section)
        for k, v in fields.items():
            setattr(obj, k, v)
    return cfg


@pytest.mark.parametrize("sections,world,field", [
    ({"parallel": {"tensor": 2, "expert_tensor": 2}, "model": {"kda_num_heads": 3}}, 2, "model.kda_num_heads"),
    ({"parallel": {"expert": 3}}, 3, "model.num_experts"),
    ({"model": {"full_attn_layers": [4, 8]}}, 1, "model.full_attn_layers"),
    ({"model": {"num_experts_per_token": 8}}, 1, "model.num_experts_per_token"),
    ({"model": {"attn_res_block_size": 0}}, 1, "model.attn_res_block_size"),
    ({"model": {"kda_gate_lower_bound": -6.0}}, 1, "model.kda_gate_lower_bound"),
    ({"train": {"global_batch_size": 10}}, 1, "train.global_batch_size"),
    ({"data": {"weights": [1.0]}}, 1, "data.weights"),
    ({"parallel": {"tensor": 2, "expert_tensor": 2}}, 3, "parallel.tensor"),
    ({"model": {"qb_updates_per_step": 3}}, 1, "model.qb_updates_per_step"),  # 16 / 4 = 4 micro-batches
    ({"model": {"qb_rescore_stride": -1}}, 1, "model.qb_rescore_stride"),
    ({"model": {"qb_updates_per_step": -1}}, 1, "model.qb_updates_per_step=-1 must divide"),
    ({"model": {"qb_step_feedback": -0.5, "qb_updates_per_step": 2}}, 1, "model.qb_step_feedback=-0.5 must be"),
    ({"precision": {"recipe": "fp4"}}, 1, "precision.recipe"),
    ({"precision": {"recipe": "fp8_block"}, "train": {"device": "cpu"}}, 1, "precision.recipe"),
    ({"precision": {"params": "fp16"}}, 1, "precision.params"),
    ({"precision": {"params": "bf16", "dtype": "fp32"}}, 1, "precision.params=bf16"),
    ({"precision": {"params": "bf16"}, "train": {"device": "cpu"}}, 1, "precision.params=bf16"),  # auto: fp32
    ({"precision": {"params": "fp32", "dtype": "bf16"}, "train": {"device": "cpu"}}, 1, "precision.params=fp32"),
    ({"train": {"recompute": "selective"}}, 1, "train.recompute='selective': use one of none, attn_res, kda, full"),
    ({"train": {"optimizer_cuda_graph": True, "device": "cpu"}}, 1, "train.optimizer_cuda_graph=true"),
    ({"train": {"optimizer_cuda_graph": True, "device": "cuda"}, "optim": {"name": "adamw"}}, 1, "optim.name=adamw"),
    ({"train": {"optimizer_cuda_graph": True, "device": "cuda"}, "optim": {"name": "muon"}}, 2, "world size 2"),
])
def test_validation_names_the_field(sections, world, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(_cfg(**sections), world_size=world)


@pytest.mark.parametrize("dtype,params,device,want", [
    ("auto", "auto", "cuda", ("bf16", "bf16")),  # Megatron's default on the GPU
    ("auto", "auto", "cpu", ("fp32", "fp32")),  # CPU tests keep fp32
    ("bf16", "auto", "cpu", ("bf16", "bf16")),
    ("auto", "fp32", "cuda", ("bf16", "fp32")),  # bf16 autocast over fp32 weights
])
def test_precision_dtypes_resolve(dtype, params, device, want):
    from k3train.config.validate import precision_dtypes

    assert precision_dtypes(_cfg(precision={"dtype": dtype, "params": params}).precision, device) == want


def test_layer_pattern_rule_is_k3s():
    assert k3_mla_layers(93) == list(range(4, 93, 4)) + [93]
    assert k3_mla_layers(9) == [4, 8, 9]
    cfg = _cfg(model={"full_attn_layers": [3, 9], "require_k3_layer_pattern": False})
    validate(cfg)  # an explicit opt-out allows other patterns


def test_flop_counter_matches_the_model_weights():
    """2·(matmul weights a token touches) from the real module roles equals the counter's matmul term."""
    cfg = load_config([]).model
    model = K3Model(cfg)
    touched = 0.0
    for name, p in model.named_parameters():
        kind = get_role(p).kind
        if kind in (Kind.MATRIX, Kind.LM_HEAD):
            touched += p.numel()
        elif kind == Kind.EXPERT_MATRIX:
            touched += p.numel() * cfg.num_experts_per_token / cfg.num_experts
    seq = 64
    n_mla = sum(cfg.is_mla(i) for i in range(cfg.num_layers))
    n_kda = cfg.num_layers - n_mla
    core = (n_mla * 2 * (seq / 2) * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
            + n_kda * cfg.kda_num_heads * (6 * cfg.kda_head_dim ** 2 + 3 * 64 * cfg.kda_head_dim + 64 ** 2))
    assert forward_flops_per_token(cfg, seq) == pytest.approx(2 * touched + core, rel=1e-12)


def test_schema_defaults_are_k3_tiny():
    assert dataclasses.asdict(load_config([]).model) == dataclasses.asdict(load_config(["model=k3_tiny"]).model)


def test_optimizer_cuda_graph_is_on_where_it_applies():
    """train.optimizer_cuda_graph: null (the default) means K3Muon on one CUDA rank; an explicit value wins
    (true is checked at start-up by validate)."""
    from k3train.training.optimizer_graph import captures_optimizer_step

    assert _cfg().train.optimizer_cuda_graph is None
    validate(_cfg(train={"device": "cpu"}))  # the default passes on CPU, where it resolves to off
    assert captures_optimizer_step(None, "cuda", "muon", 1)
    assert not captures_optimizer_step(None, "cpu", "muon", 1)
    assert not captures_optimizer_step(None, "cuda", "adamw", 1)
    assert not captures_optimizer_step(None, "cuda", "muon", 2)
    assert not captures_optimizer_step(False, "cuda", "muon", 1)
    assert captures_optimizer_step(True, "cuda", "muon", 1)


def test_quantile_balancing_updates_after_every_micro_batch_by_default():
    """model.qb_updates_per_step = 0 (the default) is one window per micro-batch of the rank's step, whatever
    their number; a fixed U stays U. Step feedback 0.5 is on by default (the README recipe)."""
    m = ModelConfig()
    assert m.qb_updates_per_step == 0 and m.qb_step_feedback == 0.5
    assert [m.qb_windows(n) for n in (1, 4, 8)] == [1, 4, 8]
    assert ModelConfig(qb_updates_per_step=2).qb_windows(8) == 2
    validate(K3Config(), world_size=1)  # 0 passes the divisibility check
