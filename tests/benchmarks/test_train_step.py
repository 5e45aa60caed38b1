"""benchmarks/train_step.py on CPU: the KDA mixer's kernel seam, the fla adapter's argument mapping (with a
CPU stand-in for fla's chunk_kda), the benchmark end to end with Muon and AdamW (k3_tiny, one step), and
data parallel over two gloo ranks as under torchrun."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from k3train.model import document_attention
from k3train.model.k3 import K3Model
from k3train.model.kda import KimiDeltaAttention
from kernels.kda import kda, kda_chunked

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import train_step  # noqa: E402
from multiprocess import run_ranks  # noqa: E402


def fake_chunk_kda(calls):
    """fla's chunk_kda keywords over our chunked torch reference; records what each call was given."""

    def chunk_kda(q, k, v, g, beta, *, A_log, dt_bias, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                  use_beta_sigmoid_in_kernel, safe_gate, lower_bound, cu_seqlens):
        assert use_gate_in_kernel and use_beta_sigmoid_in_kernel and safe_gate
        calls.append({"lower_bound": lower_bound, "cu_seqlens": cu_seqlens.tolist(), "shape": tuple(q.shape)})
        return kda_chunked(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                           use_qk_l2norm=use_qk_l2norm_in_kernel)

    return chunk_kda


def _tiny_loss(kernel=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = K3Model(train_step.model_config("k3_tiny"))
    if kernel is not None:
        assert train_step.swap_kda_kernel(model, kernel) == 6  # k3_tiny: 6 of its 9 layers are KDA
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1)  # two documents a row: cu_seqlens matters
    loss = model(tokens[:, :-1], position_ids=pos, labels=tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]


def test_swapped_kernel_gives_the_default_output_and_gradients():
    calls = []
    ref_loss, ref_grads = _tiny_loss()
    loss, grads = _tiny_loss(train_step.fla_kernel(fake_chunk_kda(calls)))
    assert len(calls) == 6
    assert all(c["lower_bound"] == -5.0 and c["cu_seqlens"] == [0, 12, 32, 44, 64] and c["shape"] == (1, 64, 2, 32)
               for c in calls), calls[0]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert KimiDeltaAttention.kernel is kda  # the class default is untouched by a swap on instances


def test_fla_adapter_refuses_what_it_cannot_pass():
    q = torch.randn(1, 16, 2, 32)
    args = (q, q, q, q, q[..., 0], torch.zeros(2), torch.zeros(64))
    adapter = train_step.fla_kernel(fake_chunk_kda([]))
    o, state = adapter(*args, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32))
    assert o.shape == q.shape and state is None
    for bad in ({"scale": 0.5}, {"initial_state": torch.zeros(1, 2, 32, 32)}, {"output_final_state": True},
                {"use_qk_l2norm": False}):
        with pytest.raises(ValueError, match=f"does not pass {next(iter(bad))}"):
            adapter(*args, **bad)


@pytest.mark.parametrize("optim, packed, data", (("muon", False, "random"), ("adamw", True, "random"),
                                                 ("muon", False, "corpus-packed")))
def test_benchmark_runs_on_cpu_and_writes_a_row_per_variant(optim, packed, data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ts.json"
    updates = []  # Quantile Balancing's updates: the windows left, None after the optimizer step
    update = train_step.moe_module.update_router_biases
    monkeypatch.setattr(train_step.moe_module, "update_router_biases",
                        lambda layers, group=None, windows_left=None: updates.append(windows_left) or
                        update(layers, group, windows_left))
    train_step.main(["--model", "k3_tiny", "--batch", "1", "--seq", "32", "--steps", "1", "--warmup", "1",
                     "--kda", "ours", "--optim", optim, "--json", str(out), "--accum", "2" if packed else "1",
                     "--data", data] + (["--mean-doc", "8", "--document-attention", "flex"] if packed else []))
    res = json.loads(out.read_text())
    assert res["ours_over_fla"] is None
    (row,) = res["rows"]
    assert row["kda"] == "ours" and row["optim"] == optim and row["gpu"] == "cpu" and row["mfu_datasheet"] is None
    assert row["data"] == data
    assert row["mean_doc"] == (8 if packed else None) and row["accum"] == (2 if packed else 1)
    assert row["document_attention"] == ("flex" if packed else "flash")  # both: SDPA's mask on CPU
    assert document_attention.DOCUMENT_ATTENTION == "flash"  # the model's default, restored
    assert row["step_ms"] > 0 and set(row["phase_ms"]) == {"forward", "backward", "comm", "optimizer", "qb"}
    assert torch.isfinite(torch.tensor([row["first_loss"], row["loss"]])).all()
    loads = row["expert_load_max_over_mean"]  # one per timed step, the worst MoE layer's
    assert len(loads) == 1 and all(1.0 <= v <= 8 / 2 for v in loads), loads  # k3_tiny: at most E / k = 8 / 2
    assert f" ours {optim:>5} " in capsys.readouterr().out
    # as the trainer by default: with 2 micro-batches a step also one update between them
    assert updates and updates == ([1, None] if packed else [None]) * (len(updates) // (2 if packed else 1))


def test_corpus_micro_batches_are_fresh_rows_of_the_trainer_corpus():
    """--data corpus(-packed): (warmup + steps) · accum distinct micro-batches of the default corpus, labels
    the next tokens; packed ones keep the corpus's position ids (each the last + 1, or 0 at a document start;
    the corpus's files are long, so a short row rarely holds a start)."""
    cfg = train_step.model_config("k3_tiny")
    args = argparse.Namespace(data="corpus-packed", batch=2, seq=64, warmup=1, steps=1, accum=2, mean_doc=None)
    batches = train_step.micro_batches(args, cfg, torch.device("cpu"), None)
    assert len(batches) == 4
    for i, (x, y, pos) in enumerate(batches):
        assert x.shape == y.shape == pos.shape == (2, 64) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1]) and 0 <= int(x.min()) and int(x.max()) < 512  # the corpus's BPE
        assert all(not torch.equal(x, other) for other, _, _ in batches[i + 1:])
        assert bool(((pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)).all())
    args.data = "corpus"
    rows = train_step.micro_batches(args, cfg, torch.device("cpu"), None)
    assert all(pos is None and torch.equal(x, b[0]) for (x, _, pos), b in zip(rows, batches))
    with pytest.raises(SystemExit):  # argparse: --mean-doc packs random rows only
        train_step.main(["--model", "k3_tiny", "--data", "corpus", "--mean-doc", "8"])


def test_ablations_time_the_pieces_swapped_out_with_the_same_math_on_cpu(tmp_path, monkeypatch):
    """--ablate: a row per ablation after ours, and their step-time ratios. Each swaps its piece (the site
    gets no residual; dW goes to the torch path) and restores it after; on CPU both pieces are the same
    math as what they replaced, so the losses equal ours bit for bit."""
    import k3train.model.attn_res as attn_res_module
    from k3train.model import moe as moe_module

    residuals = []
    site = attn_res_module.attn_res_site

    def recording_site(*args, residual=None, **kwargs):
        residuals.append(residual is not None)
        return site(*args, residual=residual, **kwargs)

    monkeypatch.setattr(attn_res_module, "attn_res_site", recording_site)
    out = tmp_path / "ts.json"
    args = ["--model", "k3_tiny", "--batch", "1", "--seq", "32", "--steps", "2", "--warmup", "1", "--kda", "ours",
            "--optim", "adamw", "--json", str(out)]
    train_step.main(args)
    with_residual = sum(residuals)
    residuals.clear()
    with train_step.ablated("site-residual"):
        train_step.main(args)
    assert with_residual > 0 and sum(residuals) == 0
    with train_step.ablated("wgrad"):
        assert moe_module.grouped_wgrad.keywords == {"backend": "torch"}
    assert moe_module.grouped_wgrad is train_step.grouped_wgrad  # restored

    train_step.main(args + ["--ablate", "wgrad", "site-residual"])
    res = json.loads(out.read_text())
    assert [(r["kda"], r["ablation"]) for r in res["rows"]] == [("ours", None), ("ours", "wgrad"),
                                                               ("ours", "site-residual")]
    assert set(res["ablated_over_ours"]) == {"wgrad", "site-residual"}
    ours = res["rows"][0]
    for r in res["rows"][1:]:
        assert (r["first_loss"], r["loss"]) == (ours["first_loss"], ours["loss"]), r["ablation"]


def _tiny_training(dtype: torch.dtype):
    """k3_tiny (seed 0) as train_step builds it on ``dtype`` parameters (fp32 main weights; bf16 ones under
    CPU autocast), with Muon and QB, and a function that takes one step on a batch and returns its loss."""
    from k3train.optim.builder import build_optimizer
    from k3train.parallel.grad_buffers import GradBuffers
    from k3train.precision.main_params import MainParams

    torch.manual_seed(0)
    model = K3Model(train_step.model_config("k3_tiny"))
    main = MainParams(model, dtype)
    grads = GradBuffers(model, None)
    opt = build_optimizer(model, train_step.optim_config("muon"), None)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        grads.zero()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        grads.reduce()
        opt.step()
        main.sync_model()
        for layer in model.moe_layers():
            layer.update_bias(None)
            layer.load.reset()
        return loss.detach()

    return model, main, opt, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_start_state_gives_a_fresh_model_the_saved_training_state(dtype):
    """--same-start's StartState: a model trained two steps, saved, loaded into a fresh one built the same
    way: the weights, fp32 main weights, QB's biases and optimizer state equal the saved ones, and a further
    step on the same batch gives both the same loss and weights, bit for bit (CPU)."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 512, (2, 17), generator=g) for _ in range(3)]
    model, _, opt, step = _tiny_training(dtype)
    for tokens in batches[:2]:
        step(tokens)
    saved = train_step.StartState()
    saved.save(model, opt)
    fresh, fresh_main, fresh_opt, fresh_step = _tiny_training(dtype)
    biases = [layer.gate.e_score_correction_bias for layer in model.moe_layers()]
    assert any(bool(b.ne(0).any()) for b in biases)  # QB has moved them: the check below can fail
    saved.load(fresh, fresh_main, fresh_opt)
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(train_step.main_param(p), train_step.main_param(q))
    assert str(opt.state_dict()) == str(fresh_opt.state_dict())
    assert torch.equal(step(batches[2]), fresh_step(batches[2]))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(train_step.main_param(p), train_step.main_param(q))


def test_same_start_times_later_variants_from_the_first_ones_state(tmp_path, capsys):
    """--same-start end to end (CPU, k3_tiny, the corpus): the ablated variant loads ours after its 3 warm-up
    steps and warms up 1 step, on the micro-batch just before the timed one; its first loss is then that of a
    trained model, below the fresh model's. Without --compile-only under --compile, or with more start steps
    than warm-up steps, the command is refused."""
    out = tmp_path / "ts.json"
    base = ["--model", "k3_tiny", "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "3", "--kda", "ours",
            "--optim", "muon", "--data", "corpus", "--json", str(out)]
    train_step.main(base + ["--same-start", "--start-steps", "1", "--ablate", "wgrad"])
    ours, ablated = json.loads(out.read_text())["rows"]
    assert (ours["start"], ours["warmup"], ablated["start"], ablated["warmup"]) == ("own", 3, "shared", 1)
    assert ablated["first_loss"] < ours["first_loss"] - 0.05, (ablated["first_loss"], ours["first_loss"])
    assert "warm-up steps from the first variant's state" in capsys.readouterr().out
    for bad in (["--compile"], ["--start-steps", "4"], ["--start-steps", "0"]):
        with pytest.raises(SystemExit):  # argparse's errors
            train_step.main(base + ["--same-start"] + bad)


def test_max_logit_bound_ablation_tracks_every_heads_exact_max():
    """--ablate max-logit-bound: models built within it track QK-clip's exact max logit for every MLA head
    (no τ for the log-sum-exp bound); outside it they get τ again."""
    from k3train.model.k3 import K3Model
    from k3train.model.mla import GatedMLA

    model = K3Model(train_step.model_config("k3_tiny"))
    mla = [m for m in model.modules() if isinstance(m, GatedMLA)]
    with train_step.ablated("max-logit-bound"):
        train_step.track_max_logits(model, 100.0)
    assert mla and all(m.track_max_logit and m.qk_clip_tau is None for m in mla)
    train_step.track_max_logits(model, 100.0)
    assert all(m.qk_clip_tau == 100.0 for m in mla)


def test_defaults_come_from_the_trainer_config():
    assert train_step.default_optim() == "muon"  # conf/config.yaml
    muon = train_step.optim_config("muon")
    assert muon.name == "muon" and muon.qk_clip_tau == 100.0  # conf/optim/muon.yaml, not OptimConfig's defaults


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla-core is installed here")
def test_kda_fla_without_fla_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_step.main(["--model", "k3_tiny", "--kda", "fla"])
    message = str(exit_.value.code)
    assert message.startswith("train_step: --kda fla needs fla's chunk_kda: fla-core does not import")
    assert "\n" not in message


def test_compile_only_needs_compile():
    with pytest.raises(SystemExit):  # argparse's error
        train_step.main(["--model", "k3_tiny", "--kda", "ours", "--compile-only"])


def test_compile_without_a_gpu_is_a_one_line_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --compile runs")
    with pytest.raises(SystemExit) as exit_:
        train_step.main(["--model", "k3_tiny", "--kda", "ours", "--compile"])
    message = str(exit_.value.code)
    assert message.startswith("train_step: --compile needs a GPU") and "\n" not in message


def _data_parallel_rank(rank: int, world: int, out: str) -> None:
    rows = train_step.main(["--model", "k3_tiny", "--batch", "1", "--seq", "32", "--steps", "2", "--warmup", "1",
                            "--kda", "ours", "--optim", "muon", "--mean-doc", "8", "--json", out])
    assert [r["world_size"] for r in rows] == [2], rows
    # every rank reports the slowest rank's figures
    figures = torch.tensor([rows[0]["step_ms"], *rows[0]["phase_ms"].values()], dtype=torch.float64)
    theirs = figures.clone()
    torch.distributed.broadcast(theirs, src=0)
    assert torch.equal(figures, theirs), (figures, theirs)


def test_benchmark_runs_data_parallel_on_two_ranks(tmp_path):
    """Two ranks (as ``torchrun --nproc-per-node 2``): data parallel over both (bucketed gradient
    all-reduce, Muon's Newton–Schulz split over the ranks, QB over both); rank 0 writes the JSON."""
    out = tmp_path / "ts.json"
    run_ranks(2, _data_parallel_rank, str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["world_size"] == 2 and set(row["phase_ms"]) == set(train_step.PHASES)
    assert row["tokens_per_s"] > 0 and torch.isfinite(torch.tensor([row["first_loss"], row["loss"]])).all()
