"""Launch scripts: syntax, dry runs, a real 2-process torchrun on CPU, wheelhouse helpers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
SCRIPTS = ["setup_env.sh", "torchrun.sh", "slurm.sbatch", "build_wheelhouse.sh"]


def _run(cmd, env=None, **kw):
    e = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=kw.pop("timeout", 120), **kw)


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse_and_are_executable(name):
    path = LAUNCH / name
    assert os.access(path, os.X_OK), f"{path} is not executable"
    r = _run(["bash", "-n", str(path)])
    assert r.returncode == 0, r.stderr


def test_torchrun_dry_run_and_bad_nproc():
    r = _run([str(LAUNCH / "torchrun.sh"), "model=k3_tiny", "train.steps=5"], {"K3_DRY_RUN": "1", "NPROC": "2"})
    assert r.returncode == 0, r.stderr
    assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m k3train.train model=k3_tiny train.steps=5" in r.stdout
    r = _run([str(LAUNCH / "torchrun.sh")], {"K3_DRY_RUN": "1", "NPROC": "two"})
    assert r.returncode == 2 and "NPROC must be a positive integer" in r.stderr
    r = _run([str(LAUNCH / "torchrun.sh")], {"K3_DRY_RUN": "1", "NPROC": "2", "MASTER_PORT": "29611"})
    assert "--master-port 29611" in r.stdout and "--standalone" not in r.stdout


def test_torchrun_starts_two_cpu_processes(tmp_path):
    probe = tmp_path / "k3probe.py"
    # One write per line: the two ranks share the pipe, and print() writes each argument separately.
    probe.write_text("import os, sys\nos.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
                     "threads {os.environ['OMP_NUM_THREADS']} args {' '.join(sys.argv[1:])}\\n\".encode())\n")
    env = {"NPROC": "2", "K3_ENTRY": "k3probe", "PYTHONPATH": str(tmp_path), "VENV": str(Path(sys.executable).parent.parent)}
    r = _run([str(LAUNCH / "torchrun.sh"), "a=1"], env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("rank"))
    assert [line.split()[:4] for line in lines] == [["rank", "0", "of", "2"], ["rank", "1", "of", "2"]]
    assert all(line.endswith("args a=1") for line in lines)


def test_slurm_dry_run(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    # A long host list: the first host must be taken without closing scontrol's pipe early
    # (under pipefail, `| head -n 1` failed the job with exit 141 when it did).
    (fake / "scontrol").write_text("#!/bin/sh\necho nodeA\nseq 1 100000 | sed 's/^/node/'\n")
    (fake / "scontrol").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[A-B]", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_GPUS_ON_NODE": "4",
           "K3_DRY_RUN": "1"}
    r = _run(["bash", str(LAUNCH / "slurm.sbatch"), "model=k3_tiny"], env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("srun ") and "--nnodes 2 --nproc-per-node 4" in out
    assert "--rdzv-backend c10d --rdzv-endpoint nodeA:29500" in out and "--rdzv-id 77" in out
    assert out.strip().endswith("-m k3train.train model=k3_tiny")
    env.pop("SLURM_JOB_ID")
    r = _run(["bash", str(LAUNCH / "slurm.sbatch")], {k: v for k, v in env.items()} | {"SLURM_JOB_ID": ""})
    assert r.returncode == 2 and "not inside a SLURM job" in r.stderr


def test_setup_env_dry_run(tmp_path):
    venv = tmp_path / "venv"
    r = _run([str(LAUNCH / "setup_env.sh")], {"VENV": str(venv), "K3_DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    assert "-m venv" in r.stdout and "pip install torch==2.13.0" in r.stdout and f"pip install -e {REPO}[dev]" in r.stdout
    lock = f"-c {REPO / 'requirements.lock'}"
    assert all(lock in line for line in r.stdout.splitlines() if "pip install" in line), r.stdout
    assert not venv.exists()
    r = _run([str(LAUNCH / "setup_env.sh")], {"VENV": str(venv), "K3_DRY_RUN": "1", "K3_LOCK": ""})
    assert r.returncode == 0 and "pip install" in r.stdout and " -c " not in r.stdout, r.stdout
    r = _run([str(LAUNCH / "setup_env.sh")], {"VENV": str(venv), "K3_DRY_RUN": "1", "K3_LOCK": str(tmp_path / "no")})
    assert r.returncode == 2 and "K3_LOCK" in r.stderr
    (tmp_path / "broken").mkdir()
    r = _run([str(LAUNCH / "setup_env.sh")], {"VENV": str(tmp_path / "broken")})
    assert r.returncode == 2 and "has no bin/python" in r.stderr


def _wheelhouse_module():
    spec = importlib.util.spec_from_file_location("build_wheelhouse", LAUNCH / "build_wheelhouse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_wheelhouse_helpers():
    wh = _wheelhouse_module()
    tags = wh.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux1_x86_64" in tags
    env = wh.marker_env("3.12", "manylinux_2_28_x86_64")
    assert env["python_version"] == "3.12" and env["platform_machine"] == "x86_64" and env["sys_platform"] == "linux"
    allowed = wh.target_tags("3.12", tags)
    assert "cp312-cp312-manylinux_2_17_x86_64" in allowed and "cp310-abi3-manylinux2014_x86_64" in allowed
    assert "py3-none-any" in allowed and "cp311-cp311-manylinux_2_17_x86_64" not in allowed
    assert wh.excluded("nvidia-cudnn-cu12", ["torch", "nvidia-*"]) and wh.excluded("torch", ["torch"])
    assert not wh.excluded("torchvision", ["torch"])
    from packaging.requirements import Requirement

    assert wh.wanted(Requirement('x; python_version >= "3.12"'), env, set())
    assert not wh.wanted(Requirement('x; python_version < "3.12"'), env, set())
    assert wh.wanted(Requirement('x; extra == "bench"'), env, {"bench"})
    assert not wh.wanted(Requirement('x; extra == "bench"'), env, set())


def test_lock_is_the_installed_dependency_set():
    """requirements.lock pins k3train's dependencies at the versions installed here (where the tests run)."""
    from importlib import metadata

    from packaging.version import Version

    spec = importlib.util.spec_from_file_location("lock", LAUNCH / "lock.py")
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    pins = _wheelhouse_module().read_lock(REPO / "requirements.lock")
    assert {"megatron-core", "torch", "hydra-core", "antlr4-python3-runtime", "pytest"} <= set(pins)
    assert not {"pip", "setuptools", "k3train"} & set(pins)
    reached, _ = lock.closure(lock.installed())
    for name, version in pins.items():
        assert name in reached, f"{name} is pinned but k3train does not depend on it"
        assert Version(Version(metadata.version(name)).public) == version, (name, metadata.version(name), version)


def test_wheelhouse_lock_errors(tmp_path):
    from packaging.requirements import Requirement

    wh = _wheelhouse_module()
    good = tmp_path / "good.lock"
    good.write_text("# comment\nMegatron_Core==0.16.1  # pinned\n\nnumpy==2.4.6\n")
    pins = wh.read_lock(good)
    assert {n: str(v) for n, v in pins.items()} == {"megatron-core": "0.16.1", "numpy": "2.4.6"}
    assert str(wh.locked_version(pins, Requirement("megatron-core>=0.16,<0.20"), "k3train", good)) == "0.16.1"
    for req in ("megatron-core>=0.17", "safetensors"):  # excluded by the requirement, not pinned
        with pytest.raises(SystemExit):
            wh.locked_version(pins, Requirement(req), "k3train", good)
    bad = tmp_path / "bad.lock"
    bad.write_text("numpy>=2\n")
    with pytest.raises(SystemExit):
        wh.read_lock(bad)


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str], extras: tuple[str, ...] = ()) -> Path:
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = [f"Name: {name}", f"Version: {version}", *(f"Provides-Extra: {e}" for e in extras),
            *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\n" + "\n".join(meta) + "\n")
    return path


def test_wheelhouse_takes_the_locked_versions(tmp_path, monkeypatch, capsys):
    """The walk, offline: wheels already in --out are used as pip would download them. Locked versions
    only (a newer wheel in --out is ignored), extras followed, torch and what only torch needs left out."""
    wh = _wheelhouse_module()
    out = tmp_path / "wh"
    out.mkdir()
    k3 = _fake_wheel(out, "k3train", "0.1.0", ["alpha>=1", "torch>=2.6", 'gamma; python_version < "3.0"'])
    _fake_wheel(out, "alpha", "1.2", ["beta[fast]"])
    _fake_wheel(out, "alpha", "1.5", [])  # newer, not the locked one
    _fake_wheel(out, "beta", "2.0", ['delta; extra == "fast"'], extras=("fast",))
    _fake_wheel(out, "delta", "0.3", [])
    _fake_wheel(out, "stale", "9.9", [])
    lock = tmp_path / "requirements.lock"
    lock.write_text("alpha==1.2\nbeta==2.0\ndelta==0.3\nsympy==1.14.0\n")
    monkeypatch.setattr(wh, "build_k3train_wheel", lambda _out: k3)
    assert wh.main(["--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--out", str(out),
                    "--lock", str(lock)]) == 0
    assert (out / "requirements.txt").read_text().split() == ["alpha==1.2", "beta==2.0", "delta==0.3"]
    assert sorted(p.name for p in out.glob("*.whl")) == [
        "alpha-1.2-py3-none-any.whl", "beta-2.0-py3-none-any.whl", "delta-0.3-py3-none-any.whl",
        "k3train-0.1.0-py3-none-any.whl"]
    assert "excluded (the target must have them): torch" in capsys.readouterr().out
    lock.write_text("alpha==1.2\nbeta==2.0\n")  # delta missing: an error naming it and its dependent
    with pytest.raises(SystemExit):
        wh.main(["--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--out", str(out),
                 "--lock", str(lock)])
    assert "delta (needed by beta" in capsys.readouterr().err


def test_wheelhouse_help_and_bad_args():
    r = _run([sys.executable, str(LAUNCH / "build_wheelhouse.py"), "--help"])
    assert r.returncode == 0 and "--python-version" in r.stdout and "--exclude" in r.stdout
    r = _run([sys.executable, str(LAUNCH / "build_wheelhouse.py"), "--python-version", "twelve",
              "--platform", "manylinux_2_28_x86_64", "--out", "/tmp/unused-wheelhouse"])
    assert r.returncode == 2 and "--python-version must look like 3.12" in r.stderr


@pytest.mark.slow
def test_wheelhouse_builds_for_python312(tmp_path):
    """The real thing: resolves and downloads from the package index (1-2 minutes)."""
    if os.environ.get("K3_TEST_WHEELHOUSE") != "1":
        pytest.skip("needs the package index and 1-2 minutes; run with K3_TEST_WHEELHOUSE=1")
    out = tmp_path / "wh"
    r = _run([sys.executable, str(LAUNCH / "build_wheelhouse.py"), "--python-version", "3.12",
              "--platform", "manylinux_2_28_x86_64", "--out", str(out)], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in out.glob("*.whl"))
    assert any(n.startswith("k3train-") for n in names)
    assert any(n.startswith("megatron_core-") and "cp312" in n for n in names)
    assert any(n.startswith("antlr4_python3_runtime-") and n.endswith("none-any.whl") for n in names)
    assert not any(n.startswith(("torch-", "triton-", "nvidia_")) for n in names)
    assert "megatron-core==0.16.1" in (out / "requirements.txt").read_text()  # the lock's version
    assert sum(p.stat().st_size for p in out.glob("*.whl")) < 64 * 2**20
