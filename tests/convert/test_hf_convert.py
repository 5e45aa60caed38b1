"""HF Kimi K3 conversion (issue 13): the layout against K3_SPEC §4, exact round trips, deterministic
files, the independent reference forward, one-line errors, and the full-size listing."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convert_helpers import packed_batch, random_tiny, save_model
from k3train.config.load import load_config
from k3train.config.param_count import count_params
from k3train.config.schema import ModelConfig
from k3train.convert.__main__ import main as cli
from k3train.convert.convert import export_hf, import_hf, listing_of_config
from k3train.convert.dist_checkpoint import DistCheckpoint
from k3train.convert.hf_reference import reference_logits

BF16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8


def spec_listing(c: ModelConfig, experts: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """K3_SPEC §4's tensor table written out for a config, row by row."""
    d, P, h, H = c.hidden_size, c.kda_num_heads * c.kda_head_dim, c.kda_head_dim, c.kda_num_heads
    qk, nv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim + c.v_head_dim
    out = {"language_model.model.embed_tokens.weight": ((c.vocab_size, d), BF16),
           "language_model.lm_head.weight": ((c.vocab_size, d), BF16),
           "language_model.model.norm.weight": ((d,), BF16),
           "language_model.model.output_attn_res_norm.weight": ((d,), BF16),
           "language_model.model.output_attn_res_proj.weight": ((1, d), BF16)}
    for n in range(c.num_layers):
        p = f"language_model.model.layers.{n}."
        for w in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            out[p + w + ".weight"] = ((d,), BF16)
        for w in ("self_attention_res_proj", "mlp_res_proj"):
            out[p + w + ".weight"] = ((1, d), BF16)
        a = p + "self_attn."
        if (n + 1) in c.full_attn_layers:
            out.update({a + "q_a_proj.weight": ((c.q_lora_rank, d), BF16),
                        a + "q_a_layernorm.weight": ((c.q_lora_rank,), BF16),
                        a + "q_b_proj.weight": ((c.mla_num_heads * qk, c.q_lora_rank), BF16),
                        a + "kv_a_proj_with_mqa.weight": ((c.kv_lora_rank + c.qk_rope_head_dim, d), BF16),
                        a + "kv_a_layernorm.weight": ((c.kv_lora_rank,), BF16),
                        a + "kv_b_proj.weight": ((c.mla_num_heads * nv, c.kv_lora_rank), BF16),
                        a + "g_proj.weight": ((c.mla_num_heads * c.v_head_dim, d), BF16),
                        a + "o_proj.weight": ((d, c.mla_num_heads * c.v_head_dim), BF16)})
        else:
            for w in ("q_proj", "k_proj", "v_proj", "g_proj"):
                out[a + w + ".weight"] = ((P, d), BF16)
            for w in ("q", "k", "v"):
                out[a + w + "_conv1d.weight"] = ((P, 1, c.kda_conv_size), F32)
            out.update({a + "f_a_proj.weight": ((h, d), BF16), a + "f_b_proj.weight": ((P, h), BF16),
                        a + "b_proj.weight": ((H, d), BF16), a + "A_log": ((128 * -(-H // 128),), F32),
                        a + "dt_bias": ((P,), F32), a + "o_norm.weight": ((h,), F32),
                        a + "o_proj.weight": ((d, P), BF16)})
        if n < c.first_k_dense:
            m = p + "mlp."
            out.update({m + "gate_proj.weight": ((c.dense_intermediate_size, d), BF16),
                        m + "up_proj.weight": ((c.dense_intermediate_size, d), BF16),
                        m + "down_proj.weight": ((d, c.dense_intermediate_size), BF16)})
            continue
        m, ell, I, S = p + "block_sparse_moe.", c.latent_size, c.moe_intermediate_size, c.num_shared_experts
        out.update({m + "gate.weight": ((c.num_experts, d), BF16), m + "gate.e_score_correction_bias":
                    ((c.num_experts,), F32), m + "routed_expert_down_proj.weight": ((ell, d), BF16),
                    m + "routed_expert_up_proj.weight": ((d, ell), BF16), m + "routed_expert_norm.weight": ((ell,), BF16),
                    m + "shared_experts.gate_proj.weight": ((S * I, d), BF16),
                    m + "shared_experts.up_proj.weight": ((S * I, d), BF16),
                    m + "shared_experts.down_proj.weight": ((d, S * I), BF16)})
        for e in range(c.num_experts):
            for w, rows, cols in (("w1", I, ell), ("w3", I, ell), ("w2", ell, I)):
                base = f"{m}experts.{e}.{w}."
                if experts == "bf16":
                    out[base + "weight"] = ((rows, cols), BF16)
                else:
                    out[base + "weight_packed"] = ((rows, cols // 2), U8)
                    out[base + "weight_scale"] = ((rows, cols // 32), U8)
    return out


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_tiny_listing_matches_spec_table(experts):
    cfg = ModelConfig()
    got = {s.name: (s.shape, s.dtype) for s in listing_of_config(cfg, experts)}
    want = spec_listing(cfg, experts)
    assert sorted(set(got) ^ set(want)) == []
    assert {n: got[n] for n in want} == want


def test_full_k3_listing_counts():
    """On the meta device: every tensor of the full checkpoint; the element total is K3_SPEC's
    2,779,484,476,000 plus the 2,208 A_log padding entries."""
    cfg = load_config(["model=k3"]).model
    specs = listing_of_config(cfg, "bf16")
    assert len(specs) == len({s.name for s in specs}) == 249_756
    assert sum(s.numel for s in specs) == count_params(cfg).total + 69 * 32 == 2_779_484_478_208
    assert sum(s.nbytes for s in specs) == 5_558_991_201_280
    names = {s.name: s for s in specs}
    assert names["language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight"].shape == (3584, 3072)
    assert names["language_model.model.layers.1.self_attn.A_log"].shape == (128,)
    assert names["language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """For each expert format: a random k3_tiny, our checkpoint of it, its export, the export's import
    and the re-export of that import."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, experts in enumerate(("bf16", "mxfp4")):
        model = random_tiny(10 + i, mxfp4_experts=experts == "mxfp4")
        ckpt = save_model(model, root / f"ours_{experts}")
        export_hf(ckpt, root / f"hf_{experts}", experts, progress=False)
        import_hf(root / f"hf_{experts}", root / f"back_{experts}", progress=False)
        export_hf(root / f"back_{experts}", root / f"hf2_{experts}", experts, progress=False)
        out[experts] = dict(model=model, ckpt=ckpt, hf=root / f"hf_{experts}", back=root / f"back_{experts}",
                            hf2=root / f"hf2_{experts}", root=root)
    return out


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_round_trip_is_bit_exact_and_deterministic(exports, experts):
    e = exports[experts]
    a, b = DistCheckpoint(e["ckpt"]), DistCheckpoint(e["back"])
    assert set(a.stored) == set(b.stored) and len(a.stored) == 250
    sd = e["model"].state_dict()
    for name, t in sd.items():
        back = b.read(name, tuple(t.shape))
        assert back.dtype == torch.float32 and torch.equal(back, t), name
    assert _files(e["hf"]) == _files(e["hf2"])  # import → export: byte-identical files
    export_hf(e["ckpt"], e["root"] / f"again_{experts}", experts, progress=False)
    assert _files(e["hf"]) == _files(e["root"] / f"again_{experts}")


def test_export_holds_spec_values(exports):
    """A_log padded with zeros; layer 0's unused AttnRes weights present; config.json fields."""
    e = exports["mxfp4"]
    t = load_file(str(e["hf"] / "model-00001-of-00001.safetensors"))
    sd = e["model"].state_dict()
    a_log = t["language_model.model.layers.1.self_attn.A_log"]
    assert torch.equal(a_log[:2], sd["layers.1.self_attn.A_log"]) and not a_log[2:].any()
    assert torch.equal(t["language_model.model.layers.0.self_attention_res_proj.weight"].float(),
                       sd["layers.0.self_attention_res.proj"])
    assert torch.equal(t["language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight"].float(),
                       sd["layers.3.self_attn.kv_a_proj.weight"])
    cfg = json.loads((e["hf"] / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["model_type"] == "kimi_linear"
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((e["hf"] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(t) and index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in t.values())


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_reference_forward_matches_model(exports, experts):
    """The independent forward on the exported files against our model, fp32, packed documents."""
    e = exports[experts]
    tensors = load_file(str(e["hf"] / "model-00001-of-00001.safetensors"))
    text = json.loads((e["hf"] / "config.json").read_text())["text_config"]
    for seed in range(3):
        tokens, pos = packed_batch(seed)
        with torch.no_grad():
            ours = e["model"](tokens, pos)
        ref = reference_logits(tensors, text, tokens, pos)
        rel = float((ours - ref).norm() / ref.norm())
        assert rel <= 1e-5, (seed, rel)
    # the check can fail: a wrong A_log changes the logits, and so do the experts' gate and up swapped
    bad = dict(tensors)
    bad["language_model.model.layers.1.self_attn.A_log"] = tensors["language_model.model.layers.1.self_attn.A_log"] + 1
    assert float((reference_logits(bad, text, tokens, pos) - ref).norm() / ref.norm()) > 1e-3
    swap = {".w1.": ".w3.", ".w3.": ".w1."}
    bad = {next((n.replace(a, b) for a, b in swap.items() if a in n), n): t for n, t in tensors.items()}
    assert float((reference_logits(bad, text, tokens, pos) - ref).norm() / ref.norm()) > 1e-3


def test_shards_and_passthrough(exports, tmp_path):
    """Several shards with an index; vision_tower/mm_projector tensors pass through unchanged."""
    e = exports["bf16"]
    export_hf(e["ckpt"], tmp_path / "sharded", "bf16", shard_bytes=200_000, progress=False)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    merged = {k: v for s in shards for k, v in load_file(str(tmp_path / "sharded" / s)).items()}
    assert merged.keys() == load_file(str(e["hf"] / "model-00001-of-00001.safetensors")).keys()
    g = torch.Generator().manual_seed(3)
    extra = {"vision_tower.blocks.0.weight": torch.randn(5, 7, generator=g).bfloat16(),
             "mm_projector.proj.weight": torch.randn(3, generator=g)}
    from safetensors.torch import save_file
    save_file(extra, str(tmp_path / "sharded" / "vision.safetensors"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "vision.safetensors" for k in extra})
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    import_hf(tmp_path / "sharded", tmp_path / "ours", progress=False)
    export_hf(tmp_path / "ours", tmp_path / "again", "bf16", progress=False)
    again = {k: v for p in (tmp_path / "again").glob("*.safetensors") for k, v in load_file(str(p)).items()}
    for k, v in {**merged, **extra}.items():
        assert again[k].dtype == v.dtype and torch.equal(again[k], v), k


def _corrupt(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    shard = dst / "model-00001-of-00001.safetensors"
    cfg = json.loads((dst / "config.json").read_text())
    if how == "missing_shard":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "model_type":
        cfg["model_type"] = "deepseek_v3"
    elif how == "config_mismatch":
        cfg["text_config"]["num_experts"] = 16
    elif how in ("padding", "shape"):
        t = load_file(str(shard))
        name = "language_model.model.layers.1.self_attn.A_log"
        if how == "padding":
            t[name][5] = 1.0
        else:
            t[name] = t[name][:64].clone()
        from safetensors.torch import save_file
        save_file(t, str(shard))
    elif how == "dtype":
        t = load_file(str(shard))
        t["language_model.model.norm.weight"] = t["language_model.model.norm.weight"].float()
        from safetensors.torch import save_file
        save_file(t, str(shard))
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("how,needles", [
    ("missing_shard", ["model-00001-of-00001.safetensors", "missing"]),
    ("truncated", ["truncated", "download it again"]),
    ("model_type", ["config.json", "deepseek_v3", "kimi_k3"]),
    ("config_mismatch", ["gate.weight", "[16, 64]", "does not match config.json"]),
    ("padding", ["A_log", "not zero"]),
    ("shape", ["A_log", "[64]", "[128]"]),
    ("dtype", ["norm.weight", "float32", "bfloat16"]),
])
def test_bad_input_is_one_line_error(exports, tmp_path, capsys, how, needles):
    _corrupt(exports["bf16"]["hf"], tmp_path / "bad", how)
    with pytest.raises(SystemExit) as err:
        cli(["from-hf", "--hf", str(tmp_path / "bad"), "--out", str(tmp_path / "out"), "--quiet"])
    msg = str(err.value.code)
    assert msg.startswith("k3train-convert: error:") and "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))  # nothing half-written


def test_cli_inspect_both_formats(exports, capsys):
    e = exports["mxfp4"]
    cli(["inspect", str(e["hf"]), "--summary"])
    hf_out = capsys.readouterr().out
    cli(["inspect", str(e["ckpt"]), "--summary"])
    ours_out = capsys.readouterr().out
    assert "hf " in hf_out and "618 tensors" in hf_out and "uint8: 384 tensors" in hf_out
    assert "k3train " in ours_out and "250 tensors, 622,428 elements" in ours_out


def _save_tp2_training_checkpoint(rank: int, world: int, run_dir: str) -> None:
    from k3train.config.schema import OptimConfig, ParallelConfig
    from k3train.model.k3 import K3Model
    from k3train.optim.builder import build_optimizer, build_scheduler
    from k3train.parallel.state import init_parallel
    from k3train.training.checkpoint import save_checkpoint

    groups = init_parallel(ParallelConfig(tensor=2), torch.device("cpu"))
    torch.manual_seed(5)
    model = K3Model(ModelConfig(), groups)
    opt = build_optimizer(model, OptimConfig(), groups)
    save_checkpoint(Path(run_dir), 7, model, opt, build_scheduler(opt, OptimConfig(), 10), {}, groups, ModelConfig())


def test_tp2_training_checkpoint_exports_like_one_rank(tmp_path):
    """A checkpoint written by training's save at TP=2 (with optimizer state) exports to the same
    bytes as the same model (same seed: the same weights at any TP size) written at one rank."""
    from multiprocess import run_ranks
    from k3train.model.k3 import K3Model

    run_ranks(2, _save_tp2_training_checkpoint, str(tmp_path / "run"))
    torch.manual_seed(5)
    save_model(K3Model(ModelConfig(), linear_backend="torch"), tmp_path / "one")
    export_hf(tmp_path / "run", tmp_path / "hf_tp2", "mxfp4", progress=False)
    export_hf(tmp_path / "one", tmp_path / "hf_one", "mxfp4", progress=False)
    assert _files(tmp_path / "hf_tp2") == _files(tmp_path / "hf_one")
