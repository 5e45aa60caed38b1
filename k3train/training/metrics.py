"""Run outputs: ``metrics.jsonl``, a console progress line, and a W&B run.

Only the main rank writes. W&B is imported only when enabled; with ``logging.wandb_mode=auto`` it
runs online when credentials exist (``WANDB_API_KEY``, or the ``~/.netrc`` entry ``wandb login``
writes) and offline otherwise, so a fresh machine needs no account.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from k3train.config.schema import LoggingConfig

# [MoE layer][expert] values that go to W&B only (a K3-size run's would make each jsonl line ~0.4 MB)
WANDB_ONLY = ("expert_load_per_expert",)


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, enabled: bool, run_config: dict, total_steps: int):
        self.cfg = cfg
        self.enabled = enabled
        self.total_steps = total_steps
        self._file = None
        self._wandb = None
        self._histogram = None  # wandb.Histogram, once W&B is on
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.wandb:
            mode = cfg.wandb_mode
            if mode == "auto":
                mode = "online" if wandb_credentials_exist() else "offline"
            import wandb

            self._histogram = wandb.Histogram
            self._wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, group=cfg.wandb_group,
                                     tags=list(cfg.wandb_tags) or None, name=cfg.wandb_name, dir=str(run_dir),
                                     mode=mode, config=run_config, resume="allow", id=_wandb_id(run_dir))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps({k: v for k, v in record.items() if k not in WANDB_ONLY}) + "\n")
        if self._wandb is not None:
            self._wandb.log({**_wandb_scalars(record), **_wandb_expert_maps(record, self._histogram)},
                            step=record["step"])
        if self.cfg.console:
            print(format_progress(record, self.total_steps), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_credentials_exist() -> bool:
    """WANDB_API_KEY is set, or the netrc file (``$NETRC`` or ``~/.netrc``) has the W&B host
    (``WANDB_BASE_URL``'s, api.wandb.ai by default) that ``wandb login`` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_scalars(record: dict) -> dict:
    """Numbers as they are; a per-layer list ``key: [v0, v1, ...]`` as ``key/0, key/1, ...``."""
    out = {}
    for k, v in record.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/{i}": x for i, x in enumerate(v)})
    return out


def _wandb_expert_maps(record: dict, histogram) -> dict:
    """``expert_load_per_expert`` [layer][expert] (tokens / mean) as one W&B histogram per MoE layer, key
    ``expert_load_per_expert/i``, with bin j the load of expert j: W&B draws a layer's histograms over the
    steps as an expert × step heat map. W&B takes at most 512 bins, so beyond 512 experts a bin holds the
    largest load of ⌈E/512⌉ neighbouring experts."""
    out = {}
    for i, row in enumerate(record.get("expert_load_per_expert", [])):
        group = -(-len(row) // histogram.MAX_LENGTH)
        loads = [max(row[j:j + group]) for j in range(0, len(row), group)]
        out[f"expert_load_per_expert/{i}"] = histogram(np_histogram=(loads, [j * group for j in range(len(loads) + 1)]))
    return out


def _wandb_id(run_dir: Path) -> str:
    """A stable run id per run directory, so a resumed job continues the same W&B run."""
    path = run_dir / "wandb_run_id"
    if not path.exists():
        import uuid

        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def format_progress(r: dict, total_steps: int) -> str:
    if r.get("kind") == "eval":
        return f"step {r['step']:>6}/{total_steps} | eval loss {r['val_loss']:.4f}"
    parts = [f"step {r['step']:>6}/{total_steps}", f"loss {r['loss']:.4f}", f"gnorm {r['grad_norm']:.3f}",
             f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:,.0f} tok/s", f"{r['step_time_s'] * 1e3:.0f} ms/step"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['peak_mem_gb']:.2f} GB")
    if r.get("expert_load_max_over_mean") is not None:
        parts.append(f"load max/mean {r['expert_load_max_over_mean']:.2f} (layer {r['expert_load_worst_layer']})")
    if r.get("muon_update_rms") is not None:
        parts.append(f"muon rms {r['muon_update_rms']:.3f}")
    if r.get("qk_clip_heads"):
        parts.append(f"qk-clip {r['qk_clip_heads']} heads")
    if r.get("time_fwd_bwd_s") is not None:
        parts.append("data/fwd+bwd/comm/opt " + "/".join(f"{1e3 * r[f'time_{p}_s']:.0f}" for p in
                                                         ("data", "fwd_bwd", "comm", "optimizer")) + " ms")
    if r.get("skipped"):
        parts.append(f"SKIPPED ({r.get('skip_reason') or 'non-finite gradients'})")
    return " | ".join(parts)
