#!/usr/bin/env python3
"""Build a wheelhouse: every wheel an offline machine needs to install k3train.

    python launch/build_wheelhouse.py --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --out wheelhouse [--extras bench] [--exclude torch,triton,nvidia-*]

then, on the offline machine (which already has the excluded packages):

    pip install --no-index --find-links wheelhouse 'k3train[bench]'

What it does:
  1. builds the k3train wheel from this checkout (a clean copy, so no build/ litter);
  2. walks k3train's dependencies (with the extras) for the TARGET interpreter and
     platform: each round downloads, with ``pip download --no-deps --only-binary=:all:``,
     the newest wheel that satisfies every requirement met so far, then reads its
     Requires-Dist (markers evaluated for the target) for the next round;
  3. skips excluded packages and everything reachable only through them (the GPU
     image's torch brings its own sympy, networkx, nvidia-* ...). Default excludes:
     torch, triton, nvidia-*. ``--exclude`` adds to them; ``--no-default-excludes``
     drops them;
  4. a package that has only a source distribution (antlr4-python3-runtime, needed by
     omegaconf) is built here into a wheel, which is accepted only if it is pure Python;
  5. by default keeps the versions installed in the running environment (the ones the
     CPU tests ran with, e.g. megatron-core 0.16.1) when the target has wheels of them;
     ``--newest`` takes the newest allowed instead;
  6. removes other wheels from DIR, writes DIR/requirements.txt (the pins) and prints a
     size table.

The resolver is greedy (newest version that satisfies the requirements seen so far,
re-picked if a later requirement excludes it); it is made for k3train's small tree and
says so when it cannot settle.
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
MAX_ROUNDS = 30

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


def _prefer_local(name: str, spec: SpecifierSet, enabled: bool) -> SpecifierSet:
    """``spec`` narrowed to the version installed in this environment, when it fits."""
    if not enabled:
        return spec
    from importlib import metadata

    try:
        local = Version(metadata.version(name))
    except Exception:
        return spec
    if local.local or not spec.contains(local, prereleases=True):  # e.g. torch 2.13.0+cpu
        return spec
    return spec & SpecifierSet(f"=={local}")


def fetch(out: Path, reqs: dict[str, SpecifierSet], python_version: str, platforms: list[str],
          allowed: set[str], tmp: Path, prefer_local: bool = True) -> dict[str, Path]:
    """Make sure a wheel for every requirement is in ``out``; return name -> wheel."""
    got, missing = {}, {}
    for name, spec in reqs.items():
        w = find_wheel(out, name, _prefer_local(name, spec, prefer_local), allowed) or \
            (None if prefer_local else find_wheel(out, name, spec, allowed))
        if w is not None:  # already in the wheelhouse: re-runs are cheap
            got[name] = w
        else:
            missing[name] = spec
    if missing:
        base = ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                "--implementation", "cp", "-d", str(out)]
        for p in platforms:
            base += ["--platform", p]
        specs = [f"{n}{_prefer_local(n, s, prefer_local)}" for n, s in missing.items()]
        log(f"download {' '.join(specs)}")
        r = run_pip(base + specs)
        if r.returncode != 0 and prefer_local:  # a local version may lack a wheel for the target
            pinned = [n for n, s in missing.items() if str(_prefer_local(n, s, True)) != str(s)]
            for n in pinned:
                if run_pip(base + [f"{n}{_prefer_local(n, missing[n], True)}"]).returncode != 0:
                    log(f"{n}: the version installed here has no wheel for the target; taking the newest")
            r = run_pip(base + [f"{n}{s}" for n, s in missing.items()
                                if find_wheel(out, n, s, allowed) is None])
        failed = list(missing) if r.returncode != 0 else []
        if failed and len(missing) > 1:  # find which ones have no wheel
            failed = [n for n, s in missing.items() if run_pip(base + [f"{n}{s}"]).returncode != 0]
        for name in failed:
            spec = missing[name]
            log(f"{name}{spec}: no wheel for the target, building one from source")
            r2 = run_pip(["wheel", "--no-deps", "--no-binary", name, "-w", str(tmp), f"{name}{spec}"])
            built = [f for f in tmp.glob("*.whl") if parse_wheel_filename(f.name)[0] == name]
            if r2.returncode != 0 or not built:
                die(f"no wheel of {name}{spec} for Python {python_version} / {platforms[0]}, and building "
                    f"one failed:\n{(r.stderr or r2.stderr)[-1500:]}")
            tags = {str(t) for t in parse_wheel_filename(built[0].name)[3]}
            if not any(t.endswith("-none-any") for t in tags):
                die(f"{name}{spec} has no wheel for the target and is not pure Python ({built[0].name})")
            shutil.move(str(built[0]), out / built[0].name)
        for name, spec in missing.items():
            w = find_wheel(out, name, spec, allowed)
            if w is None:
                die(f"pip did not provide a wheel of {name}{spec} for the target")
            got[name] = w
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--python-version", required=True, help="target interpreter, e.g. 3.12")
    ap.add_argument("--platform", required=True, help="target platform tag, e.g. manylinux_2_28_x86_64")
    ap.add_argument("--out", required=True, help="wheelhouse folder (created; other wheels in it are removed)")
    ap.add_argument("--extras", default="", help="k3train extras to include, comma separated (e.g. bench,dev)")
    ap.add_argument("--exclude", default="", help="more packages the target already has (comma separated, globs)")
    ap.add_argument("--no-default-excludes", action="store_true", help=f"do not exclude {', '.join(DEFAULT_EXCLUDES)}")
    ap.add_argument("--newest", action="store_true",
                    help="take the newest versions allowed; by default a dependency installed in the running "
                         "environment (the one the CPU tests use) keeps that version when it has a target wheel")
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

    specs: dict[str, SpecifierSet] = {}
    wants_extras: dict[str, set[str]] = {}
    skipped: set[str] = set()
    chosen: dict[str, Path] = {}
    pending = [r for r in wheel_requires(k3) if wanted(r, env, extras)]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-build-") as tmpdir:
        for _ in range(MAX_ROUNDS):
            if not pending:
                break
            refetch, expand = set(), set()
            for req in pending:
                name = canonicalize_name(req.name)
                if excluded(name, patterns):
                    skipped.add(name)
                    continue
                specs[name] = specs.get(name, SpecifierSet()) & req.specifier
                new_extras = set(req.extras) - wants_extras.setdefault(name, set())
                wants_extras[name] |= new_extras
                if name not in chosen or not specs[name].contains(_version(chosen[name]), prereleases=True):
                    refetch.add(name)
                elif new_extras:
                    expand.add(name)
            if refetch:
                chosen.update(fetch(out, {n: specs[n] for n in sorted(refetch)}, args.python_version, platforms,
                                    allowed, Path(tmpdir), prefer_local=not args.newest))
            pending = [r for n in sorted(refetch | expand) for r in wheel_requires(chosen[n])
                       if wanted(r, env, wants_extras[n])]
        else:
            die(f"dependency walk did not settle after {MAX_ROUNDS} rounds")

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
