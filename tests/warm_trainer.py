"""``python -m k3train.train`` without the import cost: trainer processes forked from a warm server.

Every trainer process the tests start spends about 6 s of CPU importing torch, Megatron-Core, Hydra and
k3train before its first step, and a 6-step k3_tiny run takes about 12 s in all; on CI's 2 cores the
imports were over a third of the suite. Here the processes come from multiprocessing's ``forkserver``,
which imports those modules once per pytest worker and then forks a fresh child for each run. The
child is a new process (own pid, memory, signal handlers, exit code); it sets the run's environment,
folder, argv and stdout/stderr files, and runs ``k3train.train`` as ``__main__``, as ``python -m``
would. Multi-rank runs fork one child per rank with the variables ``torchrun`` sets; the parent holds
the rendezvous store (a TCPStore on a port the OS picks, which the ranks join as torchrun's workers
join their agent's), so no port is picked and then raced for.

What a fork cannot change after the imports makes a run fall back to a real subprocess
(``can_fork``): an environment that sets ``PYTHONHASHSEED`` or anything else besides
``OMP_NUM_THREADS``, or a ``TRITON_INTERPRET`` other than the server's. Tests of the launcher, of
signals and of crashes start real processes themselves.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from subprocess import CompletedProcess

PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing", "hydra",
           "omegaconf", "k3train.training.loop", "k3train.training.checkpoint"]
FORKABLE_ENV = {"OMP_NUM_THREADS"}  # what the child can still apply after the server's imports
_server: dict = {}


def preload_forkserver():
    """The forkserver context, its server's preloads set (the server starts on the first process; every
    ``forkserver`` context of this process shares it, e.g. ``tests/multiprocess.py``'s ranks)."""
    if not _server:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _server.update(ctx=ctx, triton_interpret=os.environ.get("TRITON_INTERPRET"))
    return _server["ctx"]


def can_fork(extra_env: dict[str, str]) -> bool:
    """Whether a forked child would run as a fresh ``python`` with ``extra_env`` on top of os.environ."""
    preload_forkserver()
    return (set(extra_env) <= FORKABLE_ENV
            and os.environ.get("TRITON_INTERPRET") == _server["triton_interpret"])


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: become ``python -m k3train.train *argv`` with ``env`` in ``cwd``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = ["k3train.train", *argv]
    code = 0
    try:
        runpy.run_module("k3train.train", run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # as the interpreter turns sys.exit(x) into an exit status
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback and status 1, as python does
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # multiprocessing's children leave through os._exit, which skips them
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun gives a worker on one node, joining the agent's store."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")


def run_trainer(argv: list[str], env: dict[str, str], cwd: Path, nproc: int = 1,
                timeout: float = 600) -> CompletedProcess:
    """``python -m k3train.train *argv`` on ``nproc`` forked ranks with ``env`` (the whole environment):
    a CompletedProcess with the exit status (the first failing rank's, or 0) and the ranks' stdout and
    stderr, rank after rank. A rank that fails stops the others after 30 s, as torchrun's agent
    does; past ``timeout`` all are killed and the status is -9."""
    import torch.distributed as dist

    ctx = preload_forkserver()
    store = None
    if nproc > 1:
        store = dist.TCPStore("127.0.0.1", 0, nproc, True, timedelta(seconds=timeout), wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        procs, files = [], []
        for rank in range(nproc):
            rank_env = dict(env, **(_rank_env(rank, nproc, store.port) if store else {}))
            out, err = (os.path.join(tmp, f"{rank}.{kind}") for kind in ("out", "err"))
            files.append((out, err))
            procs.append(ctx.Process(target=_child, args=(argv, rank_env, str(cwd), out, err),
                                     name=f"k3train-test-rank{rank}"))
            procs[-1].start()
        code = _wait(procs, time.monotonic() + timeout)
        stdout, stderr = ("".join(Path(f[i]).read_text(errors="replace") if os.path.exists(f[i]) else ""
                                  for f in files) for i in (0, 1))
    return CompletedProcess(["k3train.train", *argv], code, stdout, stderr)


def _wait(procs, deadline: float) -> int:
    """Join the ranks: the first nonzero status, after giving the others 30 s to finish."""
    failed_at, timed_out = None, False
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        timed_out = now > deadline
        if timed_out or (failed_at is not None and now > failed_at + 30):
            for p in procs:
                if p.is_alive():
                    p.kill()
        time.sleep(0.05)
    for p in procs:
        p.join()
    return -9 if timed_out else next((p.exitcode for p in procs if p.exitcode != 0), 0)
