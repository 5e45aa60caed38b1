"""Issue 14 item 6: a rank killed with kill -9 in a 2-rank gloo run (launch/torchrun.sh, async checkpoints).

- the job ends promptly (torchrun stops the other rank; a rank that hangs instead would fail after
  train.collective_timeout_s) with a non-zero status;
- no process the job started survives it (Megatron-Core's checkpoint writer used to leave its
  multiprocessing Manager and resource tracker behind);
- the resume from the last checkpoint trains the steps the killed run had trained after it with
  bit-identical losses.

And the mechanism behind train.collective_timeout_s: a gloo all-reduce waiting for a hung rank fails; and
a crash below Python (a segmentation fault) prints the run's Python stacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import psutil

from test_training_helpers import FAST, REPO, losses


def _logged_steps(run) -> list[int]:
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []
    return [r["step"] for r in rows if r["kind"] == "train"]


def _latest(run) -> int:
    pointer = run / "checkpoints" / "latest"
    return int(pointer.read_text().split("_")[-1]) if pointer.exists() else 0


def _launch(run, log, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, NPROC="2", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen(["bash", str(REPO / "launch" / "torchrun.sh"), *FAST, f"train.out_dir={run}",
                             "train.steps=40", "train.save_every=4", "train.log_every=1", "train.async_save=true",
                             "train.collective_timeout_s=30", *overrides],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _rank(procs: dict, rank: int) -> psutil.Process:
    for p in procs.values():
        try:
            if p.environ().get("RANK") == str(rank) and "k3train.train" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    raise AssertionError(f"no process of rank {rank} among {list(procs)}")


def test_killed_rank_ends_the_job_and_the_resume_continues(tmp_path):
    run = tmp_path / "run"
    with open(tmp_path / "job.log", "w") as log:
        job = _launch(run, log)
        seen: dict[int, psutil.Process] = {}  # every process the job started, while it runs
        deadline = time.monotonic() + 300
        while True:
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            for p in psutil.Process(job.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
            steps, latest = _logged_steps(run), _latest(run)
            if latest and steps and max(steps) >= latest + 2:  # trained past a checkpoint, before the next save
                break
            time.sleep(0.1)
        _rank(seen, 1).kill()
        killed_at = time.monotonic()
        status = job.wait(timeout=120)
        ended_after = time.monotonic() - killed_at
    output = (tmp_path / "job.log").read_text()
    assert status != 0 and ended_after < 30, (status, ended_after, output[-3000:])

    time.sleep(2)  # the writer processes die with their rank
    alive = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]

    resume_from = _latest(run)
    before = losses(run)
    overlap = [s for s in before if s > resume_from]
    assert resume_from >= 4 and overlap, (resume_from, sorted(before))
    with open(tmp_path / "resume.log", "w") as log:
        status = _launch(run, log, f"train.exit_after_steps={max(overlap) - resume_from}").wait(timeout=300)
    assert status == 0, (tmp_path / "resume.log").read_text()[-3000:]
    after = losses(run)
    for step in overlap:
        assert after[step] == before[step], (step, before[step], after[step])


def _hang(rank: int, world: int, store: str, flag: str, timings: str) -> None:
    """Rank 1 never joins the all-reduce; it waits (20 s at most) until rank 0 has given up."""
    import torch
    import torch.distributed as dist

    from k3train.training.collective_timeout import set_collective_timeout

    # a file rendezvous, not a port picked beforehand (another test may bind it first: EADDRINUSE in CI)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        assert set_collective_timeout([None], 1.0) == 1
        if rank == 0:
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1))
                raised = False
            except RuntimeError:
                raised = True
            with open(timings, "w") as f:
                json.dump({"raised": raised, "seconds": time.monotonic() - start}, f)
            open(flag, "w").close()
        else:
            deadline = time.monotonic() + 20
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        dist.destroy_process_group()


def test_collective_timeout_fails_a_wait_for_a_hung_rank(tmp_path):
    import torch.multiprocessing as mp

    timings = tmp_path / "timings.json"
    mp.spawn(_hang, args=(2, str(tmp_path / "store"), str(tmp_path / "done"), str(timings)), nprocs=2, join=True)
    result = json.loads(timings.read_text())
    assert result["raised"] and result["seconds"] < 8, result  # without the timeout: 20 s, when rank 1 leaves


def test_a_crash_below_python_prints_where_the_run_was(tmp_path):
    """A segmentation fault (here delivered as SIGSEGV once training is under way) prints every thread's
    Python stack (faulthandler) instead of dying silently with exit 139."""
    import signal
    import sys

    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen([sys.executable, "-m", "k3train.train", *FAST, f"train.out_dir={run}",
                                "train.steps=100000", "train.log_every=1", "train.save_every=0"],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not _logged_steps(run):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGSEGV)
        status = job.wait(timeout=60)
    output = (tmp_path / "job.log").read_text()
    assert status == -signal.SIGSEGV, (status, output[-3000:])
    assert "Fatal Python error: Segmentation fault" in output, output[-3000:]
    assert "k3train/training/" in output, output[-3000:]  # the main thread's stack, inside the loop
