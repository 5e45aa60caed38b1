"""The training loop: build everything from a validated ``K3Config`` and run it.

One optimizer step:
    for each of global_batch / (micro_batch · DP) micro-batches:
        loss = model(tokens, position_ids, labels, loss_mask) / n_micro ; loss.backward()
        (``MicroBatchLoop``; under parallel.pipeline > 1 the 1F1B ``PipelineSchedule`` runs them
        through the stages and reports the step's loss on every stage)
        (Quantile Balancing also between the micro-batches, by default after every one: model.qb_updates_per_step;
        steering the step's running per-expert counts: model.qb_step_feedback)
    average gradients over DP×CP (overlapped with the last backward); ‖g‖ over TP, EP and PP; clip;
        optimizer.step() on the main weights; scheduler.step()
    QK-clip (Muon recipe) rescales the main weights of MLA heads whose max logit exceeded τ
    the model's compute weights ← the main weights (bf16 parameters: ``MainParams.sync_model``)
    Quantile Balancing writes each MoE layer's bias for the next step (pooled over DP×CP), optionally
    from the step's router inputs re-scored by the updated router (model.qb_rescore_stride)

Gradients live in ``GradBuffers`` (flat fp32 main gradients), weights in ``MainParams`` (bf16 compute
copies and fp32 main weights under precision.params=bf16, fp32 parameters alone otherwise).
Runs the same on CPU (gloo, fp32) and GPU (NCCL, bf16 autocast and bf16 parameters).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from k3train.config.schema import K3Config
from k3train.config.validate import precision_dtypes
from k3train.data.batches import batch_to_device
from k3train.model.k3 import K3Model
from k3train.model.moe import expert_gemm_line, set_expert_gemm, update_router_biases
from k3train.optim.builder import build_optimizer, build_scheduler
from k3train.optim.qk_clip import apply_qk_clip, track_max_logits
from k3train.parallel.grad_buffers import GradBuffers
from k3train.parallel.pipeline.layout import build_chunks
from k3train.parallel.pipeline.stage import OnAnotherStage, keep_stage
from k3train.parallel.state import ParallelGroups, init_parallel, pick_device
from k3train.precision.main_params import MainParams
from k3train.training.checkpoint import load_checkpoint, remove_incomplete_saves, save_checkpoint
from k3train.training.checkpoint_writer import CheckpointWriter
from k3train.training.collective_timeout import set_collective_timeout
from k3train.training.compile import begin_forward, compile_layers, eager_layers
from k3train.training.profiling import PhaseTimer, StepProfiler
from k3train.training.recompute import apply_recompute
from k3train.training.flops import peak_flops, train_flops_per_token
from k3train.training.guards import StepGuard, TrainingStopped
from k3train.training.integrity import resume_checkpoint
from k3train.training.resume_report import drop_metrics_after, report_config_changes
from k3train.training.run_dir import RunDirError, RunDirLock, check_no_overwrite
from k3train.training.metrics import MetricsLogger
from k3train.training.optimizer_graph import CapturedOptimizerStep, captures_optimizer_step
from k3train.training.optimizer_metrics import optimizer_metrics
from k3train.training.micro_batches import MicroBatchLoop


def _autocast(device: torch.device, compute: str):
    """bf16 autocast when the compute dtype (``precision_dtypes``) is bf16."""
    if compute != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _peak_memory_gb(device: torch.device, reset: bool = False) -> float:
    """GPU: the most memory allocated since the last reset (``reset``: start a new window after reading, so
    that a logged step reports its own interval's peak, not the compile warm-up's); CPU: resident memory."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class Trainer:
    def __init__(self, cfg: K3Config):
        self.cfg = cfg
        t = cfg.train
        self.device = pick_device(t.device)
        self.compute_dtype, params_dtype = precision_dtypes(cfg.precision, self.device.type)
        self.groups: ParallelGroups = init_parallel(cfg.parallel, self.device)
        g = self.groups
        if g.world_size > 1:
            set_collective_timeout([g.tp, g.dp, g.ep, g.expert_dp, g.cp, g.dp_cp, g.pp, g.tp_ep_pp],
                                   t.collective_timeout_s)
        self.writer = CheckpointWriter(asynchronous=t.async_save)
        self.run_dir = Path(t.out_dir)
        self.lock = RunDirLock(self.run_dir)
        self._claim_run_dir()
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(t.seed)  # same on every rank: the full weights are drawn identically

        # train.compile takes torch linears (Megatron-Core's break compiled graphs; the same GEMMs at TP=1)
        linear_backend = "torch" if t.compile else cfg.precision.linear_backend
        self.model = K3Model(cfg.model, self.groups, linear_backend, cfg.parallel.ep_dispatcher, cfg.precision.recipe)
        p = cfg.parallel
        if p.pipeline > 1:  # keep this stage's part (parameter names stay global)
            self.chunks = build_chunks(cfg.model.num_layers, p.pipeline, p.virtual_stages, list(p.pipeline_layout))
            keep_stage(self.model, self.chunks, self.groups.pp_rank)
        self.model.to(self.device)
        set_expert_gemm(self.model, cfg.precision.expert_gemm)
        rounding = []
        if cfg.precision.expert_qat:
            from k3train.precision.mx_qat import enable_expert_qat, qat_roundings

            enable_expert_qat(self.model)
            rounding = qat_roundings(self.model)
        if cfg.optim.qk_clip_tau:
            track_max_logits(self.model, None if cfg.optim.qk_clip_exact_max else cfg.optim.qk_clip_tau)
        apply_recompute(self.model, t.recompute)  # after the stage split and QAT (k3train/training/recompute.py)
        self.main = MainParams(self.model, torch.bfloat16 if params_dtype == "bf16" else torch.float32, rounding)
        self.grads = GradBuffers(self.model, self.groups)
        if t.compile:
            compile_layers(self.model, mode=t.compile_mode)
        # the by-module profile hooks every module's forward: eager models only
        self.profiler = StepProfiler(self.run_dir, list(t.profile_steps), self.device, self.groups.rank,
                                     None if t.compile else self.model)
        self.moe_layer_ids = [i for i in range(cfg.model.num_layers) if cfg.model.is_moe(i)]  # all stages'
        self.local_moe_rows = [r for r, i in enumerate(self.moe_layer_ids)
                               if not isinstance(self.model.layers[i], OnAnotherStage)]
        self.optimizer = build_optimizer(self.model, cfg.optim, self.groups)
        if hasattr(self.optimizer, "check_finite"):  # the step guard checks the global norm before step()
            self.optimizer.check_finite = False
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        # optimizer.step(), or its CUDA-graph replay after two eager steps (train.optimizer_cuda_graph)
        captured = captures_optimizer_step(t.optimizer_cuda_graph, self.device.type, cfg.optim.name,
                                           self.groups.world_size)
        self.optimizer_step = CapturedOptimizerStep(self.optimizer) if captured else self.optimizer.step
        if captured and self.groups.is_main:
            print(f"the optimizer step replays as a CUDA graph after {self.optimizer_step.eager_steps} eager steps "
                  f"(train.optimizer_cuda_graph=false: eager)", flush=True)

        self.n_micro = t.global_batch_size // (t.micro_batch_size * self.groups.dp_size)
        self.schedule = self._build_schedule()
        self._build_data()
        self.step = 0
        self.guard = StepGuard.from_config(t)
        self._maybe_resume()
        self.flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = peak_flops(self.device)
        self.logger = MetricsLogger(cfg.logging, self.run_dir, self.groups.is_main, dataclasses.asdict(cfg), t.steps)

    # --- setup -----------------------------------------------------------------------------
    def _claim_run_dir(self) -> None:
        """Rank 0 locks train.out_dir, refuses to overwrite a run and clears what unfinished saves left;
        every rank raises together."""
        error = None
        if self.groups.is_main:
            try:
                check_no_overwrite(self.run_dir, self.cfg.train.resume)
                self.lock.acquire()
                atexit.register(self.lock.release)
                remove_incomplete_saves(self.run_dir)
            except RunDirError as err:
                error = err
        if self._any_rank(error is not None):
            raise error or RunDirError("rank 0 could not claim train.out_dir (its error line says why)")

    def _build_data(self) -> None:
        from k3train.data.batches import BatchIterator
        from k3train.data.datasets import build_datasets, passes_over_data, resolve_data
        from k3train.data.tokenizer import check_vocab, load_tokenizer

        cfg, t = self.cfg, self.cfg.train
        resolved = resolve_data(cfg.data, min(cfg.model.vocab_size, 512))
        self.tokenizer = load_tokenizer(resolved.tokenizer_path)
        check_vocab(cfg.model.vocab_size, self.tokenizer)
        evals = (t.steps // t.eval_every + 1) if t.eval_every else 0
        train_ds, valid_ds = build_datasets(
            cfg.data, cfg.data.seq_len, num_train_samples=t.steps * t.global_batch_size,
            num_valid_samples=max(1, evals * t.eval_iters * t.micro_batch_size * self.groups.dp_size),
            tokenizer=self.tokenizer)
        if self.groups.is_main:
            print(passes_over_data(cfg.data, resolved.paths, resolved.weights, cfg.data.seq_len,
                                   t.steps * t.global_batch_size)[1], flush=True)
        g = self.groups
        self.train_iter = BatchIterator(train_ds, t.micro_batch_size, g.dp_rank, g.dp_size,
                                        context=self.model.context)
        self.valid_ds = valid_ds

    def _build_schedule(self):
        """The micro-batch loop, or the pipeline schedule under parallel.pipeline > 1."""
        autocast = lambda: _autocast(self.device, self.compute_dtype)  # noqa: E731
        pipelined = self.groups.pp_size > 1
        windows = 1 if pipelined else self.cfg.model.qb_windows(self.n_micro)
        if self.groups.is_main and self.moe_layer_ids:
            m = self.cfg.model
            if windows > 1:
                how = (f"{windows} bias updates a step, one every {self.n_micro // windows} micro-batch(es), the last "
                       f"after the optimizer step; step feedback {m.qb_step_feedback}")
            else:
                how = "once a step, after the optimizer step" + (
                    " (the pipeline interleaves the micro-batches)" if pipelined else "")
            print(f"Quantile Balancing: {how}{', re-scored' if m.qb_rescore_stride else ''} "
                  f"(model.qb_updates_per_step, model.qb_step_feedback, model.qb_rescore_stride)", flush=True)
            line = expert_gemm_line(self.cfg.precision.expert_gemm, self.device, self.cfg.precision.expert_qat,
                                    self.cfg.parallel.expert)
            if line:
                print(line, flush=True)
        if pipelined:
            from k3train.parallel.pipeline.runtime import PipelineSchedule

            return PipelineSchedule(self.model, self.chunks, self.groups.pp, self.device, autocast)

        def qb_within_step(windows_left: int):  # the bias updates within the step (model.qb_updates_per_step)
            update_router_biases(self.model.moe_layers(), self.groups.dp_cp, windows_left)

        return MicroBatchLoop(self._forward, self.device, windows, qb_within_step,
                              before_last_backward=self.grads.last_backward)

    def _maybe_resume(self) -> None:
        resume = self.cfg.train.resume
        path = None
        if resume != "none":
            path = resume_checkpoint(self.run_dir, resume, self.groups, self.device)  # verified
        if path is None:
            if self.cfg.train.init_from:
                self._init_from(Path(self.cfg.train.init_from))
                self.main.sync_model()  # the checkpoint loads into the main weights
            return
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.groups, self.cfg.model)
        self.main.sync_model()
        self.step = state["step"]
        self.train_iter.load_state_dict(state["data"])
        self.guard.load_state_dict(state.get("trainer", {}).get("guard", {}))
        if self.groups.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)
            report_config_changes(state.get("trainer", {}).get("config"), dataclasses.asdict(self.cfg))
            drop_metrics_after(self.run_dir / "metrics.jsonl", self.step)

    def _init_from(self, path: Path) -> None:
        """train.init_from: weights only (an HF folder is converted once into <out_dir>/init_from)."""
        from k3train.training.checkpoint import load_model_weights

        if (path / "config.json").is_file():
            from k3train.convert.convert import import_hf

            converted = self.run_dir / "init_from"
            if self.groups.is_main and not converted.exists():
                import_hf(path, converted, progress=False)
            if self.groups.world_size > 1:
                dist.barrier()
            path = converted
        else:
            from k3train.convert.dist_checkpoint import resolve_checkpoint

            path = resolve_checkpoint(path)  # a run directory means its latest checkpoint
        load_model_weights(path, self.model, self.groups, self.cfg.model)
        if self.groups.is_main:
            print(f"initialised the model weights from {self.cfg.train.init_from} (step 0, fresh optimizer)",
                  flush=True)

    # --- one step --------------------------------------------------------------------------
    def _forward(self, batch: dict) -> torch.Tensor:
        docs = self.model.host_documents(batch["position_ids"], self.device)  # no read-back to count them
        if docs is not None:  # the documents carry the position ids to the device
            batch = {k: v for k, v in batch.items() if k != "position_ids"}
        b = batch_to_device(batch, self.device)
        if self.cfg.train.compile:
            begin_forward(self.cfg.train.compile_mode)
        with _autocast(self.device, self.compute_dtype):
            return self.model(b["tokens"], b.get("position_ids"), b["labels"], b["loss_mask"], documents=docs)

    def train_step(self) -> dict:
        self.model.train()
        step = self.step + 1
        logs = self._is_log_step(step)
        timer = PhaseTimer(self.device, timed=logs or self.profiler.active(step), label=self.profiler.active(step))
        start = time.perf_counter()
        self.grads.zero()
        moe = self.model.moe_layers()
        with timer("data"):
            batches = [next(self.train_iter) for _ in range(self.n_micro)]
        with timer("fwd_bwd"):  # Quantile Balancing within the step (model.qb_updates_per_step) included
            loss_sum = self.schedule.train(batches)  # the same on every stage
        with timer("comm"):
            self.grads.reduce()
            grad_norm = self.grads.norm()
            if self.groups.dp_cp_size > 1:  # the guard needs the step's loss, the same on every rank, before the update
                dist.all_reduce(loss_sum, group=self.groups.dp_cp)
                loss_sum /= self.groups.dp_cp_size
        self.grads.clip(self.cfg.optim.grad_clip, grad_norm)
        # The step's one host read (the guard decides before the update); nothing below reads the device
        # back on a step that does not log, so the host queues the next step while the optimizer runs.
        loss_value, grad_norm = torch.stack([loss_sum / self.n_micro, grad_norm.to(loss_sum.dtype)]).tolist()
        skip_reason = self.guard.check(loss_value, grad_norm)
        skipped = skip_reason is not None
        qk_clip = None
        with timer("optimizer"):
            if not skipped:
                self.optimizer_step()
            self.scheduler.step()
            if self.cfg.optim.qk_clip_tau and not skipped:
                qk_clip = apply_qk_clip(self.model, self.cfg.optim.qk_clip_tau, group=self.groups.dp_cp)
            if not skipped:
                self.main.sync_model()  # before re-scoring the router inputs with the updated router
            update_router_biases(moe, self.groups.dp_cp)
        # Timed steps: the GPU timeline of this step (one wait, here). Others leave the optimizer's kernels
        # queued while the host starts the next step (the guard's read waits); their host time is a floor.
        elapsed, phase_times = timer.finish()
        if elapsed is None:
            elapsed = time.perf_counter() - start
        tokens = self.cfg.train.global_batch_size * self.cfg.data.seq_len
        achieved = tokens * self.flops_per_token / elapsed / max(1, self.groups.world_size)
        return {
            "kind": "train", "step": step, "loss": loss_value,
            "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
            "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
            "mfu": achieved / self.peak if self.peak else None, "peak_mem_gb": _peak_memory_gb(self.device, reset=logs),
            "skipped": skipped, "skip_reason": skip_reason, **self._expert_load(moe, logs or skipped),
            **(self._optimizer_metrics(skipped, qk_clip) if logs else {}), **phase_times,
        }

    def _is_log_step(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step in (1, self.cfg.train.steps)

    def _optimizer_metrics(self, skipped: bool, qk_clip: Mapping | None) -> dict:
        """Muon's update RMS (before the LR; ~0.2 by design) and QK-clip's heads clipped this step and the
        largest attention logit before the clip, over the whole model (all ranks' parts: ``optimizer_metrics``)."""
        if skipped:
            return {}
        muon = None
        if self.cfg.optim.name == "muon":
            muon = {} if self.optimizer.last_step_skipped else self.optimizer.last_step_info
        return optimizer_metrics(muon, qk_clip, self.groups, self.device)

    def _expert_load(self, moe: list, report: bool) -> dict:
        """Per-layer expert load of the step, pooled over micro-batches and DP×CP ranks (one all-reduce
        each for the counts and the worst micro-batch), and each layer's QB bias range; under pipeline
        parallelism gathered from all stages, so that rank 0 logs every layer. ``report`` false (a step
        that logs nothing): only reset the counters, with no collective and no host read."""
        if not self.moe_layer_ids:
            return {}
        if not report:  # counters start over each step; pooling and logging only on the steps that log
            for layer in moe:
                layer.load.reset()
            return {}
        E = self.cfg.model.num_experts
        tokens = torch.stack([layer.load.tokens for layer in moe]) if moe else torch.zeros(0, E, device=self.device)
        worst = torch.stack([layer.load.worst for layer in moe]) if moe else torch.zeros(0, device=self.device)
        ep = self._ep_compute_balance([layer.load.computed for layer in moe])
        for layer in moe:
            layer.load.reset()
        if self.groups.dp_cp_size > 1 and moe:
            dist.all_reduce(tokens, group=self.groups.dp_cp)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.groups.dp_cp)
        bias = torch.stack([layer.gate.e_score_correction_bias for layer in moe]) if moe else tokens.new_zeros(0, E)
        tokens, worst, bias = (self._over_stages(t.float()) for t in (tokens, worst, bias))
        share = tokens / tokens.mean(1, keepdim=True).clamp(min=1e-9)  # [layer, expert] load over the mean
        pooled = share.max(1).values
        worst_layer = self.moe_layer_ids[int(pooled.argmax())]
        return {"expert_load_max_over_mean": float(pooled.max()), "expert_load_worst_layer": worst_layer,
                "expert_load_per_layer": [round(v, 4) for v in pooled.tolist()],
                "expert_load_worst_micro_batch": [round(v, 4) for v in worst.tolist()],
                "expert_load_per_expert": share.tolist(),
                "qb_bias_range": [round(v, 5) for v in (bias.max(1).values - bias.min(1).values).tolist()], **ep}

    def _over_stages(self, rows: torch.Tensor) -> torch.Tensor:
        """This stage's per-MoE-layer rows [L_here, ...] → every MoE layer's [L, ...] (each layer lives on
        one stage: zeros elsewhere and one all-reduce over PP)."""
        if self.groups.pp_size == 1:
            return rows
        full = rows.new_zeros(len(self.moe_layer_ids), *rows.shape[1:])
        full[self.local_moe_rows] = rows
        dist.all_reduce(full, group=self.groups.pp)
        return full

    def _ep_compute_balance(self, computed: list[int]) -> dict:
        """Under expert parallelism, per layer: the rows the EP ranks' expert GEMMs ran this step,
        max/mean over the ranks (1.0 = every rank did the same work; the balanced dispatcher's aim)."""
        if self.groups.ep_size == 1:
            return {}
        per_layer = torch.zeros(0, dtype=torch.float64, device=self.device)
        if computed:  # a pipeline stage may hold no MoE layer
            rows = torch.tensor(computed, dtype=torch.float64, device=self.device)
            parts = [torch.empty_like(rows) for _ in range(self.groups.ep_size)]
            dist.all_gather(parts, rows, group=self.groups.ep)
            ranks = torch.stack(parts)  # [R, L]
            per_layer = ranks.max(0).values / ranks.mean(0).clamp(min=1)
        per_layer = self._over_stages(per_layer)
        return {"ep_compute_max_over_mean": float(per_layer.max()),
                "ep_compute_per_layer": [round(v, 4) for v in per_layer.tolist()]}

    @torch.no_grad()
    def evaluate(self) -> float:
        from k3train.data.batches import BatchIterator

        self.model.eval()
        g, t = self.groups, self.cfg.train
        it = BatchIterator(self.valid_ds, t.micro_batch_size, g.dp_rank, g.dp_size, context=self.model.context)
        with eager_layers(t.compile):  # no second (no-grad) set of compiled graphs for a few forwards
            losses = self.schedule.evaluate([next(it) for _ in range(t.eval_iters)])
        if g.dp_cp_size > 1:
            dist.all_reduce(losses, group=g.dp_cp)
            losses /= g.dp_cp_size
        return float(losses)

    def _any_rank(self, *flags: bool):
        """Each flag true on every rank when it is true on any (so all ranks save and stop together);
        one all-reduce for all of them. One flag gives a bool, several a tuple."""
        if self.groups.world_size > 1:
            t = torch.tensor([int(f) for f in flags], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flags = tuple(bool(v) for v in t.tolist())
        return flags[0] if len(flags) == 1 else tuple(flags)

    # --- the run -----------------------------------------------------------------------------
    def save(self) -> None:
        save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.scheduler,
                        self.train_iter.state_dict(), self.groups, self.cfg.model,
                        trainer_state={"guard": self.guard.state_dict(), "config": dataclasses.asdict(self.cfg)},
                        keep_last=self.cfg.train.keep_last, writer=self.writer)

    def _save_if_healthy(self, final: bool) -> bool:
        """Checkpoint unless the run is inside a streak of skipped steps (then ``latest`` stays put);
        a run that ends inside such a streak raises ``TrainingStopped``."""
        if self.guard.healthy:
            self.save()
            return True
        if final:
            raise TrainingStopped(self.guard.streak_message(self.step, f"and the run ended at step {self.step}"))
        if self.groups.is_main:
            print(f"k3train: warning: not saving step {self.step}: {self.guard.consecutive} skipped step(s) in a "
                  f"row since step {self.guard.streak_start}", file=sys.stderr, flush=True)
        return False

    def fit(self) -> None:
        t = self.cfg.train
        last = t.steps if not t.exit_after_steps else min(t.steps, self.step + t.exit_after_steps)
        # SIGTERM (SLURM preemption, a killed job) or Ctrl-C: finish the step, checkpoint, leave.
        # A second Ctrl-C raises KeyboardInterrupt at once (an unfinished checkpoint is discarded).
        stop = {"now": False, "name": "", "abort": False}

        def abort(_signum, _frame):
            stop["abort"] = True
            raise KeyboardInterrupt

        def request_stop(signum, _frame):
            stop.update(now=True, name=signal.Signals(signum).name)
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, abort)
            if self.groups.is_main:  # os.write: a print here could re-enter a print it interrupted
                again = "; Ctrl-C again aborts" if signum == signal.SIGINT else ""
                os.write(sys.stderr.fileno(), f"k3train: {stop['name']}: saving a checkpoint after this step, "
                                              f"then stopping{again}\n".encode())

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        deadline = time.monotonic() + 60 * t.exit_after_minutes if t.exit_after_minutes else None
        try:
            while self.step < last:
                self.profiler.before_step(self.step + 1)
                record = self.train_step()
                self.profiler.after_step(self.step + 1)
                self.step += 1
                try:  # raises TrainingStopped when the run cannot go on
                    self.guard.update(self.step, record["skip_reason"], record["loss"])
                finally:  # every skipped step is logged
                    record["consecutive_skips"] = self.guard.consecutive
                    if record["skipped"] or self._is_log_step(self.step):
                        self.logger.log(record)
                if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                    val = {"kind": "eval", "step": self.step, "val_loss": self.evaluate()}
                    self.logger.log(val)
                if deadline is not None and time.monotonic() >= deadline and not stop["now"]:
                    stop.update(now=True, name=f"train.exit_after_minutes={t.exit_after_minutes:g}")
                # An async checkpoint is published once every rank's writer is done (same all-reduce).
                stop_now, writing = self._any_rank(stop["now"], not self.writer.written())
                if self.writer.pending and not writing:
                    self.writer.finalize()
                if (t.save_every and self.step % t.save_every == 0) or self.step == last or stop_now:
                    saved = self._save_if_healthy(final=self.step == last and not stop_now)
                if stop["abort"]:  # the second Ctrl-C's exception was swallowed (it came inside a fork handler)
                    raise KeyboardInterrupt
                if stop_now:
                    self.writer.finalize()
                    what = f"saved step {self.step}" if saved else "saved nothing (inside a streak of skipped steps)"
                    print(f"{stop['name'] or 'stop requested on another rank'}: {what} and stopped", flush=True)
                    break
            self.writer.finalize()
        except TrainingStopped:  # the same on every rank: the healthy checkpoint being written is published
            self.writer.finalize()
            raise
        finally:
            self.writer.abort()  # only after an error: an unfinished async checkpoint is discarded
            self.profiler.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.logger.close()
            self.lock.release()
