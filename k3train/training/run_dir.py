"""Run-directory safety: one trainer per ``train.out_dir``, and no silent overwrite of a run.

``RunDirLock`` holds ``<out_dir>/.lock`` (the holder's pid and host, created atomically) while a
trainer runs. A second trainer refuses, naming the holder; a lock left by a process that no longer
exists on this host is taken over with a warning (one on another host cannot be checked, so it is
refused: delete the file if that job is gone). ``check_no_overwrite`` refuses ``train.resume=none``
on a directory that already holds checkpoints.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

LOCK = ".lock"


class RunDirError(RuntimeError):
    """The run directory is in use or holds a run that would be overwritten (one-line message)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        return True

    def acquire(self) -> None:
        """Take the lock, or raise ``RunDirError`` naming the process that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # another process may release or take over between our steps
            if self._create():
                self.held = True
                return
            try:
                holder = json.loads(self.path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                pid, host = -1, "?"
            here = socket.gethostname()
            if host == here and pid == os.getpid():  # ours (a second Trainer in this process)
                self.held = True
                return
            if host == here and (pid <= 0 or not _alive(pid)):
                print(f"k3train: warning: taking over the lock {self.path} of pid {pid}, which no longer runs "
                      f"on {host}", file=sys.stderr, flush=True)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            raise RunDirError(f"run directory {self.path.parent} is in use by pid {pid} on host {host} (lock "
                              f"{self.path}); wait for it, set another train.out_dir, or delete the lock if that "
                              f"process is gone")
        raise RunDirError(f"could not take the lock {self.path}: other processes keep taking it; set another "
                          f"train.out_dir")

    def release(self) -> None:
        """Remove the lock if this process holds it (safe to call twice)."""
        if not self.held:
            return
        self.held = False
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError):
            pass


def check_no_overwrite(run_dir: Path, resume: str) -> None:
    """Refuse ``train.resume=none`` where checkpoints of an earlier run exist."""
    if resume != "none":
        return
    ckpts = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*") if p.is_dir())
    if ckpts:
        raise RunDirError(f"train.out_dir={run_dir} already holds checkpoints (newest {ckpts[-1]}) and "
                          f"train.resume=none would overwrite them; use train.resume=auto to continue that run, "
                          f"or set another train.out_dir")
