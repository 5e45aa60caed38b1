"""The step's gradients: flat fp32 buffers of the main gradients, their accumulation over the
micro-batches, their data-parallel averaging (overlapped with the last backward), and the TP/EP/PP-aware
global norm and clipping. Megatron-Core's DistributedDataParallel and ``clip_grads`` assume CUDA; this
runs on gloo and NCCL alike.

**Storage.** The gradient of every main weight (``main_param(p).grad``, k3train/precision/main_params.py)
is an fp32 view into one of at most four flat buffers, one per kind (expert-parallel?, TP-sharded?).
Within a buffer the parameters lie in reverse registration order, roughly the order in which the
backward finishes them.

**Accumulation** over the step's micro-batches i = 1..n:

- fp32 parameters (their own main weights): autograd adds each backward's gradient into ``p.grad``,
  which is the view, in place, so ``zero`` clears the buffers;
- bf16 parameters: a post-accumulate-grad hook copies ``p.grad`` (bf16) into ``main(p).grad`` the first
  time in the step and adds it after that (``kernels.grad_accumulate``: a vectorized cast on CUDA), then
  frees it; ``zero`` only marks every main gradient stale, and ``reduce`` zeroes those that got no
  gradient all step (one micro-batch: one fp32 write per parameter instead of a zero fill plus a
  read-modify-write);

so a buffer holds g = Σ_i ∇(loss_i / n), summed in fp32, once ``reduce`` has run.

**Data-parallel averaging.** The loss is the mean over the DP ranks of each rank's mean loss. A
replicated parameter's gradient is averaged over DP×CP: g ← (Σ_dp_cp g) / |dp_cp|. An expert-parallel
one (a routed-expert stack) already holds, after the dispatcher's backward all-to-all, the sum over its
EP group's ranks of their losses' gradients; it is summed over the ranks that hold the same experts
(``expert_dp``) and divided by |dp_cp|, which gives the same mean. Each buffer is cut into buckets of at
most ``bucket_bytes`` along parameter boundaries, one all-reduce each. ``last_backward`` (called before
the step's last backward) arms them: a bucket's all-reduce starts, asynchronously, once every parameter
in it has received its gradient of that backward, and buckets start strictly in one fixed order, the
same on every rank (collectives on a group must be issued in the same order everywhere). ``reduce``
starts the rest (buckets holding a parameter without a gradient in the last backward, or everything
when nothing was armed, as under pipeline parallelism), waits, and divides.

**Norm.** ‖g‖₂ of the full model: squares of TP-sharded gradients are summed over TP ranks, of
expert-parallel ones over EP (and TP if also TP-sharded), replicated ones counted once; the stages'
sums are added over PP. Each buffer's sum of squares adds the norms of rows of 4096 elements, so that
it is fp32-accurate on CPU too and does not depend on how the buffers are split over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from k3train.model.roles import get_role
from k3train.parallel.state import ParallelGroups
from k3train.precision.main_params import main_param
from kernels.grad_accumulate import accumulate

GradKind = tuple[bool, bool]  # (expert-parallel, TP-sharded)


def _kind(p: torch.Tensor) -> GradKind:
    role = get_role(p)
    return (role is not None and role.ep_partition_dim is not None,
            role is not None and role.tp_partition_dim is not None)


def _sum_of_squares(flat: torch.Tensor, row: int = 4096) -> torch.Tensor:
    """Σ x² of a flat fp32 buffer, from the norms of its rows of ``row`` elements (a view, no copy). CPU
    torch's ``vector_norm`` of one long vector is off by ~1e-4 (8e-5 on k3_tiny's 622k gradients, 7e-4 at
    10M elements), so the norm would depend on how the buffers are split over the ranks; by rows: ~2e-7."""
    n = flat.numel() - flat.numel() % row
    return torch.linalg.vector_norm(flat[:n].view(-1, row), dim=1).square().sum() + flat[n:].square().sum()


@dataclass
class _Bucket:
    flat: torch.Tensor  # a slice of one buffer
    group: Any  # the all-reduce's process group; None: no all-reduce, only the division
    divisor: int
    size: int  # parameters in it
    pending: int = 0  # parameters still waiting for their gradient of the armed backward
    work: Any = None  # the async all-reduce once started


class GradBuffers:
    """The main gradients of ``model``'s trainable parameters (module docstring). Build it after
    ``MainParams`` has given the parameters their main weights."""

    def __init__(self, model: nn.Module, groups: ParallelGroups | None, bucket_bytes: int = 64 << 20):
        self.groups = groups
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.device = params[0].device
        self._params = params
        self._copy_first = any(main_param(p) is not p for p in params)  # bf16 parameters
        self._stale: set[int] = set()  # bf16 parameters without a gradient yet this step
        by_kind: dict[GradKind, list[nn.Parameter]] = {}
        for p in params:
            by_kind.setdefault(_kind(p), []).append(p)
        self.flat = {kind: torch.zeros(sum(p.numel() for p in ps), dtype=torch.float32, device=self.device)
                     for kind, ps in by_kind.items()}
        self._view_ptr: dict[int, int] = {}  # fp32 parameters: where their .grad must stay
        self._buckets: list[_Bucket] = []  # in start order
        self._bucket_of: dict[int, _Bucket] = {}
        offset = {kind: 0 for kind in by_kind}
        open_: dict[GradKind, list[nn.Parameter]] = {}
        start = {kind: 0 for kind in by_kind}
        for p in params:  # lay out the views and cut the buckets in one walk, in backward order
            kind, n = _kind(p), p.numel()
            main = main_param(p)
            if main.dtype != torch.float32:
                raise ValueError(f"main weights are fp32, got {main.dtype} for a parameter of shape {tuple(p.shape)}")
            main.grad = self.flat[kind][offset[kind]:offset[kind] + n].view_as(main)
            if main is p:
                self._view_ptr[id(p)] = p.grad.data_ptr()
            members = open_.setdefault(kind, [])
            if members and 4 * (offset[kind] + n - start[kind]) > bucket_bytes:
                self._close(kind, members, start[kind], offset[kind])
                members.clear()
                start[kind] = offset[kind]
            members.append(p)
            offset[kind] += n
            p.register_post_accumulate_grad_hook(self._accumulated)
        for kind, members in open_.items():
            if members:
                self._close(kind, members, start[kind], offset[kind])
        self._armed = False
        self._seen: set[int] = set()
        self._next = 0  # the next bucket to start

    def _close(self, kind: GradKind, members: list[nn.Parameter], lo: int, hi: int) -> None:
        group, divisor = self._reduction(expert=kind[0])
        if group is None and divisor == 1:
            return
        bucket = _Bucket(self.flat[kind][lo:hi], group, divisor, len(members))
        self._buckets.append(bucket)
        for p in members:
            self._bucket_of[id(p)] = bucket

    def _reduction(self, expert: bool) -> tuple[Any, int]:
        """(group to sum over or None, divisor) of a buffer's gradients."""
        g = self.groups
        if g is None or g.dp_cp_size == 1:
            return None, 1
        if expert and g.ep_size > 1:
            return (g.expert_dp if g.expert_dp_size > 1 else None), g.dp_cp_size
        return g.dp_cp, g.dp_cp_size

    # --- accumulation --------------------------------------------------------------------------
    def _accumulated(self, p: nn.Parameter) -> None:
        """After autograd has accumulated ``p.grad`` in one backward."""
        main = main_param(p)
        if main is not p:
            accumulate(main.grad, p.grad, first=id(p) in self._stale)
            self._stale.discard(id(p))
            p.grad = None
        elif p.grad.data_ptr() != self._view_ptr[id(p)]:
            raise RuntimeError(f"the gradient of a parameter of shape {tuple(p.shape)} left its gradient buffer "
                               f"(p.grad was replaced or set to None); clear gradients with GradBuffers.zero()")
        bucket = self._bucket_of.get(id(p))
        if not self._armed or bucket is None:
            return
        if id(p) in self._seen:
            raise RuntimeError(f"a parameter of shape {tuple(p.shape)} got two gradients in the step's last "
                               f"backward, after its bucket's all-reduce may have started")
        self._seen.add(id(p))
        bucket.pending -= 1
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._start_next()

    def _start_next(self) -> None:
        bucket = self._buckets[self._next]
        if bucket.group is not None:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self._next += 1

    def _reset(self) -> None:
        self._seen.clear()
        self._next = 0
        for b in self._buckets:
            b.pending, b.work = b.size, None

    def zero(self) -> None:
        """Clear every main gradient (the step's first call)."""
        if self._copy_first:
            self._stale = {id(p) for p in self._params}
            return
        for flat in self.flat.values():
            flat.zero_()

    def last_backward(self) -> None:
        """The next backward is the step's last: start each bucket's all-reduce as soon as it is final."""
        self._reset()
        self._armed = bool(self._buckets)

    def reduce(self) -> None:
        """Complete the step's gradients after its backwards: zero those no backward reached, and average
        over data parallelism. Norm, clipping and the optimizer read them after this."""
        if self._stale:  # a bucket holding one has not started: it was not complete
            torch._foreach_zero_([main_param(p).grad for p in self._params if id(p) in self._stale])
            self._stale.clear()
        if not self._armed:
            self._reset()
        while self._next < len(self._buckets):
            self._start_next()
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
            if b.divisor != 1:
                b.flat.div_(b.divisor)
        self._armed = False

    # --- norm and clipping ---------------------------------------------------------------------
    def norm(self) -> torch.Tensor:
        """‖g‖₂ of the full model (module docstring), a 0-d fp32 tensor."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        sq = {kind: _sum_of_squares(flat) for kind, flat in self.flat.items()}
        expert = torch.stack([sq.get((True, False), zero), sq.get((True, True), zero)])
        g = self.groups
        if g is not None and g.ep_size > 1:
            dist.all_reduce(expert, group=g.ep)
        tp_sharded = sq.get((False, True), zero) + expert[1]
        if g is not None and g.tp_size > 1:
            dist.all_reduce(tp_sharded, group=g.tp)
        total = tp_sharded + expert[0] + sq.get((False, False), zero)
        if g is not None and g.pp_size > 1:  # pipeline stages hold disjoint parameters
            dist.all_reduce(total, group=g.pp)
        return total.sqrt()

    def clip(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """g ← g · min(1, max_norm / ‖g‖) (no-op when max_norm is 0 or ‖g‖ is not finite), without
        reading ‖g‖ back to the host."""
        if max_norm <= 0:
            return
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
        torch._foreach_mul_(list(self.flat.values()), coef)
