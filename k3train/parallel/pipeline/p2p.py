"""Point-to-point messages between neighbouring pipeline stages, the same on gloo and NCCL.

Every directed pair of neighbours (p → p±1 mod P) gets a process group of its own, so that the
messages on one group all flow one way. Sends are asynchronous (``isend``); a receiver posts its
``irecv``s on a channel in the sender's send order (both sides derive it from the same schedule),
posting all earlier messages when it needs a later one, so NCCL's in-order matching always pairs
the right buffers and a send waiting for its receiver never holds up a message in the other
direction. The channels are set up once, with one blocking exchange each in a global order.

``wait_s`` is the time this rank spent blocked waiting for messages (on GPU exact only with
``timed``, which synchronises the compute stream around each wait and so keeps the host from
running ahead: time with it off for throughput), ``bytes_sent`` what it sent.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist


def _pipeline_groups(pp_ranks: list[int]) -> list[list[int]]:
    """Every pipeline group of the job (each rank knows only its own), in a global order."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(pp_ranks))
    return sorted({tuple(r) for r in everyone})


class Channels:
    """Messages of one pipeline stage to and from its neighbours.

    ``expect[src]`` is the ordered list of (key, shape) that stage ``src`` will send to this one
    during the current run; ``recv(key, src)`` returns the message with that key."""

    def __init__(self, pp_ranks: list[int], stage: int, device: torch.device):
        self.ranks, self.stage, self.device = list(pp_ranks), stage, device
        P = len(pp_ranks)
        self.groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        for ranks in _pipeline_groups(pp_ranks):
            for src in range(P):
                for dst in sorted({(src + 1) % P, (src - 1) % P} - {src}):
                    group = dist.new_group([ranks[src], ranks[dst]])
                    if list(ranks) == self.ranks:
                        self.groups[src, dst] = group
        for (src, dst), group in sorted(self.groups.items()):  # set each channel up: one blocking exchange
            probe = torch.zeros(1, device=device)
            if src == stage:
                dist.send(probe, self.ranks[dst], group=group)
            elif dst == stage:
                dist.recv(probe, self.ranks[src], group=group)
        self.timed = False  # on GPU: synchronise around each wait so that wait_s is the time blocked
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.start({})

    def start(self, expect: dict[int, list[tuple[object, tuple[int, ...]]]]) -> None:
        """Begin a run: the messages to expect from each neighbouring stage, in their send order."""
        self.expect = {src: deque(msgs) for src, msgs in expect.items()}
        self.posted: dict[object, tuple[torch.Tensor, dist.Work]] = {}
        self.sends: list[tuple[torch.Tensor, dist.Work]] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, self.ranks[dst], group=self.groups[self.stage, dst])
        self.sends.append((tensor, work))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def recv(self, key, src: int) -> torch.Tensor:
        while key not in self.posted:
            next_key, shape = self.expect[src].popleft()
            buf = torch.empty(shape, device=self.device, dtype=torch.float32)
            self.posted[next_key] = (buf, dist.irecv(buf, self.ranks[src], group=self.groups[src, self.stage]))
        buf, work = self.posted.pop(key)
        # timed: sync the compute stream only (a device-wide sync would also wait for the receives
        # already posted on NCCL's stream, and count the wait before the clock starts)
        if self.timed and buf.is_cuda:  # the compute queued so far is not waiting
            torch.cuda.current_stream(buf.device).synchronize()
        start = time.perf_counter()
        work.wait()
        if self.timed and buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        self.wait_s += time.perf_counter() - start
        return buf

    def finish(self) -> None:
        """End a run: every expected message was received; wait for this rank's sends."""
        left = [k for q in self.expect.values() for k, _ in q] + list(self.posted)
        if left:
            raise RuntimeError(f"pipeline run ended with messages not received: {left}")
        start = time.perf_counter()
        for _, work in self.sends:
            work.wait()
        self.wait_s += time.perf_counter() - start
        self.sends = []
