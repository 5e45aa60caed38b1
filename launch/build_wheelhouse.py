#!/usr/bin/env python3
"""Build a wheelhouse: every wheel an offline machine needs to install k3train.

    python launch/build_wheelhouse.py --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --out wheelhouse [--extras dev] [--exclude torch,triton,nvidia-*]

then, on the offline machine (which already has the excluded packages):

    pip install --no-index --find-links wheelhouse 'k3train[dev]'

What it does, with pip only (no resolving here: the versions are requirements.lock's, the ones the
test suite ran with; ``python launch/lock.py`` regenerates it):
  1. builds the k3train wheel from this checkout (``pip wheel --no-deps``, from a clean copy, so no
     build/ litter);
  2. walks k3train's requirements (with the extras, markers evaluated for the TARGET interpreter and
     platform): each package is fetched at its locked version with
     ``pip download --no-deps --only-binary=:all:``, and its Requires-Dist gives the next ones. A
     requirement the lock does not pin, or pins at a version the requirement excludes, is an error;
  3. skips excluded packages and everything reachable only through them (the GPU image's torch
     brings its own sympy, networkx, nvidia-* ...). Default excludes: torch, triton, nvidia-*.
     ``--exclude`` adds to them; ``--no-default-excludes`` drops them;
  4. a package that has only a source distribution (antlr4-python3-runtime, needed by omegaconf)
     is built into a wheel by ``pip wheel``, accepted only if it is pure Python;
  5. removes other wheels from DIR, writes DIR/requirements.txt (the pins used) and prints a size table.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_EXCLUDES = ("torch", "triton", "nvidia-*")
DEFAULT_LOCK = REPO / "requirements.lock"

try:
    from packaging.markers import Marker  # noqa: F401
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip always vendors a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None


def log(msg: str) -> None:
    print(f"[wheelhouse] {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    print(f"build_wheelhouse: error: {msg}", file=sys.stderr)
    sys.exit(2)


def platform_tags(platform: str) -> list[str]:
    """pip does not widen a manylinux tag to the older ones it implies; do it here."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    tags = [f"manylinux_{major}_{v}_{arch}" for v in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{arch}" for v, name in legacy.items() if v <= minor and major == 2]
    return tags


def marker_env(python_version: str, platform: str) -> dict[str, str]:
    arch = re.sub(r"^(manylinux|musllinux)_\d+_\d+_|^manylinux\d+_|^linux_", "", platform)
    full = python_version if python_version.count(".") >= 2 else python_version + ".0"
    short = ".".join(full.split(".")[:2])
    linux = "linux" in platform
    return {
        "python_version": short, "python_full_version": full, "implementation_name": "cpython",
        "implementation_version": full, "platform_python_implementation": "CPython",
        "os_name": "posix" if linux else "nt", "sys_platform": "linux" if linux else platform,
        "platform_system": "Linux" if linux else "", "platform_machine": arch, "platform_release": "",
        "platform_version": "", "extra": "",
    }


def wanted(req: Requirement, env: dict, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(env, extra=e)) for e in (extras or {""}) | {""})


def excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, canonicalize_name(p).replace("_", "-")) for p in patterns)


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def run_pip(args: list[str], quiet: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    if quiet:
        cmd.insert(3, "-q")
    return subprocess.run(cmd, capture_output=True, text=True)


def build_k3train_wheel(out: Path) -> Path:
    """Build from a clean copy of the checkout: setuptools leaves build/ behind otherwise."""
    with tempfile.TemporaryDirectory(prefix="k3train-src-") as tmp:
        src = Path(tmp) / "src"
        ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", "runs",
                                        "outputs", "wheelhouse", ".whl", ".cache", "wandb", ".pytest_cache")
        shutil.copytree(REPO, src, ignore=ignore, symlinks=True)
        for old in out.glob("k3train-*.whl"):
            old.unlink()
        r = run_pip(["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)])
        if r.returncode != 0:  # no setuptools here: let pip fetch the build backend
            r = run_pip(["wheel", "--no-deps", "-w", str(out), str(src)])
        if r.returncode != 0:
            die(f"building the k3train wheel failed:\n{r.stderr[-2000:]}")
    wheels = sorted(out.glob("k3train-*.whl"))
    if not wheels:
        die("pip wheel produced no k3train wheel")
    return wheels[-1]


def find_wheel(out: Path, name: str, spec: SpecifierSet, allowed_tags: set[str]) -> Path | None:
    """The newest wheel in ``out`` for ``name`` that satisfies ``spec`` and the target tags."""
    best = None
    for f in out.glob("*.whl"):
        try:
            wname, ver, _, tags = parse_wheel_filename(f.name)
        except Exception:
            continue
        if wname != name or not spec.contains(ver, prereleases=True):
            continue
        if not any(str(t) in allowed_tags for t in tags):
            continue
        if best is None or ver > best[0]:
            best = (ver, f)
    return best[1] if best else None


def target_tags(python_version: str, platforms: list[str]) -> set[str]:
    """The wheel tags the target interpreter accepts (CPython)."""
    nodot = "".join(python_version.split(".")[:2])
    minor = int(python_version.split(".")[1])
    tags = set()
    plats = platforms + ["any"]
    for plat in plats:
        if plat != "any":
            tags.add(f"cp{nodot}-cp{nodot}-{plat}")
            for m in range(2, minor + 1):
                tags.add(f"cp3{m}-abi3-{plat}")
            tags.add(f"cp{nodot}-none-{plat}")
            for m in range(0, minor + 1):
                tags.add(f"py3{m}-none-{plat}")
            tags.add(f"py3-none-{plat}")
        else:
            for py in (f"py{nodot}", "py3", f"cp{nodot}", *(f"py3{m}" for m in range(0, minor + 1)), "py2.py3"):
                tags.add(f"{py}-none-any")
    return tags


def read_lock(path: Path) -> dict[str, Version]:
    """``name==version`` lines of a lock (comments and blank lines skipped) as name -> version."""
    if not path.is_file():
        die(f"{path} does not exist; write it with: python launch/lock.py (in the venv the tests passed in)")
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or req.marker is not None:
            die(f"{path}:{n}: {line!r} is not a name==version pin")
        pins[canonicalize_name(req.name)] = Version(spec[0].version)
    return pins


def locked_version(pins: dict[str, Version], req: Requirement, needed_by: str, lock: Path) -> Version:
    """The lock's version of ``req``; an error when the lock lacks it or pins one ``req`` excludes."""
    name = canonicalize_name(req.name)
    if name not in pins:
        die(f"{name} (needed by {needed_by} on the target) is not in {lock}; regenerate the lock with "
            f"python launch/lock.py in a venv that has it")
    if not req.specifier.contains(pins[name], prereleases=True):
        die(f"{lock} pins {name}=={pins[name]} but {needed_by} needs {name}{req.specifier}; regenerate the lock")
    return pins[name]


def fetch(out: Path, name: str, version: Version, python_version: str, platforms: list[str], allowed: set[str],
          tmp: Path) -> Path:
    """The target's wheel of ``name==version`` in ``out``: already there, downloaded, or built (pure Python)."""
    spec = SpecifierSet(f"=={version}")
    w = find_wheel(out, name, spec, allowed)
    if w is not None:  # re-runs are cheap
        return w
    cmd = ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "-d", str(out)]
    for p in platforms:
        cmd += ["--platform", p]
    log(f"download {name}=={version}")
    r = run_pip(cmd + [f"{name}=={version}"])
    if r.returncode != 0:
        log(f"{name}=={version}: no wheel for the target, building one from source")
        r2 = run_pip(["wheel", "--no-deps", "--no-binary", name, "-w", str(tmp), f"{name}=={version}"])
        built = [f for f in tmp.glob("*.whl") if parse_wheel_filename(f.name)[0] == name]
        if r2.returncode != 0 or not built:
            die(f"no wheel of {name}=={version} for Python {python_version} / {platforms[0]}, and building one "
                f"failed:\n{(r.stderr or r2.stderr)[-1500:]}")
        tags = {str(t) for t in parse_wheel_filename(built[0].name)[3]}
        if not any(t.endswith("-none-any") for t in tags):
            die(f"{name}=={version} has no wheel for the target and is not pure Python ({built[0].name})")
        shutil.move(str(built[0]), out / built[0].name)
    w = find_wheel(out, name, spec, allowed)
    if w is None:
        die(f"pip did not provide a wheel of {name}=={version} for the target")
    return w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--python-version", required=True, help="target interpreter, e.g. 3.12")
    ap.add_argument("--platform", required=True, help="target platform tag, e.g. manylinux_2_28_x86_64")
    ap.add_argument("--out", required=True, help="wheelhouse folder (created; other wheels in it are removed)")
    ap.add_argument("--extras", default="", help="k3train extras to include, comma separated (e.g. dev); their "
                                                 "packages must be in the lock")
    ap.add_argument("--exclude", default="", help="more packages the target already has (comma separated, globs)")
    ap.add_argument("--no-default-excludes", action="store_true", help=f"do not exclude {', '.join(DEFAULT_EXCLUDES)}")
    ap.add_argument("--lock", default=str(DEFAULT_LOCK), help="the pinned versions (default: %(default)s)")
    ap.add_argument("--keep-other-wheels", action="store_true", help="do not remove unrelated wheels from --out")
    args = ap.parse_args(argv)

    if not re.fullmatch(r"3\.\d+(\.\d+)?", args.python_version):
        die(f"--python-version must look like 3.12, got {args.python_version!r}")
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    extras = {e.strip() for e in args.extras.split(",") if e.strip()}
    patterns = ([] if args.no_default_excludes else list(DEFAULT_EXCLUDES)) + \
        [p.strip() for p in args.exclude.split(",") if p.strip()]
    platforms = platform_tags(args.platform)
    allowed = target_tags(args.python_version, platforms)
    env = marker_env(args.python_version, args.platform)

    log(f"target: CPython {args.python_version}, {args.platform}; extras: {sorted(extras) or 'none'}; "
        f"excluded: {', '.join(patterns) or 'nothing'}")
    k3 = build_k3train_wheel(out)
    log(f"built {k3.name}")

    # Known optional extras of k3train.
    if tomllib is not None:
        with open(REPO / "pyproject.toml", "rb") as f:
            opt = tomllib.load(f).get("project", {}).get("optional-dependencies", {})
        unknown = extras - set(opt)
        if unknown:
            die(f"unknown extra(s) {', '.join(sorted(unknown))}; k3train has: {', '.join(sorted(opt))}")

    lock = Path(args.lock).expanduser().resolve()
    pins = read_lock(lock)
    wants_extras: dict[str, set[str]] = {}
    skipped: set[str] = set()
    chosen: dict[str, Path] = {}
    pending = [(r, "k3train") for r in wheel_requires(k3) if wanted(r, env, extras)]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-build-") as tmpdir:
        while pending:
            req, needed_by = pending.pop()
            name = canonicalize_name(req.name)
            if excluded(name, patterns):
                skipped.add(name)
                continue
            version = locked_version(pins, req, needed_by, lock)
            new_extras = set(req.extras) - wants_extras.get(name, set())
            if name in chosen and not new_extras:
                continue
            wants_extras[name] = wants_extras.get(name, set()) | new_extras
            if name not in chosen:
                chosen[name] = fetch(out, name, version, args.python_version, platforms, allowed, Path(tmpdir))
            pending += [(r, name) for r in wheel_requires(chosen[name]) if wanted(r, env, wants_extras[name])]

    # The final set: the k3train wheel plus the chosen dependency wheels.
    final = {k3.name} | {w.name for w in chosen.values()}
    if not args.keep_other_wheels:
        for f in out.glob("*.whl"):
            if f.name not in final:
                f.unlink()
    lines = sorted(f"{n}=={_version(w)}" for n, w in chosen.items())
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")

    rows = sorted(((out / n).stat().st_size, n) for n in final)
    total = sum(s for s, _ in rows)
    width = max(len(n) for _, n in rows)
    print(f"{'wheel':<{width}}  {'MiB':>7}")
    for size, name in reversed(rows):
        print(f"{name:<{width}}  {size / 2**20:7.2f}")
    print(f"{'total (' + str(len(rows)) + ' wheels)':<{width}}  {total / 2**20:7.2f}")
    if skipped:
        print(f"excluded (the target must have them): {', '.join(sorted(skipped))}")
    spec = "k3train" + (f"[{','.join(sorted(extras))}]" if extras else "")
    print(f"install offline: pip install --no-index --find-links {out} '{spec}'")
    return 0


def _version(wheel: Path) -> Version:
    return parse_wheel_filename(wheel.name)[1]


if __name__ == "__main__":
    sys.exit(main())
