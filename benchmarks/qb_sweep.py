"""Expert-load sweep: train one model under several Quantile Balancing / optimizer variants, one
after another in one process, and compare the step-pooled expert load and the loss.

    python benchmarks/qb_sweep.py --steps 50 --base "model=k3_bench_1b train.steps=300 \\
        train.global_batch_size=48 train.micro_batch_size=8 data.seq_len=4096" \\
        defaults: rescored:model.qb_rescore_stride=1 feedback1:model.qb_step_feedback=1.0 \\
        published:model.qb_updates_per_step=1 adamw:optim=adamw

A variant is ``TAG:override,override,...`` on top of ``--base`` (Hydra overrides). Each runs
``Trainer.train_step`` for ``--steps`` steps (no checkpoints, no eval) with the schedule of the base
config's ``train.steps``. The table gives, per variant, the median step time, the loss at the end
and the worst layer's step-pooled load max/mean from step ``--from-step`` on; the JSON holds every
step's loss and per-layer loads. docs/moe_notes.md §3 has the figures.

``--oracle`` also records, per step and layer, the load a bias *fitted on the step's own forward
scores* would give (10 exact Quantile Balancing iterations on those scores: not causal, so not a
method, but the floor any per-expert bias can reach on that step; repeated, near-identical tokens
keep it above 1), and the same per micro-batch next to the load the run's bias gave it; and the
held-out grid: the load of the step's last t micro-batches under a bias fitted on its first f, for every
f + t ≤ n (same weights, no lag: what the sampling of windows alone leaves a causal bias, and how it
shrinks with f and t). It works in
compiled layers too (``train.compile=true``: a graph break per MoE layer, where it runs eagerly);
``--oracle-every N`` records it on every N-th step only (its 10 fits over a step's scores take a
while at bench scale).
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
from k3train.model.quantile_balancing import exact_bias  # noqa: E402
from k3train.parallel.state import destroy_parallel  # noqa: E402
from k3train.training.loop import Trainer  # noqa: E402

# Every step is a log step: the trainer pools the expert load (and its collectives) only on those.
RUN = ["logging.wandb=false", "logging.console=false", "train.resume=none", "train.eval_every=0",
       "train.save_every=0", "train.log_every=1"]


def _max_over_mean(counts: torch.Tensor) -> torch.Tensor:
    counts = counts.float()
    return counts.max() / counts.mean()


def fitted_bias(scores: torch.Tensor, top_k: int, bias: torch.Tensor, iters: int = 10) -> torch.Tensor:
    """A bias fitted on scores [N, E]: ``iters`` exact Quantile Balancing updates from ``bias``
    (b ← q-quantile of α(b) − s, centred)."""
    b = bias.clone()
    for _ in range(iters):
        alpha = (scores + b).topk(top_k + 1, dim=-1).values[:, top_k]
        b = exact_bias(alpha[:, None] - scores, top_k)
    return b


def routed_load(scores: torch.Tensor, top_k: int, bias: torch.Tensor) -> torch.Tensor:
    """Load max/mean of scores [N, E] routed top-k on scores + bias."""
    chosen = (scores + bias).topk(top_k, dim=-1).indices.flatten()
    return _max_over_mean(torch.bincount(chosen, minlength=scores.shape[1]))


def fitted_load(scores: torch.Tensor, top_k: int, bias: torch.Tensor, iters: int = 10) -> torch.Tensor:
    """Load max/mean of scores [N, E] routed with a bias fitted on these very scores."""
    return routed_load(scores, top_k, fitted_bias(scores, top_k, bias, iters))


class OracleRecorder:
    """Keeps one MoE layer's forward scores over a step (not the re-scored ones of the QB update)
    and, per micro-batch, the load its bias gave next to ``fitted_load``; only while ``active``.

    Its ``observe`` runs eagerly also in compiled layers (a graph break) and keeps copies: under
    CUDA graphs the scores live in the graph's pool, which the next replay overwrites."""

    def __init__(self, layer):
        self.scores: list[torch.Tensor] = []
        self.micro: list[torch.Tensor] = []  # [actual, fitted] per micro-batch
        self.active = True
        self._in_update = False
        balancer, prepare = layer.balancer, layer.prepare_bias_update

        @torch.compiler.disable
        def observe(scores, cutoff, bias, tokens_per_expert=None):
            if self.active and not self._in_update:
                k = balancer.top_k
                scores = scores.detach().clone()
                self.micro.append(torch.stack([routed_load(scores, k, bias), fitted_load(scores, k, bias)]))
                self.scores.append(scores)
            return type(balancer).observe(balancer, scores, cutoff, bias, tokens_per_expert)

        def prepare_update(*args, **kwargs):  # re-scoring observes: not the forward's scores
            self._in_update = True
            try:
                return prepare(*args, **kwargs)
            finally:
                self._in_update = False

        balancer.observe, layer.prepare_bias_update = observe, prepare_update
        self.layer = layer

    def pop(self) -> dict | None:
        """This step's pooled fitted load, the per-micro-batch [actual, fitted] pairs and, with n ≥ 2
        micro-batches, the held-out grid: for f + t ≤ n, "f,t" → [the load of the step's last t micro-batches
        under a bias fitted on its first f, their own fitted load] (same weights, so no lag: what sampling
        alone leaves a causal bias fitted on f micro-batches, seen on t). None when nothing was recorded."""
        if not self.scores:
            return None
        k, bias, n = self.layer.balancer.top_k, self.layer.gate.e_score_correction_bias, len(self.scores)
        out = {"pooled": round(float(fitted_load(torch.cat(self.scores), k, bias)), 4),
               "micro": [[round(a, 4), round(f, 4)] for a, f in torch.stack(self.micro).tolist()]}
        if n >= 2:
            fitted_on = {f: fitted_bias(torch.cat(self.scores[:f]), k, bias) for f in range(1, n)}
            out["held_out"] = {}
            for t in range(1, n):
                test = torch.cat(self.scores[n - t:])
                own = round(float(fitted_load(test, k, bias)), 4)
                for f in range(1, n - t + 1):
                    out["held_out"][f"{f},{t}"] = [round(float(routed_load(test, k, fitted_on[f])), 4), own]
        self.scores, self.micro = [], []
        return out


def run_variant(overrides: list[str], steps: int, out_dir: str, oracle: bool = False,
                oracle_every: int = 1, on_step=lambda rows: None) -> list[dict]:
    """Train ``steps`` steps; one row a step, handed to ``on_step`` (the rows so far) as it comes."""
    cfg = load_config(overrides + RUN + [f"train.out_dir={out_dir}"])
    validate(cfg)  # one process: what python -m k3train.train checks at start-up
    trainer = Trainer(cfg)
    try:
        recorders = [OracleRecorder(layer) for layer in trainer.model.moe_layers()] if oracle else []
        rows = []
        for i in range(steps):
            for rec in recorders:
                rec.active = (i + 1) % oracle_every == 0
            r = trainer.train_step()
            trainer.step += 1
            rows.append({k: r[k] for k in ("step", "loss", "step_time_s", "expert_load_max_over_mean",
                                           "expert_load_per_layer", "qb_bias_range")})
            fitted = [rec.pop() for rec in recorders]
            if fitted and all(fitted):
                rows[-1]["fitted_load_per_layer"] = [f["pooled"] for f in fitted]
                rows[-1]["micro_batch_load_actual_fitted"] = [f["micro"] for f in fitted]
                if all("held_out" in f for f in fitted):
                    rows[-1]["held_out_load_per_layer"] = [f["held_out"] for f in fitted]
            on_step(rows)
    finally:
        trainer.lock.release()
        del trainer
        destroy_parallel()  # each variant starts from fresh process groups, also after a failure
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
    ap.add_argument("--oracle", action="store_true", help="also record the fitted (non-causal) load floor")
    ap.add_argument("--oracle-every", type=int, default=1, help="record it on every n-th step only")
    args = ap.parse_args(argv)
    if args.oracle_every < 1:
        ap.error(f"--oracle-every must be >= 1, got {args.oracle_every}")

    results = {}
    for spec in args.variants:
        tag, _, extra = spec.partition(":")
        overrides = args.base.split() + [o for o in extra.split(",") if o]

        def save(rows, tag=tag, overrides=overrides):  # every step: a run cut short keeps its rows
            results[tag] = {"overrides": overrides, "rows": rows}
            with open(args.json, "w") as fh:
                json.dump(results, fh)
            r = rows[-1]
            fitted = f", fitted {max(r['fitted_load_per_layer']):.2f}" if "fitted_load_per_layer" in r else ""
            if "held_out_load_per_layer" in r:
                n = len(r["micro_batch_load_actual_fitted"][0])
                held, own = zip(*(grid[f"{n // 2},{n - n // 2}"] for grid in r["held_out_load_per_layer"]))
                fitted += f"; second half held out {max(held):.2f}, fitted {max(own):.2f}"
            print(f"{tag} step {r['step']}: loss {r['loss']:.4f}, {1e3 * r['step_time_s']:.0f} ms, worst layer's "
                  f"load {max(r['expert_load_per_layer']):.2f}{fitted}", flush=True)

        with tempfile.TemporaryDirectory() as out_dir:
            run_variant(overrides, args.steps, out_dir, args.oracle, args.oracle_every, save)

    print(f"{'variant':<16}{'ms/step':>9}{'loss':>8}{'median load':>13}{'worst load':>13}"
          f"{'fitted med':>13}{'fitted worst':>13}  (worst layer a step, steps >= {args.from_step})")
    for tag, res in results.items():
        rows = res["rows"]
        late = [r for r in rows if r["step"] >= args.from_step]
        ms = 1e3 * statistics.median(r["step_time_s"] for r in rows)
        cols = []
        for key in ("expert_load_per_layer", "fitted_load_per_layer"):
            worst = [max(r[key]) for r in late if key in r]
            cols.append(f"{statistics.median(worst):13.2f}{max(worst):13.2f}" if worst else f"{'-':>13}{'-':>13}")
        print(f"{tag:<16}{ms:9.1f}{rows[-1]['loss']:8.3f}{cols[0]}{cols[1]}")
    for tag, res in results.items():
        print_held_out_grid(tag, [r for r in res["rows"] if r["step"] >= args.from_step])
    print(f"wrote {args.json}")


def print_held_out_grid(tag: str, rows: list[dict]) -> None:
    """The held-out grid of the oracle steps in ``rows``: for the last t micro-batches (rows) under a bias fitted
    on the first f (columns), the median over steps of the worst layer's load; the last column is the t
    micro-batches' own fitted load."""
    grids = [r["held_out_load_per_layer"] for r in rows if "held_out_load_per_layer" in r]
    if not grids:
        return
    n = max(int(key.split(",")[0]) for key in grids[0][0]) + 1

    def median_worst(key: str, which: int) -> float:
        return statistics.median(max(layer[key][which] for layer in grid) for grid in grids)

    print(f"{tag}: held-out load, worst layer, median over {len(grids)} steps (rows: tested on the last t "
          f"micro-batches; columns: bias fitted on the first f)")
    print(f"{'t':>4}" + "".join(f"{f'f={f}':>8}" for f in range(1, n)) + f"{'own fit':>9}")
    for t in range(1, n):
        cells = [f"{median_worst(f'{f},{t}', 0):8.3f}" if f + t <= n else f"{'':>8}" for f in range(1, n)]
        print(f"{t:>4}" + "".join(cells) + f"{median_worst(f'1,{t}', 1):9.3f}")


if __name__ == "__main__":
    main()
