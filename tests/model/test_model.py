"""K3 model components against plain references (K3_SPEC.md §2), on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3train.config.schema import ModelConfig
from kernels.attn_res import attn_res_aggregate
from k3train.model.documents import Documents, bucketed_length
from k3train.model.k3 import K3Model
from k3train.model.kda import causal_conv_with_resets
from k3train.model.mlp import situ_glu
from k3train.model.moe import RoutedExperts
from k3train.model.roles import deinterleave_rows, get_role, interleave_rows
from k3train.model.router import SigmoidRouter
from k3train.parallel.tensor_parallel import TPSpec
from k3train.parallel.token_dispatcher import LocalTokenDispatcher


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = K3Model(ModelConfig())
    # Non-zero pseudo-queries, so the AttnRes softmax is not uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res.proj"):
                p.normal_(0, 0.5)
    return model.eval()


def test_causal_conv_resets_at_document_starts():
    torch.manual_seed(1)
    lengths = [5, 9, 2, 16]
    x = torch.randn(1, sum(lengths), 6)
    w = torch.randn(6, 1, 4)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    got = causal_conv_with_resets(x, w, pos)
    start = 0
    for n in lengths:
        seg = x[:, start:start + n].transpose(1, 2)  # [1, C, n]
        want = F.conv1d(F.pad(seg, (3, 0)), w, groups=6).transpose(1, 2)
        torch.testing.assert_close(got[:, start:start + n], want, rtol=1e-6, atol=1e-6)
        start += n


def test_documents_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    docs = Documents.from_position_ids(pos)
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 7, 10]
    assert docs.doc_ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]
    assert not docs.one_per_row
    padded = Documents.from_position_ids(pos, bucket=True)  # compiled layers: empty documents up to 16 offsets
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 7] + [10] * 12 and not padded.one_per_row
    assert torch.equal(padded.doc_ids, docs.doc_ids)
    assert [bucketed_length(n) for n in (2, 16, 17, 33)] == [16, 16, 32, 64]
    whole_rows = torch.arange(5).expand(2, 5)  # compiled layers take one document a row as packed too
    assert Documents.from_position_ids(whole_rows).one_per_row
    assert not Documents.from_position_ids(whole_rows, bucket=True).one_per_row
    moved = padded.to(torch.device("cpu"))  # the trainer's path: counted on the host, then moved
    for name in ("position_ids", "doc_ids", "cu_seqlens"):
        assert torch.equal(getattr(moved, name), getattr(padded, name)), name


def test_single_documents_equal_from_position_ids_without_reading_back(monkeypatch):
    """One document per row (no position_ids): built from shapes, the same tensors as from explicit
    positions, with no device value read back; the model's output is the same either way."""
    want = Documents.from_position_ids(torch.arange(6).expand(3, 6))
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: pytest.fail("read back the document count"))
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda *a, **k: pytest.fail("read back the document count"))
    got = Documents.single(3, 6)
    for name in ("position_ids", "doc_ids", "cu_seqlens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    assert got.one_per_row and want.one_per_row
    monkeypatch.undo()
    torch.manual_seed(0)
    model = K3Model(ModelConfig())
    tokens = torch.randint(0, 512, (2, 10))
    assert torch.equal(model(tokens), model(tokens, torch.arange(10).expand(2, 10)))


def test_packed_documents_do_not_interact(tiny):
    """Document B packed after A in one row gives the same logits as B alone: KDA state, conv and MLA mask reset."""
    torch.manual_seed(2)
    a, b = torch.randint(0, 512, (1, 19)), torch.randint(0, 512, (1, 29))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(19), torch.arange(29)]).unsqueeze(0)
    with torch.no_grad():
        got = tiny(packed, pos)[:, 19:]
        want = tiny(b)
        other = tiny(packed)[:, 19:]  # same tokens seen as one document: must differ
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (other - want).abs().max() > 1e-3


def test_attn_res_aggregate_matches_formula():
    torch.manual_seed(3)
    srcs = [torch.randn(2, 3, 8) for _ in range(4)]
    w, gamma = torch.randn(1, 8), torch.rand(8) + 0.5
    got = attn_res_aggregate(srcs, w, gamma)
    logits = torch.stack([((w[0] * gamma) * v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5)).sum(-1)
                          for v in srcs])
    a = torch.softmax(logits, 0)
    want = sum(a[i].unsqueeze(-1) * srcs[i] for i in range(4))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    uniform = attn_res_aggregate(srcs, torch.zeros(1, 8), gamma)
    torch.testing.assert_close(uniform, sum(srcs) / 4, rtol=1e-6, atol=1e-6)


def test_block_attn_res_schedule_matches_eager_reference(tiny):
    """Re-run §2.1 step by step with the model's own sub-modules and compare the logits."""
    cfg = tiny.cfg
    torch.manual_seed(4)
    tokens = torch.randint(0, 512, (2, 24))
    docs = Documents.single(2, 24)
    with torch.no_grad():
        e = tiny.embed_tokens(tokens)
        P, B = e, []
        for l, layer in enumerate(tiny.layers):
            x_a = layer.input_layernorm(attn_res_aggregate(B + [P], layer.self_attention_res.proj,
                                                           layer.self_attention_res.norm))
            if l % cfg.attn_res_block_size == 0:
                B.append(P)
                P = torch.zeros_like(P)
            P = P + layer.self_attn(x_a, docs)
            x_m = layer.post_attention_layernorm(attn_res_aggregate(B + [P], layer.mlp_res.proj, layer.mlp_res.norm))
            P = P + layer.mlp(x_m)
        assert len(B) + 1 == 4  # K3_SPEC.md §5: tiny has 4 output sources
        h = tiny.norm(attn_res_aggregate(B + [P], tiny.output_attn_res.proj, tiny.output_attn_res.norm))
        want = tiny.lm_head(h)
        got = tiny(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_attn_res_state_stays_fp32_under_bf16_autocast(tiny):
    """K3_SPEC §2.1: under bf16 autocast the block rows, the partial sum and every aggregation's
    sources are fp32 (the GEMMs run in bf16), and the loss stays close to the model's fp32 loss. A
    site's output is its RMSNorm's: bf16 where only GEMMs read it, fp32 where the MoE router does."""
    torch.manual_seed(5)
    tokens, labels = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    states, mixes = [], []
    hooks = [layer.register_forward_hook(lambda m, args, out: states.append(out)) for layer in tiny.layers]
    hooks += [m.register_forward_hook(lambda m, args, out: mixes.append((args[0], args[1], out)))
              for m in tiny.modules() if type(m).__name__ == "AttnResAggregator"]
    with torch.no_grad():
        want = tiny(tokens, labels=labels)
        del states[:], mixes[:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = tiny(tokens)
            got = tiny(tokens, labels=labels)
    for h in hooks:
        h.remove()
    assert logits.dtype == torch.bfloat16  # autocast is on: the linears ran in bf16
    assert states and mixes
    for bank, partial, _ in states:  # (and the pending FFN output: a branch's output, bf16 from its GEMM)
        assert partial.dtype == torch.float32 and all(row.dtype == torch.float32 for row in bank)
    routed = 0
    for sources, norm, (mix, _) in mixes:  # every read of the bank and the partial sum, and its result
        assert all(v.dtype == torch.float32 for v in sources)
        assert mix.dtype == (torch.bfloat16 if norm.autocast_output else torch.float32)
        routed += not norm.autocast_output
    assert routed == 2 * sum(type(m).__name__ == "LatentMoE" for m in tiny.modules())  # two forwards
    assert abs(float(got) - float(want)) < 1e-2 * float(want), (float(got), float(want))


def test_layer_zero_attention_side_attn_res_is_unused(tiny):
    tokens = torch.randint(0, 512, (1, 16))
    tiny.zero_grad()
    tiny(tokens, labels=tokens).backward()
    assert tiny.layers[0].self_attention_res.proj.grad.abs().max() == 0
    assert tiny.layers[1].self_attention_res.proj.grad.abs().max() > 0
    tiny.zero_grad()


def test_situ_glu_bounds_and_first_order():
    a, c = torch.randn(1000) * 1e3, torch.randn(1000) * 1e3
    assert situ_glu(a, c).abs().max() <= 100.0
    a, c = torch.randn(1000) * 1e-3, torch.randn(1000) * 1e-3
    swiglu = F.silu(a) * c
    torch.testing.assert_close(situ_glu(a, c), swiglu, rtol=1e-3, atol=1e-9)


def test_router_bias_changes_selection_only():
    torch.manual_seed(5)
    router = SigmoidRouter(16, 8, 2, 1.0, 0.5)
    x = torch.randn(32, 16)
    r0 = router(x)
    s = torch.sigmoid(x @ router.weight.t())
    torch.testing.assert_close(r0.scores, s)
    torch.testing.assert_close(r0.weights.sum(-1), torch.ones(32))
    torch.testing.assert_close(r0.weights, s.gather(1, r0.experts) / s.gather(1, r0.experts).sum(-1, keepdim=True))
    router.e_score_correction_bias[3] = 10.0  # expert 3 now always selected, its weight still from s
    r1 = router(x)
    assert (r1.experts == 3).any(-1).all()
    chosen = s.gather(1, r1.experts)
    torch.testing.assert_close(r1.weights, chosen / chosen.sum(-1, keepdim=True))
    assert "e_score_correction_bias" not in dict(router.named_parameters())


def _routed(experts: RoutedExperts, z, idx, w):
    disp = LocalTokenDispatcher(experts.num_experts)
    grouped, tokens_per_expert, handle = disp.dispatch(z, idx, experts.row_tile)
    return disp.combine(experts(grouped, tokens_per_expert), w, handle)


def test_routed_experts_match_per_token_loop():
    torch.manual_seed(6)
    cfg = ModelConfig()
    experts = RoutedExperts(cfg, TPSpec(None, 0.2))
    z = torch.randn(40, cfg.latent_size)
    idx = torch.stack([torch.randperm(cfg.num_experts - 1)[:2] for _ in range(40)])  # the last expert gets none
    idx[:5] = torch.tensor([0, 1])  # and a skew
    w = torch.rand(40, 2)
    want = torch.zeros_like(z)
    for t in range(40):
        for j in range(2):
            e = idx[t, j]
            gate_up = experts.w13[e] @ z[t]  # rows of w13: gate_0, up_0, gate_1, up_1, ...
            want[t] += w[t, j] * (experts.w2[e] @ situ_glu(gate_up[0::2], gate_up[1::2]))
    torch.testing.assert_close(experts.forward_looped(z, idx, w), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_routed(experts, z, idx, w), want, rtol=1e-5, atol=1e-6)


def test_w13_interleaves_the_gate_and_up_stacks_drawn_first():
    """w13 [E, 2I, ℓ] holds gate_j (HF's w1 row j) in row 2j and up_j (w3 row j) in row 2j + 1, from the full
    stacks [E, 2, I, ℓ] drawn first (the same draws as the blocked [gate; up] layout had); its role says so."""
    cfg = ModelConfig()
    E, I, ell = cfg.num_experts, cfg.moe_intermediate_size, cfg.latent_size
    torch.manual_seed(3)
    experts = RoutedExperts(cfg, TPSpec(None, 0.2))
    torch.manual_seed(3)
    stacks = torch.empty(E, 2, I, ell).normal_(0.0, cfg.init_std)
    assert experts.w13.shape == (E, 2 * I, ell) and experts.w13.is_contiguous()
    assert torch.equal(experts.w13[:, 0::2], stacks[:, 0]) and torch.equal(experts.w13[:, 1::2], stacks[:, 1])
    assert torch.equal(deinterleave_rows(experts.w13, 2), stacks)
    assert get_role(experts.w13).row_interleave == 2 and get_role(experts.w2).row_interleave == 1
    parts = torch.randn(3, 4, 5, 6)  # s = 4 matrices of 5 rows
    mixed = interleave_rows(parts)
    assert mixed.shape == (3, 20, 6) and torch.equal(mixed[:, 4 * 2 + 3], parts[:, 3, 2])
    assert torch.equal(deinterleave_rows(mixed, 4), parts)


def test_grouped_experts_gradients_match_loop():
    """Grouped GEMMs + index permutations: the same gradients as the per-expert loop (fp32)."""
    torch.manual_seed(7)
    cfg = ModelConfig()
    experts = RoutedExperts(cfg, TPSpec(None, 0.2))
    z = torch.randn(64, cfg.latent_size, requires_grad=True)
    idx = torch.rand(64, cfg.num_experts).topk(2, dim=-1).indices
    w = torch.rand(64, 2, requires_grad=True)
    g = torch.randn(64, cfg.latent_size)
    grads = []
    for fn in (lambda: experts.forward_looped(z, idx, w), lambda: _routed(experts, z, idx, w)):
        grads.append(torch.autograd.grad(fn(), (z, w, experts.w13, experts.w2), g))
    for loop, grouped in zip(*grads):
        assert loop.abs().max() > 0
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_expert_tiled_layout_matches_packed_rows():
    """grouped_gemm "tiles:1" (rows padded per expert to 64; on CPU the kernel's tile-by-tile reference): the
    dispatcher's padded rows are zero where no token copy sits, every expert's count is padded to the tile,
    and outputs and gradients equal the packed layout's (fp32)."""
    torch.manual_seed(8)
    cfg = ModelConfig()
    experts = RoutedExperts(cfg, TPSpec(None, 0.2))
    z = torch.randn(50, cfg.latent_size, requires_grad=True)
    idx = torch.rand(50, cfg.num_experts).topk(2, dim=-1).indices
    idx[:20, 0] = 0  # an uneven split: expert 0 takes 20+ rows, most others a few
    w = torch.rand(50, 2, requires_grad=True)
    g = torch.randn(50, cfg.latent_size)
    grads = []
    for gemm in ("torch", "tiles:1", "fused:1"):  # fused:1 on CPU: the same reference products, SiTU its own pass
        experts.grouped_gemm = gemm
        grads.append(torch.autograd.grad(_routed(experts, z, idx, w), (z, w, experts.w13, experts.w2), g))
    assert experts.row_tile == 64
    rows, counts, handle = LocalTokenDispatcher(cfg.num_experts).dispatch(z, idx, 64)
    assert rows.shape[0] % 64 == 0 and rows.shape[0] >= 100 and bool((counts % 64 == 0).all())
    assert not rows[handle.pad_rows].any() and handle.pad_rows.numel() == rows.shape[0] - 100
    assert torch.equal(handle.tokens_per_expert, torch.bincount(idx.flatten(), minlength=cfg.num_experts))
    for packed, *padded in zip(*grads):
        assert packed.abs().max() > 0
        for got in padded:
            torch.testing.assert_close(got, packed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gemm", ["torch", "tiles:1", "fused:1"])
def test_gate_weights_folded_into_situ_match_the_weighted_combine(gemm, monkeypatch):
    """experts_and_combine (the layer's path: gate weights applied per row in SiTU's pass, unweighted combine)
    against the experts then the weighted combine: same outputs and gradients (fp32), packed and padded rows. The
    layer takes the rows' layout from the dispatcher's routing plan (no ``group_offsets`` of its own)."""
    import k3train.model.moe as moe
    from k3train.model.moe import experts_and_combine

    torch.manual_seed(9)
    cfg = ModelConfig()
    experts = RoutedExperts(cfg, TPSpec(None, 0.2))
    experts.grouped_gemm = gemm
    z = torch.randn(37, cfg.latent_size, requires_grad=True)
    idx = torch.rand(37, cfg.num_experts).topk(2, dim=-1).indices
    w = torch.rand(37, 2, requires_grad=True)
    g = torch.randn(37, cfg.latent_size)
    disp = LocalTokenDispatcher(cfg.num_experts)

    def folded():
        grouped, tokens_per_expert, handle = disp.dispatch(z, idx, experts.row_tile, w)
        return experts_and_combine(disp, experts, grouped, tokens_per_expert, w, handle)

    params = (z, w, experts.w13, experts.w2)
    want = torch.autograd.grad(_routed(experts, z, idx, w), params, g)

    def no_second_layout(*args):
        raise AssertionError("the layer computed the layout the routing plan gave it")
    monkeypatch.setattr(moe, "group_offsets", no_second_layout)
    got = torch.autograd.grad(folded(), params, g)
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_meta_device_full_k3_matches_spec_counts():
    from k3train.config.load import load_config

    cfg = load_config(["model=k3"]).model
    with torch.device("meta"):
        model = K3Model(cfg)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.gate.e_score_correction_bias.numel() for m in model.moe_layers())
    assert total == 2_779_484_476_000
    routed = sum(m.experts.w13.numel() + m.experts.w2.numel() for m in model.moe_layers())
    active = total - model.embed_tokens.weight.numel() - routed * (1 - cfg.num_experts_per_token / cfg.num_experts)
    assert math.isclose(active, 104_189_612_640, rel_tol=0, abs_tol=0.5)
