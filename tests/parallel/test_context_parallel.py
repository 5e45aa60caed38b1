"""KDA context parallelism (k3train/parallel/context_parallel.py) on 2 and 3 gloo ranks against the
whole rows on one process: the short conv with its halo and the KDA state chain, outputs and every
gradient, on the load-balanced split (rank r holds chunks r and 2C−1−r), with packed documents that
cross chunk boundaries, start inside chunks and at a chunk's first token."""

from __future__ import annotations

import pytest
import torch

from multiprocess import run_ranks

B, T, H, K, V, W = 2, 24, 2, 8, 8, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    pos = []
    for starts in ([0, 5, 12, 17], [0, 8, 9, 16, 20]):  # 12 (C=2, 3) and 8, 16, 20 (C=3) on chunk edges
        row, p = [], 0
        for t in range(T):
            p = 0 if t in starts else p + 1
            row.append(p)
        pos.append(row)
    x = {n: torch.randn(B, T, *s, generator=g) for n, s in
         (("q", (H, K)), ("k", (H, K)), ("v", (H, V)), ("g", (H, K)))}
    x["beta"] = torch.randn(B, T, H, generator=g)
    x["A_log"] = torch.randn(H, generator=g) * 0.3
    x["dt_bias"] = torch.randn(H * K, generator=g) * 0.3
    x["conv_in"] = torch.randn(B, T, 6, generator=g)
    x["conv_w"] = torch.randn(6, 1, W, generator=g)
    return torch.tensor(pos), x


def _reference(pos, x):
    """The whole rows, as the model runs them on one rank."""
    from k3train.model.documents import Documents
    from k3train.model.kda import causal_conv_with_resets
    from kernels.kda import kda

    docs = Documents.from_position_ids(pos)

    def flat(t):
        return t.reshape(1, B * T, *t.shape[2:]).contiguous()

    o, _ = kda(*(flat(x[n]) for n in ("q", "k", "v", "g", "beta")), x["A_log"], x["dt_bias"], lower_bound=-5.0,
               cu_seqlens=docs.cu_seqlens, use_qk_l2norm=True)
    conv = causal_conv_with_resets(x["conv_in"], x["conv_w"], pos)
    return o.view(B, T, H, V), conv


def _check(rank, world):
    import torch.distributed as dist

    from k3train.model.kda import causal_conv_with_resets
    from k3train.parallel.context_parallel import ChunkPieces, causal_conv_context_parallel, kda_context_parallel
    from k3train.parallel.context_shard import ContextShard

    shard = ContextShard(dist.group.WORLD, world, rank)
    pos, x = _inputs()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, conv_ref = _reference(pos, leaves)
    g = torch.Generator().manual_seed(1)
    do, dconv = torch.randn(o_ref.shape, generator=g), torch.randn(conv_ref.shape, generator=g)
    ((o_ref * do).sum() + (conv_ref * dconv).sum()).backward()

    per_token = [n for n, t in x.items() if t.dim() >= 2 and t.shape[1] == T and n != "conv_w"]
    mine = {n: (shard.split(t) if n in per_token else t).clone().requires_grad_() for n, t in x.items()}
    my_pos = shard.split(pos)
    o = kda_context_parallel(*(mine[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")),
                             ChunkPieces.from_position_ids(my_pos), shard, lower_bound=-5.0)
    conv = causal_conv_context_parallel(mine["conv_in"], mine["conv_w"], my_pos, shard, causal_conv_with_resets)
    torch.testing.assert_close(o, shard.split(o_ref.detach()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, shard.split(conv_ref.detach()), rtol=1e-5, atol=1e-6)
    ((o * shard.split(do)).sum() + (conv * shard.split(dconv)).sum()).backward()
    for n, t in mine.items():
        want = leaves[n].grad
        if n in per_token:
            got, want = t.grad, shard.split(want)
        else:  # shared weights: each rank holds its chunks' share
            got = t.grad.clone()
            dist.all_reduce(got, group=shard.group)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} d{n}: {m}")


@pytest.mark.parametrize("ranks", [2, 3])
def test_kda_and_conv_context_parallel_match_whole_rows(ranks):
    run_ranks(ranks, _check)


# --- the whole model -------------------------------------------------------------------------------

SEED, T_MODEL = 7, 48


def _model_batch():
    """Two rows of 48 tokens; at CP=2 the chunks are [0,12) [12,24) [24,36) [36,48). Row 0 packs
    documents starting at 12 (a chunk edge), 20 and 30 (inside chunks, the document at 20 crossing
    into the next chunk); row 1 is one document."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 512, (2, T_MODEL), generator=g)
    labels = torch.randint(0, 512, (2, T_MODEL), generator=g)
    pos = torch.arange(T_MODEL).repeat(2, 1)
    for a, b in ((12, 20), (20, 30), (30, T_MODEL)):
        pos[0, a:b] = torch.arange(b - a)
    mask = (torch.rand(2, T_MODEL, generator=g) > 0.2).float()
    return tokens, pos, labels, mask


def _model_rank(rank: int, world: int, out_path: str) -> None:
    import torch.distributed as dist

    from k3train.config.schema import ModelConfig, ParallelConfig
    from k3train.model.k3 import K3Model
    from k3train.model.mla import GatedMLA
    from k3train.parallel.state import init_parallel

    groups = init_parallel(ParallelConfig(context=world), torch.device("cpu"))
    torch.manual_seed(SEED)
    model = K3Model(ModelConfig(), groups)
    shard = model.context
    assert shard is not None and shard.size == world
    mla = [m for m in model.modules() if isinstance(m, GatedMLA)]
    for m in mla:
        m.track_max_logit = True
    loss = model(*(shard.split(t) for t in _model_batch()[:3]), shard.split(_model_batch()[3]))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # the loop averages over DP×CP
        grads[name] = grad / world
    max_logit = torch.stack([m.max_logit for m in mla])
    dist.all_reduce(max_logit, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"loss": total / world, "grads": grads, "max_logit": max_logit}, out_path)


def test_model_at_cp2_matches_one_rank(tmp_path):
    """k3_tiny at CP=2 (KDA state passing, the conv halo, MLA over the gathered latent, the loss
    over CP) against one rank, fp32: loss, every gradient, and MLA's max logits (QK-clip's input),
    with packed documents that cross chunk edges. Tolerance as test_tensor_parallel.py."""
    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model
    from k3train.model.mla import GatedMLA

    torch.manual_seed(SEED)
    ref = K3Model(ModelConfig())
    mla = [m for m in ref.modules() if isinstance(m, GatedMLA)]
    for m in mla:
        m.track_max_logit = True
    ref_loss = ref(*_model_batch())
    ref_loss.backward()

    out = tmp_path / "cp2.pt"
    run_ranks(2, _model_rank, str(out))
    got = torch.load(out)
    torch.testing.assert_close(got["loss"], ref_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got["max_logit"], torch.stack([m.max_logit for m in mla]), rtol=1e-6, atol=1e-6)
    for name, p in ref.named_parameters():
        err = (got["grads"][name] - p.grad).norm().item()
        assert err <= 1e-5 * p.grad.norm().item() + 1e-8, f"{name}: |dg|={err:.2e}, |g|={p.grad.norm().item():.2e}"
