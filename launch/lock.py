#!/usr/bin/env python3
"""Write requirements.lock: the installed versions of k3train's dependencies in this environment.

    python launch/lock.py [--out requirements.lock]      # in the venv the test suite passed in

It walks the installed metadata (Requires-Dist, markers evaluated here) from k3train with all its
extras and pins every installed package it reaches, ``name==version``. A local version tag is
dropped (torch ``2.13.0+cpu`` -> ``2.13.0``: a CUDA build of the same version satisfies it);
pip, setuptools and wheel are left out (build tools). Requirements that are not installed here
(an extra's GPU packages) are listed in a trailing comment, unpinned.

The lock is a pip constraints file: ``launch/setup_env.sh`` installs with ``-c requirements.lock``
and ``launch/build_wheelhouse.py`` downloads exactly its versions.
"""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always vendors a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
ROOT = "k3train"
TOOLS = {"pip", "setuptools", "wheel"}


def installed() -> dict[str, metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}


def closure(dists: dict[str, metadata.Distribution], root: str = ROOT) -> tuple[dict[str, str], set[str]]:
    """(name -> installed version, for every package ``root`` with all extras reaches; names not installed)."""
    root_dist = dists.get(root)
    if root_dist is None:
        sys.exit(f"lock: error: {root} is not installed in {sys.prefix}; run launch/setup_env.sh first")
    extras = {root: set(root_dist.metadata.get_all("Provides-Extra") or [])}
    todo, missing = [root], set()
    while todo:
        name = todo.pop()
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras[name] | {""}):
                continue
            dep = canonicalize_name(req.name)
            if dep not in dists:
                missing.add(dep)
                continue
            new = set(req.extras) - extras.get(dep, set())
            if dep not in extras or new:
                extras[dep] = extras.get(dep, set()) | new
                todo.append(dep)
    pins = {n: Version(dists[n].version).public for n in extras if n != root and n not in TOOLS}
    return pins, missing


def render(pins: dict[str, str], missing: set[str]) -> str:
    head = [f"# The versions the k3train test suite ran with (Python {platform.python_version()}, "
            f"{platform.system()} {platform.machine()}).",
            "# Regenerate with: python launch/lock.py   (in the venv the tests passed in)",
            "# A pip constraints file: launch/setup_env.sh and launch/build_wheelhouse.py use it."]
    body = [f"{n}=={v}" for n, v in sorted(pins.items())]
    tail = [f"# not installed when this was written, so not pinned: {', '.join(sorted(missing))}"] if missing else []
    return "\n".join(head + body + tail) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "requirements.lock"), help="where to write (default: %(default)s)")
    args = ap.parse_args(argv)
    pins, missing = closure(installed())
    Path(args.out).write_text(render(pins, missing))
    print(f"lock: {len(pins)} pins written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
