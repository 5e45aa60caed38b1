"""What a resumed run tells the user and cleans up: the config fields that changed since the
checkpoint was written, and the metrics the interrupted run logged after it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict | None, current: dict) -> list[str]:
    """``field: saved -> current`` for every config field that differs (saved None: a checkpoint
    written before configs were stored, nothing to compare)."""
    if saved is None:
        return []
    old, new = _flatten(saved), _flatten(current)
    return [f"{k}: {old.get(k, '<absent>')} -> {new.get(k, '<absent>')}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def report_config_changes(saved: dict | None, current: dict) -> None:
    """One warning line listing the fields that differ from the checkpoint's config. The optimizer,
    scheduler and data position come from the checkpoint, so e.g. a new optim.lr only takes effect
    through the restored schedule."""
    changes = config_changes(saved, current)
    if changes:
        print(f"k3train: warning: resuming with a config that differs from the checkpoint's: {'; '.join(changes)} "
              f"(optimizer, scheduler and data position are restored from the checkpoint)", file=sys.stderr,
              flush=True)


def drop_metrics_after(path: Path, step: int) -> None:
    """Keep the records of ``metrics.jsonl`` up to ``step`` (the resumed checkpoint's): the steps the
    interrupted run logged after it are trained again and logged anew, so none appears twice."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
