"""Expert-load sweep: train one model under several Quantile Balancing / optimizer variants, one
after another in one process, and compare the step-pooled expert load and the loss.

    python benchmarks/qb_sweep.py --steps 50 --base "model=k3_bench_1b train.steps=300 \\
        train.global_batch_size=4 train.micro_batch_size=2 data.seq_len=2048" \\
        published: rescored:model.qb_rescore_stride=1 muon:optim=muon \\
        "muon_balanced:optim=muon,train.micro_batch_size=1,model.qb_updates_per_step=4,model.qb_rescore_stride=1"

A variant is ``TAG:override,override,...`` on top of ``--base`` (Hydra overrides). Each runs
``Trainer.train_step`` for ``--steps`` steps (no checkpoints, no eval) with the schedule of the base
config's ``train.steps``. The table gives, per variant, the median step time, the loss at the end
and the worst layer's step-pooled load max/mean from step ``--from-step`` on; the JSON holds every
step's loss and per-layer loads. docs/moe_notes.md §3 has the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.config.load import load_config  # noqa: E402
from k3train.config.validate import validate  # noqa: E402
from k3train.parallel.state import destroy_parallel  # noqa: E402
from k3train.training.loop import Trainer  # noqa: E402

RUN = ["logging.wandb=false", "logging.console=false", "train.resume=none", "train.eval_every=0",
       "train.save_every=0"]


def run_variant(overrides: list[str], steps: int, out_dir: str) -> list[dict]:
    cfg = load_config(overrides + RUN + [f"train.out_dir={out_dir}"])
    validate(cfg)  # one process: what python -m k3train.train checks at start-up
    trainer = Trainer(cfg)
    rows = []
    for _ in range(steps):
        r = trainer.train_step()
        trainer.step += 1
        rows.append({k: r[k] for k in ("step", "loss", "step_time_s", "expert_load_max_over_mean",
                                       "expert_load_per_layer", "qb_bias_range")})
    del trainer
    destroy_parallel()  # each variant starts from fresh process groups
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="TAG:override,override,... (TAG: alone = the base config)")
    ap.add_argument("--base", default="model=k3_tiny train.device=cpu", help="Hydra overrides for every variant")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--from-step", type=int, default=20, help="first step of the worst-load column")
    ap.add_argument("--json", default="qb_sweep.json")
    args = ap.parse_args(argv)

    results = {}
    for spec in args.variants:
        tag, _, extra = spec.partition(":")
        overrides = args.base.split() + [o for o in extra.split(",") if o]
        with tempfile.TemporaryDirectory() as out_dir:
            rows = run_variant(overrides, args.steps, out_dir)
        results[tag] = {"overrides": overrides, "rows": rows}
        with open(args.json, "w") as fh:
            json.dump(results, fh)

    print(f"{'variant':<16}{'ms/step':>9}{'loss':>8}{'worst load':>12}  (worst layer, steps >= {args.from_step})")
    for tag, res in results.items():
        rows = res["rows"]
        late = [r["expert_load_max_over_mean"] for r in rows if r["step"] >= args.from_step]
        ms = 1e3 * statistics.median(r["step_time_s"] for r in rows)
        worst = f"{max(late):12.2f}" if late else f"{'-':>12}"
        print(f"{tag:<16}{ms:9.1f}{rows[-1]['loss']:8.3f}{worst}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
