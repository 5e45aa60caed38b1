"""``train.collective_timeout_s`` on every process group of the run.

A rank that dies closes its sockets: gloo fails the peers' next collective at once and torchrun stops
the job. A rank that hangs (alive, never reaching the collective) is only caught by the peers'
collective timeout, by default 30 minutes for gloo (and Megatron-Core's groups) and 10 for NCCL.
The trainer sets its own on the default group and the TP, DP, EP, expert-DP, CP, DP×CP and PP groups, so such a
run fails after ``train.collective_timeout_s`` instead (through torch's ``_set_pg_timeout``: the
groups are created by ``k3train.parallel.state.init_parallel``, which takes no timeout).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Optional

import torch.distributed as dist


def set_collective_timeout(groups: Iterable[Optional[dist.ProcessGroup]], seconds: float) -> int:
    """Set the timeout of the default group and of each distinct group in ``groups`` (None entries are
    skipped); returns how many groups were set."""
    from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

    timeout = timedelta(seconds=seconds)
    distinct = {id(g): g for g in [_get_default_group(), *groups] if g is not None}
    for group in distinct.values():
        _set_pg_timeout(timeout, group)
    return len(distinct)
