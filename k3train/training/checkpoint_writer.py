"""Writing a checkpoint's shards: in the call (sync), or in a forked writer process while training goes on (async).

Megatron-Core's ``dist_checkpointing.save(..., async_sharded_save=True)`` returns an ``AsyncRequest``:
``preload_fn`` stages the shards in host memory, ``async_fn`` writes them, and ``finalize_fns`` (run on
every rank once every rank has written) write the global metadata; ``save_checkpoint`` appends its own
(checksums, rename into place, ``latest``), so nothing names a checkpoint before its files are complete.

- sync (``train.async_save=false``): stage, write, finalize, all in ``submit``.
- async: ``submit`` stages, then forks one writer process. Its copy-on-write view of host memory is the
  snapshot of the state at the save (``preload_fn`` already copied CUDA tensors to the host), so the
  optimizer may update the parameters at once. ``finalize`` (the trainer calls it once every rank's
  writer is done, and before the next save, at the end of the run and on a stop) waits for the
  writer and runs the finalize functions.

No process outlives the trainer (issue 14): Megatron-Core hands write results back through a
``multiprocessing.Manager`` queue of the spawn method, a server process plus a resource tracker
that stay alive after a kill -9 of the trainer. Here the results go through an in-process
``queue.Queue`` (installed as Megatron's module-level results queue); the forked writer sends its
results over a pipe and is killed with the trainer (``PR_SET_PDEATHSIG``). Megatron's own async
callers (``AsyncCallsQueue``) put their flags in CUDA tensors, so they do not run on CPU hosts.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
from typing import Optional

from k3train.training.threads import single_intra_op_thread

_PR_SET_PDEATHSIG = 1


def use_in_process_results_queue() -> queue.Queue:
    """Make Megatron-Core's checkpoint writer report to a ``queue.Queue`` instead of starting a Manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()
    results = filesystem_async._results_queue
    while not results.empty():  # a failed save may have left its result behind
        results.get_nowait()
    return results


def _die_with(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; leave at once if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the writer ends by itself when its files are written
        pass
    if os.getppid() != parent:
        os._exit(1)


def _write(async_fn, args: list, kwargs: dict, conn, parent: int) -> None:
    """The forked writer: write the shards, send Megatron's write results (or the error) to the trainer."""
    _die_with(parent)
    # Ctrl-C reaches the whole process group; the trainer decides (first: finish and save, second: kill us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        async_fn(*args, **kwargs)
        result = args[2].get_nowait()  # what write_preloaded_data_multiproc put in the results queue
    except BaseException as err:  # noqa: BLE001 - any failure becomes the save's error on every rank
        result = RuntimeError(f"checkpoint writer failed: {type(err).__name__}: {err}")
    conn.send(result)
    conn.close()


class CheckpointWriter:
    """Runs the ``AsyncRequest`` of one checkpoint save at a time (see the module docstring)."""

    def __init__(self, asynchronous: bool = False):
        self.asynchronous = asynchronous
        self._request = None
        self._process: Optional[mp.Process] = None
        self._conn = None

    @property
    def pending(self) -> bool:
        """A save was submitted and is not finalized yet."""
        return self._request is not None

    def written(self) -> bool:
        """This rank's files of the pending save are on disk (or nothing is pending); no collective."""
        return self._conn is None or self._conn.poll()

    @single_intra_op_thread()
    def submit(self, request) -> None:
        """Write ``request`` (collective). Finalizes the previous save first."""
        self.finalize()
        if not self.asynchronous:
            request.execute_sync()
            return
        self._request = request
        if request.async_fn is None:  # nothing to write on this rank
            return
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()
        ctx = mp.get_context("fork")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_write, name="k3train-checkpoint-writer",
                                    args=(request.async_fn, args, request.async_fn_kwargs, child_end, os.getpid()))
        self._process.start()
        child_end.close()

    @single_intra_op_thread()
    def finalize(self) -> None:
        """Wait for this rank's writer, then run the finalize functions (collective; no-op when nothing is pending).

        A writer that failed or died makes the finalize raise on every rank; ``latest`` is not moved."""
        if self._request is None:
            return
        request, process, conn = self._request, self._process, self._conn
        self._request = self._process = self._conn = None
        if process is not None:
            try:
                result = conn.recv()
            except EOFError:
                result = RuntimeError("the checkpoint writer process died before it reported")
            conn.close()
            process.join()
            request.async_fn_args[2].put(result)  # where Megatron's finalize reads it
        for fn in request.finalize_fns:
            fn()

    def abort(self) -> None:
        """Kill the writer of a pending save (its ``.tmp`` directory stays; ``latest`` is not moved)."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
        self._request = self._process = self._conn = None
