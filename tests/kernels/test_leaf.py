"""``kernels/`` is a leaf (DESIGN.md): no module under it imports ``k3train``."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_kernels_import_nothing_from_k3train():
    offenders = []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(KERNELS.parent)}:{node.lineno} {n}" for n in names
                          if n == "k3train" or n.startswith("k3train.")]
    assert len(list(KERNELS.rglob("*.py"))) > 10 and not offenders, offenders
