"""KDA context parallelism (k3train/parallel/context_parallel.py) on 2 and 3 gloo ranks against the
whole rows on one process: the short conv with its halo and the KDA state chain, outputs and every
gradient, with packed documents that cross chunk boundaries, start inside chunks and at a chunk's
first token."""

from __future__ import annotations

import pytest
import torch

from multiprocess import run_ranks

B, T, H, K, V, W = 2, 24, 2, 8, 8, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    pos = []
    for starts in ([0, 5, 11, 17], [0, 8, 9, 16, 20]):  # 11 and 16 fall on chunk edges below
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


def _check(rank, world, bounds):
    import torch.distributed as dist

    from k3train.model.kda import causal_conv_with_resets
    from k3train.parallel.context_parallel import causal_conv_context_parallel, kda_context_parallel

    group = dist.group.WORLD
    pos, x = _inputs()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, conv_ref = _reference(pos, leaves)
    g = torch.Generator().manual_seed(1)
    do, dconv = torch.randn(o_ref.shape, generator=g), torch.randn(conv_ref.shape, generator=g)
    ((o_ref * do).sum() + (conv_ref * dconv).sum()).backward()

    a, b = bounds[rank], bounds[rank + 1]
    mine = {n: (t[:, a:b] if t.dim() >= 2 and t.shape[1] == T and n not in ("conv_w",) else t).clone().requires_grad_()
            for n, t in x.items()}
    o = kda_context_parallel(*(mine[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), pos[:, a:b], group,
                             lower_bound=-5.0)
    conv = causal_conv_context_parallel(mine["conv_in"], mine["conv_w"], pos[:, a:b], group, causal_conv_with_resets)
    torch.testing.assert_close(o, o_ref[:, a:b].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref[:, a:b].detach(), rtol=1e-5, atol=1e-6)
    ((o * do[:, a:b]).sum() + (conv * dconv[:, a:b]).sum()).backward()
    for n, t in mine.items():
        want = leaves[n].grad
        if n in ("A_log", "dt_bias", "conv_w"):  # shared weights: each rank holds its chunk's share
            got = t.grad.clone()
            dist.all_reduce(got, group=group)
        else:
            got, want = t.grad, want[:, a:b]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} d{n}: {m}")


@pytest.mark.parametrize("bounds", [[0, 11, 24], [0, 7, 16, 24]])
def test_kda_and_conv_context_parallel_match_whole_rows(bounds):
    run_ranks(len(bounds) - 1, _check, bounds)
