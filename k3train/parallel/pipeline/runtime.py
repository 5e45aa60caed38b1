"""Runs a step's micro-batches through the pipeline: the trainer's schedule when parallel.pipeline > 1.

Each stage executes its action list (``schedule.py``):

    F(c, i): receive [P | new rows] from chunk c−1 (chunk 0 embeds), add the rows to the stage's
             ``RowCache`` for micro-batch i, run the chunk's layers on B = the cached rows and P,
             and send [P' | rows new to the next stage] on (``bank.py``); the last chunk computes
             the loss instead.
    B(c, i): receive the gradient of what F sent; backpropagate the chunk from P' and from the
             rows it wrote (their gradient: what came back plus what this stage's later chunks
             accumulated in the cache); add the returned gradient of rows it only passed on to
             their cached leaves; send back the gradient of P and of the rows that came in.

Autograd never crosses a chunk boundary: every received tensor and every cached row is a detached
leaf. The loss of micro-batch i enters the backward as loss_i / m, as in the one-rank loop.
All messages are fp32 [1 + rows, b, t, d].
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from k3train.data.batches import batch_to_device
from k3train.model.k3 import K3Model
from k3train.parallel.pipeline.bank import BankPlan, RowCache
from k3train.parallel.pipeline.layout import Chunk
from k3train.parallel.pipeline.p2p import Channels
from k3train.parallel.pipeline.schedule import Action, forward_actions, train_actions
from k3train.parallel.pipeline.stage import run_chunk


class PipelineSchedule:
    def __init__(self, model: K3Model, chunks: list[Chunk], pp_group, device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.chunks, self.device, self.autocast = model, chunks, device, autocast
        self.pp_group = pp_group
        ranks = dist.get_process_group_ranks(pp_group)
        self.P = len(ranks)
        self.V = len(chunks) // self.P
        self.stage = ranks.index(dist.get_rank())
        self.plan = BankPlan.build(chunks, self.P, model.cfg.attn_res_block_size)
        self.channels = Channels(ranks, self.stage, device)

    # --- public: the trainer's two calls ----------------------------------------------------------
    def train(self, batches: list[dict]) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns Σ_i loss_i, the same on every stage."""
        losses = self._run(batches, train_actions, grad=True)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss
        dist.all_reduce(total, group=self.pp_group)
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[dict]) -> torch.Tensor:
        """Mean loss over the micro-batches, the same on every stage."""
        losses = self._run(batches, forward_actions, grad=False)
        mean = torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(mean, group=self.pp_group)
        return mean

    # --- the run ----------------------------------------------------------------------------------
    def _message_shape(self, hop: int, batch: dict) -> tuple[int, ...]:
        return (1 + len(self.plan.sent[hop]), *batch["tokens"].shape, self.model.cfg.hidden_size)

    def _expected(self, actions_of, m: int, batch: dict) -> dict[int, list]:
        """What every other stage will send this one, in its send order."""
        C = len(self.chunks)
        expect: dict[int, list] = {}
        for src in range(self.P):
            if src == self.stage:
                continue
            for kind, c, i in actions_of(self.P, self.V, m, src):
                if kind == "F" and c < C - 1 and self.chunks[c + 1].stage == self.stage:
                    expect.setdefault(src, []).append((("F", c + 1, i), self._message_shape(c, batch)))
                elif kind == "B" and c > 0 and self.chunks[c - 1].stage == self.stage:
                    expect.setdefault(src, []).append((("B", c - 1, i), self._message_shape(c - 1, batch)))
        return expect

    def _run(self, batches: list[dict], actions_of, grad: bool) -> list[torch.Tensor]:
        m = len(batches)
        self.inputs = [batch_to_device(b, self.device) for b in batches]
        self.docs = []
        for host, moved in zip(batches, self.inputs):  # counted on the host batches: no read-back
            given = self.model.host_documents(host["position_ids"], self.device)
            self.docs.append(self.model.documents(moved["tokens"], moved["position_ids"], given))
        self.caches = [RowCache() for _ in range(m)]
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: list[torch.Tensor] = []
        self.m = m
        self.channels.start(self._expected(actions_of, m, batches[0]))
        for action in actions_of(self.P, self.V, m, self.stage):
            if action.kind == "F":
                self._forward(action, grad)
            else:
                self._backward(action)
        self.channels.finish()
        losses, self.losses = self.losses, []
        self.inputs = self.docs = self.caches = None
        return losses

    def _forward(self, a: Action, grad: bool) -> None:
        chunk, plan, cache, model = self.chunks[a.chunk], self.plan, self.caches[a.micro], self.model
        batch = self.inputs[a.micro]
        with torch.set_grad_enabled(grad), self.autocast():
            if chunk.first:
                p_in = None
                partial = model.embed(batch["tokens"])
            else:
                msg = self.channels.recv(("F", a.chunk, a.micro), self.chunks[a.chunk - 1].stage)
                p_in = partial = msg[0].detach().requires_grad_(grad)
                for j, row in zip(plan.sent[a.chunk - 1], msg[1:]):
                    cache.hold(j, row, grad)
            bank, partial = run_chunk(model, chunk, self.docs[a.micro], cache.get(plan.before[a.chunk]), partial)
            created = bank[len(plan.before[a.chunk]):]
            if chunk.last:
                out = model.head(bank, partial, batch["labels"], batch["loss_mask"])
                self.losses.append(out.detach().float())
            else:
                out = partial
                mine = dict(zip(plan.created[a.chunk], created))
                rows = [mine[j] if j in mine else cache.rows[j] for j in plan.sent[a.chunk]]
                self.channels.send(torch.stack([t.detach().float() for t in [partial, *rows]]),
                                   self.chunks[a.chunk + 1].stage)
        for j, row in zip(plan.created[a.chunk], created):  # later chunks of this stage read a leaf copy
            cache.hold(j, row, grad)
        if grad:
            self.saved[a.chunk, a.micro] = (p_in, out, created)
        elif a.chunk + self.P >= len(self.chunks):  # the micro-batch's last chunk on this stage
            self.caches[a.micro] = None

    def _backward(self, a: Action) -> None:
        chunk, plan, cache = self.chunks[a.chunk], self.plan, self.caches[a.micro]
        p_in, out, created = self.saved.pop((a.chunk, a.micro))
        if chunk.last:
            roots, grads = [out / self.m], [None]
            incoming: dict[int, torch.Tensor] = {}
        else:
            msg = self.channels.recv(("B", a.chunk, a.micro), self.chunks[a.chunk + 1].stage)
            roots, grads = [out], [msg[0]]
            incoming = dict(zip(plan.sent[a.chunk], msg[1:]))
        for j, row in zip(plan.created[a.chunk], created):
            parts = [g for g in (incoming.pop(j, None), cache.grad(j)) if g is not None]
            if parts:
                roots.append(row)
                grads.append(parts[0] if len(parts) == 1 else parts[0] + parts[1])
        for j, g in incoming.items():  # rows this chunk only passed on: their cached leaf collects it
            cache.add_grad(j, g)
        torch.autograd.backward(roots, grads)
        if not chunk.first:
            back = [p_in.grad] + [cache.grad(j) for j in plan.sent[a.chunk - 1]]
            back = [torch.zeros_like(p_in) if g is None else g for g in back]
            self.channels.send(torch.stack(back), self.chunks[a.chunk - 1].stage)
        if a.chunk < self.P:  # the micro-batch's first chunk on this stage: its rows are done
            self.caches[a.micro] = None
