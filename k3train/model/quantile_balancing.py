"""Quantile Balancing of the router bias (K3_SPEC.md §2.5; K3 report App. C–D).

Over all m tokens of a global step, with n experts, top-k and target load q = m·k/n:

    r_ij = α_i − s_ij                    α_i: the (k+1)-th biased score of token i
    b_j  = q-th smallest of r_{:, j}      (the k/n quantile of r_{:, j})
    b    ← b − mean(b)                    applied from the next step

Step feedback (``model.qb_step_feedback`` = g > 0, with updates within the step): an update after window w
of a step's U gives expert j the rank q + g · (c̄ − c_j) / (U − w) instead of q, where c_j counts the tokens
routed to j in the step so far (pooled over data-parallel ranks) and c̄ is their mean: experts behind their
share get more of the remaining windows, those ahead fewer, so that the step-pooled load, not only each
window's, is steered to balance. Causal: it uses only windows already routed.

Two estimators share one interface (``observe`` per micro-batch, ``update`` per step):

- ``ExactQuantile`` keeps every r (tests and tiny runs; DP ranks all-gather);
- ``HistogramQuantile`` scatter-adds r into B bins on [b_min − 1, b_max + 1] (int32 counts: a bin holds
  at most the tokens an update pools, < 2³¹) and reads each expert's quantile off the cumulative counts
  with linear interpolation inside the bin. Error ≤ one bin width.

``update_biases`` updates many layers with one all-reduce for all of them (their counts and
feedback tokens in one flat tensor): one collective an update, whatever the depth.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from kernels.qb_histogram import histogram_add


def target_load(num_tokens, top_k: int, num_experts: int):
    return num_tokens * top_k / num_experts


def exact_bias(r: torch.Tensor, top_k: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """b_j = the ⌈q⌉-th smallest r_{:, j} (1-based), mean-centred. r: [m, n] → [n]. ``extra`` [n]: per-expert
    additions to q (step feedback); the ranks are clamped to 1..m."""
    m, n = r.shape
    q = target_load(m, top_k, n)
    if extra is None:
        b = r.float().kthvalue(max(1, math.ceil(q - 1e-9)), dim=0).values
    else:
        rank = torch.ceil(q + extra.double() - 1e-9).clamp(1, m).long()
        b = r.float().sort(dim=0).values.gather(0, (rank - 1).unsqueeze(0)).squeeze(0)
    return b - b.mean()


def histogram_bias(counts: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Read each expert's q-quantile off integer bin counts [n, B] on [lo, lo + B·width], centred.

    lo, width: 0-d tensors on the counts' device (no host round trip); q: 0-d, or [n] for a rank per expert."""
    cum = counts.cumsum(dim=1)
    q = q.double()
    need = torch.ceil(q - 1e-9).reshape(-1, 1)
    bin_idx = (cum < need).sum(dim=1).clamp(max=counts.shape[1] - 1)  # first bin reaching ⌈q⌉
    before = torch.where(bin_idx > 0, cum.gather(1, (bin_idx - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(bin_idx))
    inside = counts.gather(1, bin_idx.unsqueeze(1)).squeeze(1)
    frac = ((q - before.double()) / inside.double().clamp(min=1)).clamp(0.0, 1.0)
    b = lo.double() + (bin_idx.double() + frac) * width.double()
    b = b.float()
    return b - b.mean()


class QuantileBalancer(nn.Module):
    """Per-layer QB state. ``observe`` routing stats each micro-batch; ``update`` once per step.

    The histogram spans [b_min − 1, b_max + 1] of the bias the micro-batches were routed with (it
    changes only in ``update``). Its counts are a non-persistent buffer (moved with the model, not
    checkpointed) that ``observe`` adds into, so a compiled forward finds the same Python state
    every micro-batch; the exact estimator's growing list is kept eagerly (a graph break under
    torch.compile, for tests and tiny runs)."""

    def __init__(self, num_experts: int, top_k: int, estimator: str = "histogram", bins: int = 1000,
                 ema: float = 0.0, step_feedback: float = 0.0):
        super().__init__()
        if estimator not in ("histogram", "exact"):
            raise ValueError(f"model.qb_estimator={estimator!r}: use 'histogram' or 'exact'")
        self.num_experts, self.top_k = num_experts, top_k
        self.estimator, self.bins, self.ema, self.step_feedback = estimator, bins, ema, step_feedback
        self.register_buffer("counts", torch.zeros(num_experts, bins if estimator == "histogram" else 0,
                                                   dtype=torch.int32), persistent=False)
        # step feedback: tokens routed to each expert since the last update (this rank) and in the step so far
        # (pooled over the update's group)
        self.register_buffer("window_tokens", torch.zeros(num_experts), persistent=False)
        self.register_buffer("step_tokens", torch.zeros(num_experts), persistent=False)
        self._r: list[torch.Tensor] = []
        self._edges: tuple[torch.Tensor, torch.Tensor] | None = None  # the grid, computed once a step (eager)
        self.observed = False  # anything since the last update (written, never read, in the forward)

    def _grid(self, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lower edge, bin width) of the histogram for routing bias ``bias``, on its device. Eagerly
        computed at the step's first ``observe`` and kept until ``reset``; inside a compiled graph
        computed each micro-batch (a tensor kept on the module would be state the graph guards on)."""
        if not torch.compiler.is_compiling() and self._edges is not None:
            return self._edges
        b_min, b_max = bias.min().float(), bias.max().float()
        edges = (b_min - 1.0, (b_max - b_min + 2.0) / self.bins)
        if not torch.compiler.is_compiling():
            self._edges = edges
        return edges

    @torch.compiler.disable
    def _keep(self, r: torch.Tensor) -> None:
        """Keep a copy of r for the step's update (under CUDA graphs r lives in the graph pool, which the
        next micro-batch's replay overwrites)."""
        self._r.append(r.clone())

    @torch.no_grad()
    def observe(self, scores: torch.Tensor, cutoff: torch.Tensor, bias: torch.Tensor,
                tokens_per_expert: torch.Tensor | None = None) -> None:
        """scores [N, n] raw sigmoid, cutoff [N]: accumulate r = α − s of this micro-batch; and, with step
        feedback, the tokens it routed to each expert [n]."""
        self.observed = True
        if self.step_feedback and tokens_per_expert is not None:
            self.window_tokens += tokens_per_expert
        if self.estimator == "exact":
            self._keep(cutoff.unsqueeze(1) - scores)
            return
        histogram_add(self.counts, scores, cutoff, *self._grid(bias))  # one fused kernel on the GPU

    def _feedback(self, windows_left: int | None) -> bool:
        return bool(self.step_feedback and windows_left)

    def pooled_stats(self, windows_left: int | None) -> torch.Tensor:
        """What ``update`` pools over the data-parallel group, flat int32: the histogram counts [n·B] and, with
        step feedback within the step, the window's routed tokens [n] (whole numbers). Empty for the exact
        estimator without feedback (it all-gathers its r instead)."""
        parts = [self.counts.flatten()]
        if self._feedback(windows_left):
            parts.append(self.window_tokens.int())
        return torch.cat(parts)

    def load_pooled_stats(self, flat: torch.Tensor, windows_left: int | None) -> None:
        """Write back ``pooled_stats``'s tensor after the all-reduce."""
        self.counts.copy_(flat[:self.counts.numel()].view_as(self.counts))
        if self._feedback(windows_left):
            self.window_tokens.copy_(flat[self.counts.numel():])

    @torch.no_grad()
    def update(self, bias: torch.Tensor, group: dist.ProcessGroup | None = None,
               windows_left: int | None = None) -> None:
        """Compute the new bias from this step's stats (pooled over ``group``) and write it in place.
        ``windows_left``: the windows of the step still to route (an update within the step, which step
        feedback steers); None after the optimizer step (the step's counts start again)."""
        update_biases([(self, bias, windows_left)], group)

    @torch.no_grad()
    def _update_from_pooled(self, bias: torch.Tensor, group: dist.ProcessGroup | None,
                            windows_left: int | None) -> None:
        """``update`` once ``pooled_stats`` holds the group's sums (the exact estimator gathers its r here)."""
        extra = None
        if self._feedback(windows_left):
            self.step_tokens += self.window_tokens
            extra = self.step_feedback * (self.step_tokens.mean() - self.step_tokens) / windows_left
        elif self.step_feedback:  # after the optimizer step: the next step's counts start from 0
            self.step_tokens.zero_()
        if self.estimator == "exact":
            r = torch.cat(self._r)
            if group is not None and dist.get_world_size(group) > 1:
                parts = [torch.empty_like(r) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, r, group=group)
                r = torch.cat(parts)
            new = exact_bias(r, self.top_k, extra)
        else:
            counts = self.counts
            tokens = counts[0].sum()  # every token lands in one bin of every expert's row
            q = target_load(tokens, self.top_k, self.num_experts)
            if extra is not None:
                q = (q + extra.double()).clamp(min=1.0).minimum(tokens.double())
            new = histogram_bias(counts, *self._grid(bias), q)
        if self.ema > 0:
            new = self.ema * bias + (1.0 - self.ema) * new
            new = new - new.mean()
        bias.copy_(new.to(bias.dtype))
        self.reset()

    def reset(self) -> None:
        """Forget the stats since the last update (the step's feedback counts stay)."""
        self._r = []
        self._edges = None
        self.counts.zero_()
        self.window_tokens.zero_()
        self.observed = False


@torch.no_grad()
def update_biases(updates: list[tuple[QuantileBalancer, torch.Tensor, int | None]],
                  group: dist.ProcessGroup | None = None) -> None:
    """``QuantileBalancer.update`` for many layers, (balancer, bias, windows_left) each, with one all-reduce over
    ``group`` for all of them: their histogram counts and step-feedback tokens in one flat int32 tensor. Layers
    with nothing observed since their last update are left as they are."""
    updates = [u for u in updates if u[0].observed]
    if group is not None and dist.get_world_size(group) > 1:
        stats = [qb.pooled_stats(left) for qb, _, left in updates]
        flat = torch.cat(stats)
        if flat.numel():
            dist.all_reduce(flat, group=group)
        for (qb, _, left), part in zip(updates, flat.split([t.numel() for t in stats])):
            qb.load_pooled_stats(part, left)
    for qb, bias, left in updates:
        qb._update_from_pooled(bias, group, left)
