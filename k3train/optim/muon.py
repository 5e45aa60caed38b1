"""Per-head Muon + AdamW in one optimizer, distributed over data- and tensor-parallel ranks.

``build_muon(named_params, cfg, dp_group=None, tp_group=None)`` returns a ``K3Muon``: one
``torch.optim.Optimizer`` whose param groups are tagged ``optimizer="muon"`` or
``optimizer="adamw"``. Which group a parameter joins comes from its declared role
(``k3train.model.roles``), never from its name (see ``param_groups.py``).

Muon step for the matrices (all Muon groups are processed together so that blocks of
one shape from different parameters share a Newton–Schulz call):

1. momentum ``m <- mu m + (1 - mu) g`` (EMA form), Nesterov look-ahead ``u = (1 - mu) g + mu m``;
2. TP: matrices that must be orthogonalized whole but are sharded are all-gathered
   (one collective for all of them); column-parallel per-head matrices stay local;
3. every parameter is viewed as blocks (per head, per expert, or one whole matrix), made
   wide (m <= n), and blocks of one shape are stacked into one batched NS call. Steps 1 and
   3 are one pass per parameter (``kernels/newton_schulz/muon_passes.py``): it reads g and m,
   writes m and writes u, cast to the NS dtype, straight into the stack;
4. DP: the shape buckets are spread over the DP ranks (whole small buckets, big ones cut,
   balanced by NS cost, ``assign_blocks``); each rank orthogonalizes its share and one
   all-gather brings all updates to every rank, so per-rank NS work falls with DP. Expert
   stacks sharded over expert parallelism differ between EP ranks, so their buckets are spread
   over ``expert_dp_group`` (the ranks holding the same experts) instead;
5. ``p <- p (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) * NS(u_block)``, with (m, n) the
   *block* shape (docs/muon_notes.md explains why): one pass per parameter, which also sums
   the update's squares for ``last_step_info["update_rms"]`` (this rank's) and
   ``["update_sumsq"]`` (this rank's share of the whole model's).

The caller has already averaged gradients over DP. Every rank keeps the full momentum
of its (TP-local) parameters, so the optimizer state is that of the 1-rank optimizer.

A step whose gradients contain inf/NaN on any rank is skipped on all ranks: nothing
(momentum, AdamW moments, step counters, weights) is touched. ``last_step_skipped`` and
``num_skipped_steps`` report it, and a ``RuntimeWarning`` names the first bad parameter. The check
reads every gradient, waits on the host and all-reduces over TP and DP; a caller that has already
checked the global gradient norm (the trainer's step guard) sets ``check_finite = False``.

This module imports only torch and k3train's light modules (no megatron-core), so the
GPU benchmark can use it on a machine without megatron.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from kernels.newton_schulz.muon_passes import apply_update, nesterov_into
from k3train.optim.newton_schulz import NS_STEPS, default_ns_dtype, muon_update_scale, newton_schulz
from k3train.optim.param_groups import MuonSpec, cfg_get, muon_spec, split_params
from k3train.model.roles import get_role, require_role

__all__ = ["K3Muon", "build_muon"]


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _group_rank(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@dataclass
class _Item:
    """One Muon parameter taking part in this step."""

    param: torch.Tensor
    group: dict
    spec: MuonSpec
    grad: torch.Tensor
    buf: torch.Tensor  # momentum (updated this step by the pass that writes the NS input)
    u: Optional[torch.Tensor] = None  # full-shape NS input, only for TP-gathered parameters
    update: Optional[torch.Tensor] = None  # [num_blocks, m, n] in parameter orientation


@dataclass
class _Bucket:
    shape: tuple[int, int]  # canonical (wide) block shape
    ns_steps: int
    items: list[int]  # indices into the step's item list
    sizes: list[int]  # blocks contributed by each item
    stack: Optional[torch.Tensor] = None  # [num_blocks, m, n]: the NS inputs, written in place

    @property
    def num_blocks(self) -> int:
        return sum(self.sizes)

    @property
    def block_cost(self) -> int:
        m, n = self.shape
        return m * m * n * self.ns_steps


# Per-call cost in block_cost units (m*m*n*steps) of one batched NS call beyond its FLOPs, on
# CUDA (0 on CPU): 15 launches, ~0.3 ms on an H200 (benchmarks/muon.py: a [9, 8, 1024] call takes 0.31 ms,
# a [256, 256, 512] one 1.1 ms). It makes the plan prefer fewer, larger calls per rank.
NS_CALL_OVERHEAD = 1.0e10


def assign_blocks(buckets: list[_Bucket], dp: int, call_overhead: float = NS_CALL_OVERHEAD) -> list[list[int]]:
    """Blocks of each bucket given to each DP rank: counts[b][r].

    Deterministic (every rank computes the same plan). Greedy longest-processing-time:
    buckets from the most expensive down; a bucket is cut into as few pieces as keep each
    piece within one rank's fair share of the total NS work (k = ceil(work / share), at
    most dp), and the pieces go to the k least-loaded ranks. Small buckets therefore stay
    whole (one call on one rank) and only the big ones are split, so a rank does not pay
    the per-call floor of every bucket (measured: splitting every bucket over 8 ranks only
    cut the busiest rank's NS time 2.4x).
    """
    if dp == 1:
        return [[b.num_blocks] for b in buckets]
    work = [b.num_blocks * b.block_cost for b in buckets]
    share = (sum(work) + call_overhead * len(buckets)) / dp
    load = [0.0] * dp
    counts: list[list[int]] = [[0] * dp for _ in buckets]
    for b in sorted(range(len(buckets)), key=lambda i: (-work[i], i)):
        n = buckets[b].num_blocks
        k = max(1, min(dp, n, math.ceil(work[b] / share)))
        ranks = sorted(range(dp), key=lambda r: (load[r], r))[:k]
        base, rem = divmod(n, k)
        for i, r in enumerate(ranks):
            c = base + (1 if i < rem else 0)
            counts[b][r] = c
            load[r] += c * buckets[b].block_cost + call_overhead
    return counts


class K3Muon(torch.optim.Optimizer):
    """Muon (per-head / whole / per-expert) for matrices and AdamW for the rest.

    Param groups must carry ``optimizer`` = "muon" or "adamw". Muon groups use ``lr``,
    ``weight_decay``, ``momentum``, ``nesterov``, ``ns_steps``, ``per_head_groups``;
    AdamW groups use ``lr``, ``weight_decay``, ``betas``, ``eps``. Every group keeps its
    base learning rate in ``initial_lr`` so ``torch.optim.lr_scheduler.LambdaLR`` scales
    ``lr`` from it.

    ``ns_dtype``: Newton–Schulz compute dtype (default bf16 on CUDA, fp32 on CPU).
    ``ns_fn``: a replacement for ``newton_schulz`` with the same signature (e.g. a Triton
    kernel). All blocks of one shape form one NS batch, a contiguous stack in the NS dtype.
    ``stack_max_blocks`` (default None): a parameter with at least this many blocks (e.g. an
    expert stack) gets its own batch. ``elementwise_backend`` ("auto", "triton", "torch"): the
    two fused passes around NS (``kernels/newton_schulz/muon_passes.py``): momentum + Nesterov +
    cast written into the stack, and decay + update + the update's sum of squares; "auto" is
    Triton on CUDA.

    ``lr_on_device`` (default False): the step reads each group's learning rate from an fp32 device
    scalar that ``sync_device_lr()`` fills from ``lr``, so that a step captured in a CUDA graph
    (``k3train/training/optimizer_graph.py``) follows the schedule on replay.
    """

    def __init__(
        self,
        params,
        *,
        dp_group=None,
        tp_group=None,
        expert_dp_group=None,
        ns_dtype: Optional[torch.dtype] = None,
        ns_fn: Optional[Callable[..., torch.Tensor]] = None,
        stack_max_blocks: Optional[int] = None,
        elementwise_backend: str = "auto",
    ):
        defaults = dict(
            optimizer="adamw",
            lr=3e-3,
            weight_decay=0.0,
            betas=(0.9, 0.95),
            eps=1e-8,
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            per_head_groups=[],
        )
        super().__init__(params, defaults)
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.expert_dp_group = expert_dp_group
        self.ns_dtype = ns_dtype
        self.ns_fn = ns_fn or newton_schulz
        self.stack_max_blocks = stack_max_blocks
        self.elementwise_backend = elementwise_backend
        self.check_finite = True  # skip steps with non-finite gradients (module docstring)
        # Set by a caller that captures step() in a CUDA graph: the step then reads every group's learning
        # rate from an fp32 device scalar, written by sync_device_lr() (which must run before each step).
        self.lr_on_device = False
        self._lr_device: dict[int, torch.Tensor] = {}  # param-group index → 0-d fp32
        self.last_step_skipped = False
        self.num_skipped_steps = 0
        self.last_step_info: dict[str, Any] = {}
        self._specs: dict[int, MuonSpec] = {}
        for group in self.param_groups:
            self._check_group(group)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("names", None)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("initial_lr", group["lr"])
        if hasattr(self, "_specs"):
            self._check_group(group)

    def _check_group(self, group: dict) -> None:
        kind = group["optimizer"]
        if kind not in ("muon", "adamw"):
            raise ValueError(f"param group optimizer must be 'muon' or 'adamw', got {kind!r}")
        names = group.get("names")
        if names is None:
            names = group["names"] = [f"param{i}" for i in range(len(group["params"]))]
        if len(names) != len(group["params"]):
            raise ValueError("param group 'names' must list one name per parameter")
        if kind == "muon":
            tp = _group_size(self.tp_group)
            for name, p in zip(names, group["params"]):
                role = require_role(name, p)
                self._specs[id(p)] = muon_spec(name, p, role, group["per_head_groups"], tp)

    # -------------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["k3_muon"] = {"num_skipped_steps": self.num_skipped_steps}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("k3_muon", {})
        super().load_state_dict(state_dict)
        self.num_skipped_steps = int(extra.get("num_skipped_steps", 0))
        # The base class casts state to the parameter dtype; Muon keeps fp32 momentum for
        # low-precision parameters, and AdamW's step counters must stay fp32.
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                if "momentum_buffer" in st:
                    st["momentum_buffer"] = st["momentum_buffer"].to(self._state_dtype(p))
        self._specs = {}
        for group in self.param_groups:
            self._check_group(group)

    def sync_device_lr(self) -> None:
        """Write each group's ``lr`` into its device scalar, which step() reads when ``lr_on_device`` is set
        (one fill kernel a group, no host read; outside a captured step, before each replay)."""
        for i, group in enumerate(self.param_groups):
            t = self._lr_device.get(i)
            if t is None:
                t = self._lr_device[i] = torch.zeros((), dtype=torch.float32, device=group["params"][0].device)
            t.fill_(group["lr"])

    def _lr(self, group: dict) -> float | torch.Tensor:
        """The group's learning rate: its ``lr``, or its device scalar under ``lr_on_device``."""
        if not self.lr_on_device:
            return group["lr"]
        return self._lr_device[next(i for i, g in enumerate(self.param_groups) if g is group)]

    @staticmethod
    def _state_dtype(p: torch.Tensor) -> torch.dtype:
        return torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.lr_on_device and len(self._lr_device) < len(self.param_groups):
            raise RuntimeError("K3Muon.lr_on_device is set: call sync_device_lr() before step()")
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("K3Muon does not support sparse gradients")
                    grads.append(p.grad)
        if self.check_finite and not self._grads_finite(grads):
            self.last_step_skipped = True
            self.num_skipped_steps += 1
            warnings.warn(
                f"K3Muon: non-finite gradient ({self._first_bad_param()}); step skipped, "
                f"optimizer state untouched ({self.num_skipped_steps} skipped so far)",
                RuntimeWarning,
                stacklevel=2,
            )
            return loss
        self.last_step_skipped = False
        for group in self.param_groups:
            if group["optimizer"] == "adamw":
                self._adamw_group(group)
        self._muon_step()
        return loss

    def _grads_finite(self, grads: list[torch.Tensor]) -> bool:
        if grads:
            norms = torch._foreach_norm(grads)
            bad = (~torch.isfinite(torch.stack([n.float() for n in norms]).sum())).float().reshape(1)
        else:
            bad = torch.zeros(1)
        # Gradients differ between TP ranks; DP ranks hold averaged (equal) ones, but a
        # skip must be unanimous, so reduce over both.
        for group in (self.tp_group, self.dp_group):
            if _group_size(group) > 1:
                if dist.get_backend(group) == "nccl" and not bad.is_cuda:
                    bad = bad.cuda()
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bad.item() == 0.0

    def _first_bad_param(self) -> str:
        for group in self.param_groups:
            for name, p in zip(group["names"], group["params"]):
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    return f"first bad local parameter: '{name}'"
        return "on another rank"

    # ------------------------------------------------------------------- AdamW
    def _adamw_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        by_key: dict[tuple, tuple[list, list, list, list, list]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lists = by_key.setdefault((p.device, p.dtype), ([], [], [], [], []))
            for lst, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                lst.append(t)
        for ps, gs, ms, vs, steps in by_key.values():
            torch._foreach_add_(steps, 1.0)
            kw = dict(lr=self._lr(group), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                      eps=group["eps"])
            if hasattr(torch, "_fused_adamw_"):
                torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False, **kw)
            else:  # pragma: no cover - very old torch
                _foreach_adamw(ps, gs, ms, vs, steps, **kw)

    # -------------------------------------------------------------------- Muon
    def _muon_step(self) -> None:
        items: list[_Item] = []
        for group in self.param_groups:
            if group["optimizer"] != "muon":
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p, dtype=self._state_dtype(p))
                items.append(_Item(p, group, self._specs[id(p)], p.grad, st["momentum_buffer"]))
        if not items:
            self.last_step_info = {}
            return
        self._tp_gather(items)
        buckets: list[_Bucket] = []
        self._ns_blocks_local = 0
        for indices, group in self._work_groups(items):
            part = self._make_buckets(items, indices)
            self._fill_stacks(items, part)
            self._orthogonalize(items, part, group)
            buckets += part
        sums = [torch.zeros((), dtype=torch.float32, device=items[0].param.device) for _ in range(3)]
        numel = [0, 0, 0]
        coeffs: dict[int, tuple] = {}  # per group: (1 - lr·wd, -lr), numbers or device scalars
        for it in items:
            if id(it.group) not in coeffs:
                lr = self._lr(it.group)
                coeffs[id(it.group)] = (1.0 - lr * it.group["weight_decay"], -lr)
            share = self._share(it)
            self._apply(it, sums[share], *coeffs[id(it.group)])
            numel[share] += it.param.numel()
        sumsq = torch.stack(sums)
        self.last_step_info = {
            "buckets": [(b.shape, b.num_blocks) for b in buckets],
            "muon_params": len(items),
            "ns_blocks_total": sum(b.num_blocks for b in buckets),
            "ns_blocks_local": self._ns_blocks_local,
            # RMS of the applied Muon updates before the learning rate, over this rank's Muon parameters:
            # sqrt(sum_p ||0.2 sqrt(max(m, n)) NS(u_p)||^2 / sum_p numel(p)), about 0.2 by construction
            # (the AdamW-matched scale). A 0-d tensor on the parameters' device (no host sync).
            "update_rms": (sumsq.sum() / sum(numel)).sqrt(),
            # The same sums, [dense, expert], over this rank's share of the model: a parameter that every TP
            # rank holds whole counts on TP rank 0 only, so that adding them over the ranks of one model copy
            # counts every element once (k3train/training/optimizer_metrics.py).
            "update_sumsq": sumsq[:2],
            "update_numel": numel[:2],
        }

    def _share(self, it: _Item) -> int:
        """Which of the update sums an item adds to: 0 dense, 1 expert stacks, 2 a parameter that every TP
        rank holds whole, on TP ranks other than 0."""
        role = get_role(it.param)
        if role.tp_partition_dim is None and _group_rank(self.tp_group) > 0:
            return 2
        return 1 if role.ep_partition_dim is not None else 0

    def _tp_gather(self, items: list[_Item]) -> None:
        tp = _group_size(self.tp_group)
        todo = [it for it in items if it.spec.gather_dim is not None]
        if tp == 1 or not todo:
            return
        for it in todo:
            it.u = torch.empty_like(it.buf)
            nesterov_into(_as3d(it.grad), _as3d(it.buf), _as3d(it.u), it.group["momentum"], it.group["nesterov"],
                          self.elementwise_backend)
        flat = torch.cat([it.u.reshape(-1) for it in todo])
        out = [torch.empty_like(flat) for _ in range(tp)]
        dist.all_gather(out, flat, group=self.tp_group)
        off = 0
        for it in todo:
            n = it.u.numel()
            pieces = [o[off : off + n].view(it.spec.local_shape) for o in out]
            it.u = torch.cat(pieces, dim=it.spec.gather_dim)
            off += n

    def _work_groups(self, items: list[_Item]) -> list[tuple[list[int], Any]]:
        """Item indices and the group that shares out their NS work: expert-parallel stacks over
        ``expert_dp_group``, everything else over ``dp_group``."""
        if self.expert_dp_group is None:
            return [(list(range(len(items))), self.dp_group)]
        is_expert = [get_role(it.param) is not None and get_role(it.param).ep_partition_dim is not None
                     for it in items]
        expert = [i for i, e in enumerate(is_expert) if e]
        rest = [i for i, e in enumerate(is_expert) if not e]
        return [(part, group) for part, group in ((rest, self.dp_group), (expert, self.expert_dp_group)) if part]

    def _make_buckets(self, items: list[_Item], indices: list[int]) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        shared: dict[tuple, _Bucket] = {}
        for i in indices:
            it = items[i]
            shape, steps, nb = it.spec.canonical_shape, it.group["ns_steps"], it.spec.num_blocks
            if self.stack_max_blocks is not None and nb >= self.stack_max_blocks:
                buckets.append(_Bucket(shape, steps, [i], [nb]))
                continue
            key = (shape, steps, it.buf.dtype, it.buf.device)
            if key not in shared:
                shared[key] = _Bucket(shape, steps, [], [])
                buckets.append(shared[key])
            shared[key].items.append(i)
            shared[key].sizes.append(nb)
        return buckets

    def _fill_stacks(self, items: list[_Item], buckets: list[_Bucket]) -> None:
        """Write every block's NS input into its bucket's contiguous stack (in the NS dtype). For a
        local parameter one pass reads grad and momentum, updates the momentum and writes the
        Nesterov look-ahead straight into the stack (transposed for tall blocks)."""
        for b in buckets:
            device = items[b.items[0]].buf.device
            b.stack = torch.empty((b.num_blocks, *b.shape), dtype=self._ns_dtype(device), device=device)
            start = 0
            for i, nb in zip(b.items, b.sizes):
                it, stack = items[i], b.stack[start : start + nb]
                start += nb
                spec = it.spec
                dst = spec.split(stack.mT if spec.transposed else stack)  # parameter orientation, a view a matrix
                if it.u is not None:  # TP-gathered full tensor, momentum already updated
                    for d, u in zip(dst, spec.blocks(it.u)):
                        d.copy_(u)
                    it.u = None
                    continue
                for g, m, d in zip(spec.blocks(it.grad), spec.blocks(it.buf), dst):
                    nesterov_into(g, m, d, it.group["momentum"], it.group["nesterov"], self.elementwise_backend)

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        return self.ns_dtype or default_ns_dtype(device)

    @staticmethod
    def _bucket_input(bucket: _Bucket, lo: int, hi: int) -> Optional[torch.Tensor]:
        """Blocks [lo, hi) of the bucket's stack (a view)."""
        return bucket.stack[lo:hi] if hi > lo else None

    def _ns(self, x: torch.Tensor, bucket: _Bucket) -> torch.Tensor:
        m, n = bucket.shape
        return self.ns_fn(x, steps=bucket.ns_steps, scale=muon_update_scale(m, n), dtype=self._ns_dtype(x.device))

    def _orthogonalize(self, items: list[_Item], buckets: list[_Bucket], group) -> None:
        """NS of every bucket, shared out over the ranks of ``group`` (which hold the same blocks)."""
        dp = _group_size(group)
        results: list[torch.Tensor] = []  # per bucket: [N, m, n] canonical
        if dp == 1:
            self._ns_blocks_local += sum(b.num_blocks for b in buckets)
            for b in buckets:
                results.append(self._ns(self._bucket_input(b, 0, b.num_blocks), b))
        else:
            rank = _group_rank(group)
            # the per-call floor is a GPU launch cost; on CPU NS time is all FLOPs
            overhead = NS_CALL_OVERHEAD if items[0].buf.is_cuda else 0.0
            counts = assign_blocks(buckets, dp, overhead)
            self._ns_blocks_local += sum(c[rank] for c in counts)
            device = items[0].buf.device
            dtype = self._ns_dtype(device)
            mine = []
            totals = [0] * dp
            for b, c in zip(buckets, counts):
                m, n = b.shape
                for r in range(dp):
                    totals[r] += c[r] * m * n
                lo = sum(c[:rank])
                x = self._bucket_input(b, lo, lo + c[rank])
                if x is not None:
                    mine.append(self._ns(x, b).reshape(-1))
            send = torch.zeros(max(totals), dtype=dtype, device=device)
            if mine:
                own = torch.cat(mine) if len(mine) > 1 else mine[0]
                send[: own.numel()].copy_(own)
            recv = [torch.empty_like(send) for _ in range(dp)]
            dist.all_gather(recv, send, group=group)
            offs = [0] * dp
            for b, c in zip(buckets, counts):
                m, n = b.shape
                segs = []
                for r in range(dp):
                    k = c[r] * m * n
                    if k:
                        segs.append(recv[r][offs[r] : offs[r] + k].view(c[r], m, n))
                    offs[r] += k
                results.append(torch.cat(segs) if len(segs) > 1 else segs[0])
        for b, res in zip(buckets, results):
            start = 0
            for i, nb in zip(b.items, b.sizes):
                blk = res[start : start + nb]
                items[i].update = blk.mT if items[i].spec.transposed else blk
                start += nb

    def _apply(self, it: _Item, sumsq: torch.Tensor, beta, alpha) -> None:
        """p <- beta p + alpha update (beta = 1 - lr wd, alpha = -lr), in one pass; adds the update's sum of
        squares to ``sumsq``."""
        spec, p, upd = it.spec, it.param, it.update
        if spec.gather_dim is None and p.is_contiguous():
            for blocks, u in zip(spec.blocks(p), spec.split(upd)):
                apply_update(blocks, u, beta, alpha, sumsq, self.elementwise_backend)
            return
        full = torch.empty(spec.full_shape, dtype=upd.dtype, device=upd.device)
        for blocks, u in zip(spec.blocks(full), spec.split(upd)):
            blocks.copy_(u)
        if spec.gather_dim is not None:
            tp = self.tp_group
            full = full.chunk(_group_size(tp), dim=spec.gather_dim)[_group_rank(tp)]
        apply_update(_as3d(p), _as3d(full), beta, alpha, sumsq, self.elementwise_backend)


def _as3d(t: torch.Tensor) -> torch.Tensor:
    """A MATRIX [m, n] as [1, m, n] (a view); an EXPERT_MATRIX [E, m, n] as itself."""
    return t.unsqueeze(0) if t.ndim == 2 else t


def _foreach_adamw(ps, gs, ms, vs, steps, *, lr, beta1, beta2, weight_decay, eps):  # pragma: no cover
    torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(ms, gs, 1.0 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1.0 - beta2)
    for p, m, v, s in zip(ps, ms, vs, steps):
        t = s.item()
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)


def build_muon(
    named_params: list[tuple[str, torch.nn.Parameter]],
    cfg: Any,
    dp_group=None,
    tp_group=None,
    expert_dp_group=None,
    **kwargs,
) -> K3Muon:
    """One optimizer: Muon for MATRIX / EXPERT_MATRIX roles, AdamW for everything else.

    ``cfg`` is an ``OptimConfig`` (fields lr, weight_decay, betas, eps, muon_momentum,
    muon_ns_steps, per_head_groups). Groups: "muon" (weight decay), "adamw" (weight
    decay: embeddings, LM head, conv, ...), "adamw_no_wd" (norms, pseudo-queries, gate
    params, vectors). Every parameter must declare a role; frozen ones are skipped.
    ``kwargs`` go to ``K3Muon`` (ns_dtype, ns_fn, stack_max_blocks); without ``ns_fn`` the
    NS backend comes from ``cfg.muon_ns_backend`` when the config has it (default "auto").
    """
    named_params = list(named_params)
    split = split_params(named_params)
    lr = float(cfg_get(cfg, "lr"))
    wd = float(cfg_get(cfg, "weight_decay", 0.0))
    betas = tuple(float(b) for b in cfg_get(cfg, "betas", (0.9, 0.95)))
    eps = float(cfg_get(cfg, "eps", 1e-8))
    groups = []
    if split.muon:
        groups.append(
            dict(
                params=[p for _, p in split.muon],
                names=[n for n, _ in split.muon],
                group_name="muon",
                optimizer="muon",
                lr=lr,
                initial_lr=lr,
                weight_decay=wd,
                momentum=float(cfg_get(cfg, "muon_momentum", 0.95)),
                nesterov=True,
                ns_steps=int(cfg_get(cfg, "muon_ns_steps", 5)),
                per_head_groups=list(cfg_get(cfg, "per_head_groups", [])),
            )
        )
    for gname, plist, gwd in (("adamw", split.adamw_decay, wd), ("adamw_no_wd", split.adamw_no_decay, 0.0)):
        if plist:
            groups.append(
                dict(
                    params=[p for _, p in plist],
                    names=[n for n, _ in plist],
                    group_name=gname,
                    optimizer="adamw",
                    lr=lr,
                    initial_lr=lr,
                    weight_decay=gwd,
                    betas=betas,
                    eps=eps,
                )
            )
    if not groups:
        raise ValueError("build_muon: no trainable parameters")
    if "ns_fn" not in kwargs:
        kwargs["ns_fn"] = ns_backend(str(cfg_get(cfg, "muon_ns_backend", "auto")))
    return K3Muon(groups, dp_group=dp_group, tp_group=tp_group, expert_dp_group=expert_dp_group, **kwargs)


def ns_backend(name: str) -> Callable[..., torch.Tensor]:
    """Newton–Schulz implementation by name.

    - "torch": batched bmm/baddbmm (``newton_schulz``);
    - "triton": the fused kernel in kernels/newton_schulz for blocks of <= 128 rows, torch
      otherwise (on CPU only under the Triton interpreter: slow, for tests);
    - "auto" (default): on CUDA the fused kernel for <= 128-row blocks, the tiled kernel for calls of
      more than 128 rows and at least ``TILED_NS_MIN_FLOPS``, torch for the rest; torch on CPU.
      Measured on an H200 (docs/muon_notes.md): the fused kernel 1.8x faster than bmm on the
      216+ KDA head blocks [128, 1024], 7x on tiny launch-bound batches; the tiled one 1.3x on
      bench-1B's 4,608 expert blocks [256, 512];
    - "tiled": "auto", with the larger blocks on CUDA through ``kernels/newton_schulz/triton_tiled_ns.py``
      (each step's three GEMMs as Triton kernels that skip the lower half of the symmetric products
      and apply the polynomial in their epilogues; on CPU under the Triton interpreter);
    - "inductor": "auto", with the larger blocks on CUDA through ``torch.compile(newton_schulz,
      mode="max-autotune-no-cudagraphs")``: inductor's GEMM templates autotuned for each bucket's
      shape (cuBLAS runs the 4,608 expert blocks [256, 512] of bench-1B at ~244 TFLOP/s), compiled
      and tuned at the first step. Not yet measured.
    """
    if name == "inductor":
        return _newton_schulz_inductor
    if name == "torch":
        return newton_schulz
    if name == "triton":
        from kernels.newton_schulz import newton_schulz_triton  # noqa: PLC0415

        return newton_schulz_triton
    if name == "auto":
        return _newton_schulz_auto
    if name == "tiled":
        return _newton_schulz_tiled
    raise ValueError(f"optim.muon_ns_backend must be 'auto', 'torch', 'triton', 'tiled' or 'inductor', got {name!r}")


_TRITON_NS: list = []  # lazily imported fused kernel (or None when unavailable)


_COMPILED_NS: list = []  # newton_schulz through torch.compile (max-autotune), made at first use


def _newton_schulz_inductor(G: torch.Tensor, **kw) -> torch.Tensor:
    if not G.is_cuda or min(G.shape[-2:]) <= 128:
        return _newton_schulz_auto(G, **kw)
    if not _COMPILED_NS:
        # one compile per bucket shape and its keyword values (the scale differs by block shape)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED_NS.append(torch.compile(newton_schulz, mode="max-autotune-no-cudagraphs", dynamic=False))
    return _COMPILED_NS[0](G, **kw)


# "auto" sends a call of more than 128 rows to the tiled kernel from this many NS FLOPs on (4m²n + 2m³ a block
# and step). On one H200 (benchmarks/muon.py, docs/results/muon_tiled_h200_2026-12-01.json) the tiled kernel
# beat bmm on [4608, 256, 512] (3.9 TFLOP: 12.2 against 16.0 ms) and [26, 1024, 1024] (0.84 TFLOP: 1.51
# against 1.97 ms), and lost on [60, 512, 1024] (0.40 TFLOP: 1.30 against 1.22 ms), [3, 1024, 4864] and
# every call under 0.1 TFLOP.
TILED_NS_MIN_FLOPS = 0.5e12


def ns_flops(num_blocks: int, m: int, n: int, steps: int = NS_STEPS) -> float:
    """Newton–Schulz FLOPs of ``num_blocks`` wide [m, n] blocks (m ≤ n): per step XXᵀ, A² and BX."""
    return num_blocks * steps * (4.0 * m * m * n + 2.0 * m ** 3)


def _newton_schulz_tiled(G: torch.Tensor, **kw) -> torch.Tensor:
    if min(G.shape[-2:]) <= 128:
        return _newton_schulz_auto(G, **kw)
    from kernels.newton_schulz.triton_tiled_ns import newton_schulz_tiled, tiled_supports  # noqa: PLC0415

    return newton_schulz_tiled(G, **kw) if tiled_supports(G) else newton_schulz(G, **kw)


def _newton_schulz_auto(G: torch.Tensor, **kw) -> torch.Tensor:
    if G.is_cuda:
        if not _TRITON_NS:
            try:
                from kernels.newton_schulz import newton_schulz_triton  # noqa: PLC0415
            except Exception:  # noqa: BLE001 - no triton: torch path
                newton_schulz_triton = None
            _TRITON_NS.append(newton_schulz_triton)
        fn = _TRITON_NS[0]
        if fn is not None and min(G.shape[-2:]) <= 128:
            return fn(G, **kw)
        blocks, (m, n) = (G.shape[0] if G.ndim == 3 else 1), sorted(G.shape[-2:])
        if fn is not None and ns_flops(blocks, m, n, kw.get("steps", NS_STEPS)) >= TILED_NS_MIN_FLOPS:
            return _newton_schulz_tiled(G, **kw)
    return newton_schulz(G, **kw)
