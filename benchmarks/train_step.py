"""End-to-end training-step throughput of a K3 proxy: tokens/s, TFLOP/s and MFU, our KDA kernel against fla's.

    python benchmarks/train_step.py --model k3_bench_1b --batch 2 --seq 4096 --steps 10
    python benchmarks/train_step.py --model k3_tiny --batch 1 --seq 256 --steps 2 --warmup 1   # CPU smoke run

One step = forward + backward of ``--accum`` micro-batches (default 1) under bf16 autocast, + the
optimizer + Quantile Balancing (the trainer's bias updates: after the optimizer step and, by the model's
default ``qb_updates_per_step``, after every micro-batch but the last). ``--data`` picks the rows:

* ``random`` (the default): one batch of uniformly random tokens, the same rows every micro-batch, each
  row one document, or with ``--mean-doc`` packed with documents as the trainer's data packs them (MLA's
  document mask, picked by ``--document-attention``, and KDA's varlen path);
* ``corpus``: the trainer's default data (the embedded corpus, ``data=default``), a fresh micro-batch
  every time (``(--warmup + --steps) · --accum`` of them, read before the timing and cycled), each row
  one document (causal over the whole row, as without document resets);
* ``corpus-packed``: the same rows with the corpus's own document boundaries, as the trainer runs them.

Routing is the reason for ``corpus``: a model that fits one batch of random tokens sends every token
to the same experts within a few steps (expert load max/mean E/k), so its MoE figures are for fully
collapsed routing; on real text with the trainer's optimizer, Muon, the load falls to 1.5–3 after
about 20 steps, as in the trainer. ``--optim`` picks the optimizer by its conf/optim/*.yaml
(default: the trainer's, conf/config.yaml), built with ``k3train.optim.builder.build_optimizer`` as the
trainer builds it; with Muon's ``qk_clip_tau`` the optimizer phase includes QK-clip, as in the trainer.
The trainer's gradient norm, clipping, step guard and LR schedule are not part of the step.
``--params bf16`` (the trainer's default on GPU,
``precision.params``) holds bf16 model weights with fp32 main weights and gradients, as the trainer
does (``MainParams``, ``GradBuffers``); ``--params fp32`` keeps fp32 weights that autocast casts.

``--kda`` picks the KDA recurrence: ``ours`` (``kernels.kda``), ``fla`` (fla-core 0.6.0's ``chunk_kda``,
safe gate, gate/beta/L2 norm in the kernel, called as in benchmarks/kda.py, swapped in through the
mixer's ``kernel`` seam, ``k3train.model.kda.KimiDeltaAttention.kernel``) or ``both`` (the default where
fla imports and CUDA is there): each variant is a fresh model from the same seed (the same weights), on
the same batch, with a fresh optimizer of the same config, one after the other in this process; the
summary line gives the time ratio ours/fla per step and per phase (< 1: ours is faster), of the eager rows
(of the compiled ones under ``--compile-only``).
``--same-start`` takes the variants' routing out of that comparison: over a long warm-up, KDA kernels that round
differently send tokens to different experts (session 21: fla's worst layer at 12–13 max/mean, ours at 4–7), and
skewed routing costs the experts' weight gradient more. With it the first variant warms up ``--warmup`` steps,
its state (weights and buffers, QB's routing biases among them; the fp32 main weights; the optimizer's state) is
kept on the host, and every later variant (fla's, the ablations) loads it and warms up only ``--start-steps``
steps (compiling and recording), on the micro-batches just before the timed ones; every variant then times the
same micro-batches from the same state but for those few steps. One row per variant: eager, or
``--compile --compile-only``.

Each row also gives, per timed step, the worst layer's expert load max/mean (step-pooled tokens per
expert over their mean, this rank's): the routing the MoE GEMMs ran on. Soon after initialisation the
router is far from balanced (the trainer logs 15–16 at step 10 on bench-1B, then 1.5–3 once Quantile
Balancing has caught up): time with ``--data corpus --optim muon --warmup 25`` or more for the routing
of a real run.

Per-phase times (forward, backward, comm, optimizer, QB) come
from CUDA events around each phase; ``--profile`` adds a torch profiler pass over two steps that
prints GPU busy time against wall time (a host-bound step has idle GPU), the kernel count, and the
kernels grouped by kind and the top kernels by GPU time, and (eager runs) the GPU time and kernels
of each module path, forward and backward, then the host time of its ops (their own CPU time:
dispatch and launch; ``k3train.training.module_time``). FLOPs come
from ``k3train.training.flops`` (KDA, MLA and active-expert aware), so MFU here is the same
figure the trainer logs. MFU is reported against the H200 datasheet (989 TFLOP/s) and against
the bf16 GEMM ceiling measured on the lent H200 (ANCHORS.md: 694 TFLOP/s). ``--recompute`` applies an
activation recompute policy (``train.recompute``, k3train/training/recompute.py); compare the peak
memory (``torch.cuda.max_memory_allocated`` over the timed steps) and step time across policies.
``--compile`` (GPU only) then compiles each decoder layer of the same model in place as ``train.compile``
does (``k3train.training.compile``; ``--compile-mode``, default reduce-overhead: CUDA graphs) and times
it again with the same batch and optimizer: a second row
per KDA variant (``"compile": true``) with the first (compiling) step's time, the compile time (that
step minus an eager step), and the number of compiled graphs and graph breaks; ``--compile-only`` leaves
the eager row out (the compile time is then the first step minus a compiled one).
Under ``torchrun --nproc-per-node N`` the step is data parallel over the N ranks, as the trainer runs it
(``parallel`` defaults: DP = N): each rank its own batch of ``--batch`` rows, the bucketed gradient
all-reduce started during the backward (``GradBuffers.last_backward``) and finished in the "comm"
phase, Muon's Newton–Schulz shared out over the ranks, QB over all of them. The figures are the slowest
rank's (the largest mean step and phase times); tokens/s counts every rank's tokens, TFLOP/s and MFU are
per GPU; rank 0 prints and writes the JSON (``world_size`` in each row).
``--ablate wgrad site-residual`` also times, after those, our model with one piece at a time swapped for
what it replaced (``ablated``): each a fresh model on the same batch, so the ratio to the "ours" row is a
same-process A/B of what the piece is worth (``ablated_over_ours``: > 1, the piece helps).
Writes JSON: ``{"rows": [one per variant, with "kda", "ablation", "optim" and "compile"], "ours_over_fla":
{...} or null, "ablated_over_ours": {...} or null}``.

Without CUDA the step runs on CPU in fp32 (the trainer's ``precision: auto`` there; our kernels' torch
references), with host-clock phase times and no MFU: a smoke run, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from k3train.config.schema import COMPILE_MODES, RECOMPUTE_POLICIES, ModelConfig, OptimConfig, ParallelConfig
from k3train.model import document_attention
from k3train.model import moe as moe_module
from k3train.model.attn_res import AttnResAggregator
from k3train.model.k3 import K3Model
from k3train.model.kda import KimiDeltaAttention
from k3train.optim.builder import build_optimizer
from k3train.optim.qk_clip import apply_qk_clip, track_max_logits
from k3train.parallel.grad_buffers import GradBuffers
from k3train.parallel.state import ParallelGroups, destroy_parallel, init_parallel
from k3train.precision.main_params import MainParams, main_param
from k3train.training.compile import begin_forward, compile_layers
from k3train.training.flops import train_flops_per_token
from k3train.training.kernel_time import format_summary, kernel_summary
from k3train.training.micro_batches import windows_left_after
from k3train.training.module_time import format_table, module_ranges, time_by_module
from k3train.training.recompute import apply_recompute
from kernels.grouped_wgrad import grouped_wgrad
from packed_documents import packed_position_ids

MEASURED_GEMM_TFLOPS = 694.0  # ANCHORS.md, bf16 8192³ on the lent H200
DATASHEET_TFLOPS = 989.0
CONF = Path(__file__).resolve().parents[1] / "conf"
PHASES = ("forward", "backward", "comm", "optimizer", "qb")
ABLATIONS = ("wgrad", "site-residual", "max-logit-bound")
DATA = ("random", "corpus", "corpus-packed")


@contextlib.contextmanager
def ablated(name: str):
    """Within it, models built run one of our pieces as what it replaced (``ABLATIONS``):

    * ``wgrad``: the routed experts' weight gradient by autograd's K-grouped ``torch._grouped_mm``
      (``kernels.grouped_wgrad``'s torch path) instead of our kernel;
    * ``site-residual``: P + Attn(x_a) as a separate add before the mlp site reads it, instead of the
      site adding it (``attn_res_site(..., residual=b)``);
    * ``max-logit-bound``: QK-clip's exact max logit for every MLA head, instead of only where the
      attention's log-sum-exp bound reaches τ (``optim.qk_clip_exact_max=true``; needs Muon's QK-clip).
    """
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; expected one of {ABLATIONS}")
    if name == "wgrad":
        patch = mock.patch.object(moe_module, "grouped_wgrad", functools.partial(grouped_wgrad, backend="torch"))
    elif name == "max-logit-bound":
        track = track_max_logits

        def exact_everywhere(model, tau=None):
            track(model, None)

        patch = mock.patch.object(sys.modules[__name__], "track_max_logits", exact_everywhere)
    else:
        site = AttnResAggregator.forward

        def add_first(self, sources, out_norm, pass_through=0, residual=None):
            if residual is not None:
                sources = [*sources[:-1], sources[-1] + residual]
            return site(self, sources, out_norm, pass_through)

        patch = mock.patch.object(AttnResAggregator, "forward", add_first)
    with patch:
        yield


def model_config(name: str) -> ModelConfig:
    import yaml

    return ModelConfig(**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def optim_config(name: str) -> OptimConfig:
    """conf/optim/<name>.yaml, as the trainer's Hydra config reads it."""
    import yaml

    return OptimConfig(**yaml.safe_load((CONF / "optim" / f"{name}.yaml").read_text()))


def default_optim() -> str:
    """The optimizer group conf/config.yaml's defaults list picks (the trainer's default)."""
    import yaml

    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict) and "optim" in entry:
            return entry["optim"]
    raise ValueError("conf/config.yaml names no optim group in its defaults")


def fla_kernel(chunk_kda=None):
    """``kernels.kda.kda``'s signature over fla-core's ``chunk_kda`` (fla.ops.kda; the gate, beta sigmoid
    and q/k L2 norm inside the kernel, safe gate), for ``KimiDeltaAttention.kernel``. Returns ``(o, None)``:
    it covers the mixer's call only and raises on the arguments it does not pass (a scale, an initial
    state, the final state, no L2 norm). ``chunk_kda``: a stand-in with fla's keywords (tests)."""
    if chunk_kda is None:
        from fla.ops.kda import chunk_kda

    def kda_fla(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None, initial_state=None,
                output_final_state=False, cu_seqlens=None, use_qk_l2norm=True):
        given = {"scale": scale is not None, "initial_state": initial_state is not None,
                 "output_final_state": output_final_state, "use_qk_l2norm=False": not use_qk_l2norm}
        unsupported = [name for name, is_given in given.items() if is_given]
        if unsupported:
            raise ValueError(f"the fla chunk_kda adapter covers the KDA mixer's call only; it does not pass "
                             f"{', '.join(unsupported)}")
        o = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                      lower_bound=lower_bound, cu_seqlens=cu_seqlens)[0]
        return o, None

    return kda_fla


def fla_missing() -> str | None:
    """Why fla's chunk_kda cannot run here, or None."""
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception as err:  # ImportError, or a Triton/driver error at import
        return (f"fla-core does not import ({type(err).__name__}: {err}; "
                f"pip install 'k3train[bench]' for fla-core==0.6.0)")
    if not torch.cuda.is_available():
        return "no CUDA device (fla's chunk_kda is GPU-only Triton)"
    return None


def kda_variants(choice: str | None) -> list[str]:
    if choice == "ours":
        return ["ours"]
    why = fla_missing()
    if choice is None:
        if why is None:
            return ["ours", "fla"]
        print(f"train_step: --kda ours only: {why}")
        return ["ours"]
    if why is not None:
        sys.exit(f"train_step: --kda {choice} needs fla's chunk_kda: {why}")
    return ["ours", "fla"] if choice == "both" else ["fla"]


def swap_kda_kernel(model: torch.nn.Module, kernel) -> int:
    """Point every KDA mixer of ``model`` at ``kernel`` (an instance attribute); the number swapped."""
    mixers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    for m in mixers:
        m.kernel = kernel
    return len(mixers)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_bench_1b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches of --batch rows per step (gradient accumulation, as the trainer's "
                         "global_batch_size / micro_batch_size): one optimizer step per --accum backwards")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="train_step.json")
    ap.add_argument("--params", choices=("bf16", "fp32"), default=None,
                    help="parameter storage (precision.params): bf16 with fp32 main weights, or fp32 "
                         "(default: bf16 on GPU, fp32 on CPU, as the trainer's 'auto')")
    ap.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default="none",
                    help="activation recompute policy (train.recompute)")
    ap.add_argument("--kda", choices=("ours", "fla", "both"), default=None,
                    help="KDA kernel: ours, fla's chunk_kda, or both in turn (default: both where fla imports "
                         "and CUDA is there, else ours)")
    ap.add_argument("--optim", choices=("adamw", "muon"), default=None,
                    help="optimizer, as conf/optim/<name>.yaml (default: conf/config.yaml's, the trainer's)")
    ap.add_argument("--compile", action="store_true",
                    help="then compile each layer as train.compile does and time the same model again (GPU only)")
    ap.add_argument("--compile-only", action="store_true",
                    help="with --compile: leave out the eager timing (the compiled row alone)")
    ap.add_argument("--compile-mode", choices=COMPILE_MODES, default="reduce-overhead",
                    help="torch.compile mode of --compile (reduce-overhead: each layer graph a CUDA graph)")
    ap.add_argument("--data", choices=DATA, default="random",
                    help="the rows: one random batch repeated, or fresh micro-batches of the trainer's default "
                         "corpus, one document a row or packed as the corpus has them (see the docstring)")
    ap.add_argument("--mean-doc", type=float, default=None,
                    help="pack each row with documents of exponentially distributed length of this mean (tokens), "
                         "as the trainer's data does (default: one document per row)")
    ap.add_argument("--document-attention", choices=document_attention.WAYS, default=None,
                    help="MLA's attention over packed rows, with --mean-doc (k3train/model/document_attention.py; "
                         "default: the model's, DOCUMENT_ATTENTION)")
    ap.add_argument("--same-start", action="store_true",
                    help="every variant after the first starts from the first one's state after its warm-up and "
                         "warms up --start-steps steps (see the docstring)")
    ap.add_argument("--start-steps", type=int, default=3,
                    help="with --same-start: warm-up steps of the later variants (the first compiles, the next "
                         "record CUDA graphs); at most --warmup")
    ap.add_argument("--ablate", nargs="+", choices=ABLATIONS, default=[],
                    help="also time our model with each of these pieces swapped for what it replaced (see ablated)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile two steps (kernels by kind and time), of the last variant timed")
    ap.add_argument("--expert-gemm", default="torch",
                    help="the routed experts' grouped GEMMs, as the trainer's precision.expert_gemm: torch, or "
                         "tiles:<t>/fused:1/cutlass:<i>[:<j>] (kernels.grouped_gemm_sm90, its library built)")
    args = ap.parse_args(argv)
    if args.accum < 1:
        ap.error(f"--accum {args.accum}: at least one micro-batch a step")
    try:
        moe_module.grouped_gemm_configs(args.expert_gemm)
    except ValueError as err:
        ap.error(f"--expert-gemm: {err}")
    if args.compile_only and not args.compile:
        ap.error("--compile-only leaves out the eager timing of --compile; add --compile")
    if args.same_start and args.compile and not args.compile_only:
        ap.error("--same-start gives one row per variant: time eagerly, or add --compile-only to --compile")
    if args.same_start and not 1 <= args.start_steps <= args.warmup:
        ap.error(f"--start-steps {args.start_steps}: between 1 and --warmup ({args.warmup})")
    if args.mean_doc is not None and args.data != "random":
        ap.error(f"--mean-doc packs random rows; --data {args.data} has its own documents (corpus-packed uses them)")
    model_default = document_attention.DOCUMENT_ATTENTION
    args.document_attention = args.document_attention or model_default

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    groups, owned = None, False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: data parallel over every rank
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        owned = not dist.is_initialized()
        groups = init_parallel(ParallelConfig(), device)
    quiet = groups is not None and groups.rank > 0  # rank 0 prints and writes the JSON
    try:
        document_attention.DOCUMENT_ATTENTION = args.document_attention
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            return run(args, device, groups)
    finally:
        document_attention.DOCUMENT_ATTENTION = model_default
        if owned:
            destroy_parallel()


def run(args, device: torch.device, groups: ParallelGroups | None) -> list[dict]:
    """Every variant's rows on ``device``, data parallel over ``groups`` when given."""
    args.params = args.params or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cpu" and args.params == "bf16":
        sys.exit("train_step: --params bf16 needs bf16 autocast, i.e. a GPU (on CPU the step runs in fp32)")
    if device.type == "cpu" and args.compile:
        sys.exit("train_step: --compile needs a GPU (train.compile needs bf16 activations; on CPU the step runs "
                 "in fp32)")
    args.optim = args.optim or default_optim()
    variants = kda_variants(args.kda)
    cfg, ocfg = model_config(args.model), optim_config(args.optim)
    batches = micro_batches(args, cfg, device, groups)  # the same for every variant

    print(f"{'model':>12} {'n×B×T':>12} {'variant':>18} {'optim':>5} {'recompute':>9} {'ms/step':>9} {'tok/s':>9} "
          f"{'TFLOP/s':>8} {'MFU(989)':>9} {'MFU(694)':>9} {'mem GB':>7} {'QB ms':>6} {'QB %':>5}")
    start = StartState() if args.same_start else None
    rows = [row for kda in variants for row in run_variant(kda, args, cfg, ocfg, batches, device, groups,
                                                           start=start)]
    for name in args.ablate:
        with ablated(name):
            rows += run_variant("ours", args, cfg, ocfg, batches, device, groups, ablation=name, start=start)
    by = {r["kda"]: r for r in rows if r["compile"] == args.compile_only and r["ablation"] is None}
    ratio = None
    if "ours" in by and "fla" in by:
        ours, fla = by["ours"], by["fla"]
        ratio = {"step_ms": ours["step_ms"] / fla["step_ms"],
                 **{k: ours["phase_ms"][k] / fla["phase_ms"][k] for k in PHASES if fla["phase_ms"][k] > 0}}
        print("time ours/fla (< 1: ours faster): " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    ablated_over_ours = ablation_ratios(rows, args.compile)
    for name, r in (ablated_over_ours or {}).items():
        print(f"time without {name} / ours (> 1: it helps): " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    if groups is None or groups.rank == 0:
        Path(args.json).write_text(json.dumps({"rows": rows, "ours_over_fla": ratio,
                                               "ablated_over_ours": ablated_over_ours}, indent=2))
    return rows


def ablation_ratios(rows: list[dict], compiled: bool) -> dict | None:
    """Per ablation: its step (mean and median) and phase times over those of "ours" without one, the
    compiled rows when there are any; None without ablations."""
    ours = next((r for r in rows if r["kda"] == "ours" and r["ablation"] is None and r["compile"] == compiled), None)
    ablations = [r for r in rows if r["ablation"] is not None and r["compile"] == compiled]
    if ours is None or not ablations:
        return None
    return {r["ablation"]: {"step_ms": r["step_ms"] / ours["step_ms"],
                            "step_ms_median": r["step_ms_median"] / ours["step_ms_median"],
                            **{k: r["phase_ms"][k] / ours["phase_ms"][k] for k in PHASES if ours["phase_ms"][k] > 0}}
            for r in ablations}


def _load_range(values: list[float]) -> str:
    """The timed steps' worst-layer expert load max/mean, as "lo–hi" (or "-" without MoE layers)."""
    return f"{min(values):.2f}–{max(values):.2f}" if values else "-"


def _fmt(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def micro_batches(args, cfg: ModelConfig, device: torch.device,
                  groups: ParallelGroups | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The micro-batches a step cycles through, as (tokens [B, T] and labels [B, T] on ``device``,
    position_ids [B, T] on the host or None for one document a row); each data-parallel rank its own."""
    dp_rank, dp_size = (groups.dp_rank, groups.dp_size) if groups is not None else (0, 1)
    if args.data == "random":
        g = torch.Generator().manual_seed(1 + dp_rank)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
        pos = None if args.mean_doc is None else packed_position_ids(args.batch, args.seq, args.mean_doc)
        return [(tokens[:, :-1], tokens[:, 1:], pos)]
    from k3train.config.schema import DataConfig
    from k3train.data.batches import BatchIterator
    from k3train.data.datasets import build_datasets, resolve_data
    from k3train.data.tokenizer import check_vocab, load_tokenizer

    data = DataConfig(seq_len=args.seq)
    resolved = resolve_data(data, min(cfg.vocab_size, 512))  # as the trainer: builds the corpus once
    tokenizer = load_tokenizer(resolved.tokenizer_path)
    check_vocab(cfg.vocab_size, tokenizer)
    n = (args.warmup + args.steps) * args.accum
    train, _ = build_datasets(data, args.seq, num_train_samples=n * args.batch * dp_size, num_valid_samples=0,
                              tokenizer=tokenizer)
    rows = BatchIterator(train, args.batch, dp_rank, dp_size)
    return [(b["tokens"].to(device), b["labels"].to(device),
             b["position_ids"] if args.data == "corpus-packed" else None) for _, b in zip(range(n), rows)]


def _to_host(state):
    """A copy of ``state`` (tensors in dicts, lists and tuples) with every tensor on the host."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return state


class StartState:
    """``--same-start``: one variant's training state, kept on the host until the next variant loads it: the
    model's state dict (its weights and buffers, QB's routing biases among them), the fp32 main weights
    (``main_param``; the weights themselves under fp32 parameters) and the optimizer's state dict."""

    def __init__(self):
        self.saved: tuple[dict, list[torch.Tensor], dict] | None = None

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.saved = (_to_host(model.state_dict()), [_to_host(main_param(p)) for p in model.parameters()],
                      _to_host(opt.state_dict()))

    @torch.no_grad()
    def load(self, model: torch.nn.Module, main: MainParams, opt: torch.optim.Optimizer) -> None:
        """Into a model built as the saved one was, its ``MainParams`` and optimizer."""
        weights, mains, opt_state = self.saved
        model.load_state_dict(weights)
        params = list(model.parameters())
        if len(params) != len(mains):
            raise ValueError(f"--same-start: {len(params)} parameters here, {len(mains)} saved")
        for p, m in zip(params, mains):
            main_param(p).copy_(m)
        main.sync_model()  # the compute copies rounded from the main weights, as the saved model's were
        opt.load_state_dict(opt_state)  # a copy on the parameters' device; the host copy stays for the next


def run_variant(kda: str, args, cfg: ModelConfig, ocfg: OptimConfig,
                batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], device: torch.device,
                groups: ParallelGroups | None, ablation: str | None = None,
                start: StartState | None = None) -> list[dict]:
    """Build the model (seed 0) with the ``kda`` kernel, time ``args.steps`` steps, print its line; with
    ``args.compile`` then compile its layers and time it again. Its rows (eager, then compiled), marked
    with the ``ablation`` they ran under (``ablated``, entered by the caller) or None. ``start``
    (``--same-start``): empty, this variant fills it after its warm-up; filled, this variant starts from it
    and warms up ``args.start_steps`` steps on the micro-batches before the timed ones."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = K3Model(cfg).to(device)
    moe_module.set_expert_gemm(model, args.expert_gemm)
    if kda == "fla" and swap_kda_kernel(model, fla_kernel()) == 0:
        raise ValueError(f"{args.model} has no KDA layer to run fla's kernel in")
    if ocfg.qk_clip_tau:  # as the trainer: the MLA layers track their max logit for QK-clip
        track_max_logits(model, None if ocfg.qk_clip_exact_max else ocfg.qk_clip_tau)
    main = MainParams(model, torch.bfloat16 if args.params == "bf16" else torch.float32)
    grads = GradBuffers(model, groups)
    apply_recompute(model, args.recompute)
    opt = build_optimizer(model, ocfg, groups)
    if hasattr(opt, "check_finite"):  # as the trainer, whose step guard checks the gradient norm instead
        opt.check_finite = False
    started = start is not None and start.saved is not None
    if started:
        start.load(model, main, opt)
    warmup = args.start_steps if started else args.warmup

    moe = model.moe_layers()
    ticks: list[list] = []
    loads: list[torch.Tensor] = []  # per step: the worst layer's step-pooled expert load max/mean (on the device)
    drawn = (args.warmup - warmup) * args.accum  # micro-batches drawn from ``batches`` (cycled)
    qb_group = groups.dp_cp if groups else None
    windows = cfg.qb_windows(args.accum)  # Quantile Balancing's updates a step, as the trainer's loop makes them
    compiled_mode = None  # set once the layers are compiled

    def tick():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def step() -> torch.Tensor:
        """One optimizer step over ``args.accum`` micro-batches; ``ticks`` gets [(phase, event)], a phase's
        time being from the previous event to its own (forward and backward once per micro-batch)."""
        nonlocal drawn
        t = [("", tick())]
        grads.zero()
        total = 0.0
        for i in range(args.accum):
            x, y, pos = batches[drawn % len(batches)]
            drawn += 1
            if compiled_mode:
                begin_forward(compiled_mode)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                # as the trainer: the documents counted on the host batch, then moved (no read-back)
                docs = None if pos is None else model.host_documents(pos, device)
                loss = model(x, labels=y, documents=docs)
            t.append(("forward", tick()))
            if i == args.accum - 1:
                grads.last_backward()  # data parallel: each bucket's all-reduce starts once its gradients are in
            (loss / args.accum).backward()
            total = total + loss.detach() / args.accum
            t.append(("backward", tick()))
            left = windows_left_after(i + 1, args.accum, windows)
            if left:
                moe_module.update_router_biases(moe, qb_group, left)
                t.append(("qb", tick()))
        grads.reduce()  # the all-reduces' tail, the division
        t.append(("comm", tick()))
        opt.step()
        if ocfg.qk_clip_tau:
            apply_qk_clip(model, ocfg.qk_clip_tau)
        main.sync_model()
        t.append(("optimizer", tick()))
        if moe:
            tokens = torch.stack([layer.load.tokens for layer in moe])
            loads.append((tokens.amax(1) / tokens.mean(1).clamp(min=1e-9)).max())
        moe_module.update_router_biases(moe, qb_group)
        for layer in moe:
            layer.load.reset()
        t.append(("qb", tick()))
        ticks.append(t)
        return total

    def elapsed_ms(a, b) -> float:
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    def measure(compiled: bool) -> dict:
        """``warmup`` steps (the first one timed on its own: it compiles), ``args.steps`` timed; its row."""
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = loss = step()
        if cuda:
            torch.cuda.synchronize()
        first_step_s = time.perf_counter() - t0
        for _ in range(warmup - 1):
            loss = step()
        if start is not None and not started:
            start.save(model, opt)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ticks.clear()
        loads.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        phase_ms = {name: sum(elapsed_ms(a, b) for t in ticks for (_, a), (phase, b) in zip(t, t[1:])
                              if phase == name) / len(ticks) for name in PHASES}
        world = groups.world_size if groups is not None else 1
        if world > 1:  # the slowest rank sets the pace: the largest mean step and phase times over the ranks
            slowest = torch.tensor([dt, *phase_ms.values()], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dt, *values = slowest.tolist()
            phase_ms = dict(zip(PHASES, values))
        qb_ms = phase_ms["qb"]
        # The eager step is host-bound, and the host's speed drifts within a lease: the median step
        # (first to last event) is steadier than the mean for A/B comparisons across processes.
        per_step = sorted(elapsed_ms(t[0][1], t[-1][1]) for t in ticks)
        tok = args.accum * args.batch * args.seq  # per rank
        tflops = tok * train_flops_per_token(cfg, args.seq) / dt / 1e12  # per GPU
        dtype = f"bf16 autocast, {args.params} params" if cuda else f"fp32, {args.params} params"
        row = {"model": args.model, "kda": kda, "ablation": ablation, "optim": args.optim, "compile": compiled, "batch": args.batch,
               "accum": args.accum, "seq": args.seq, "data": args.data, "mean_doc": args.mean_doc,
               "document_attention": args.document_attention,
               "dtype": dtype, "recompute": args.recompute, "expert_gemm": args.expert_gemm, "warmup": warmup,
               "start": "shared" if started else "own",
               "gpu": torch.cuda.get_device_name() if cuda else "cpu", "step_ms": dt * 1e3,
               "step_ms_median": per_step[len(per_step) // 2], "step_ms_min": per_step[0],
               "world_size": world, "tokens_per_s": world * tok / dt, "model_tflops": tflops,
               "mfu_datasheet": tflops / DATASHEET_TFLOPS if cuda else None,
               "mfu_measured_gemm": tflops / MEASURED_GEMM_TFLOPS if cuda else None,
               "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "first_loss": float(first), "loss": float(loss), "first_step_s": first_step_s,
               "qb_ms": qb_ms, "qb_share": qb_ms / (dt * 1e3), "phase_ms": phase_ms,
               "expert_load_max_over_mean": [float(v) for v in loads]}  # read back once, after the timing
        name = (kda if ablation is None else f"{kda}-{ablation}") + ("+c" if compiled else "")
        print(f"{args.model:>12} {args.accum}×{args.batch}×{args.seq:<7} {name:>18} {args.optim:>5} {args.recompute:>9} "
              f"{row['step_ms']:>9.1f} {row['tokens_per_s']:>9.0f} {tflops:>8.1f} "
              f"{_fmt(row['mfu_datasheet'], '.1%', 9)} {_fmt(row['mfu_measured_gemm'], '.1%', 9)} "
              f"{_fmt(row['peak_mem_gb'], '.1f', 7)} {qb_ms:>6.2f} {row['qb_share']:>5.1%}")
        clock = "GPU time between events" if cuda else "host time"
        origin = " from the first variant's state" if started else ""
        experts = "" if args.expert_gemm == "torch" else f", experts on {args.expert_gemm}"
        print(f"  {name}: {args.params} params, {args.optim}{experts}; step median {row['step_ms_median']:.1f} ms "
              f"(min {row['step_ms_min']:.1f}); loss {row['first_loss']:.4f} at the first of {warmup} warm-up "
              f"steps{origin}; expert load "
              f"max/mean (worst layer) {_load_range(row['expert_load_max_over_mean'])}; "
              f"phases ({clock}, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in phase_ms.items()), flush=True)
        return row

    rows = [] if args.compile_only else [measure(compiled=False)]
    if args.compile:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # a variant before this one compiled its own model: count this one's graphs only
        counters.clear()
        compile_layers(model, mode=args.compile_mode)
        compiled_mode = args.compile_mode
        c = measure(compiled=True)
        c["compile_mode"] = compiled_mode
        step_s = (rows[0] if rows else c)["step_ms"] / 1e3  # an eager step, else a compiled one
        c["compile_s"] = c["first_step_s"] - step_s  # the first step's excess
        c["graphs"] = counters["stats"]["unique_graphs"]
        c["graph_breaks"] = sum(counters["graph_break"].values())
        print(f"  compiled: {c['graphs']} layer graphs, {c['graph_breaks']} graph breaks, compile ≈ "
              f"{c['compile_s']:.0f} s (first step minus a{'n eager' if rows else ' compiled'} step)"
              + (f"; step {rows[0]['step_ms'] / c['step_ms']:.2f}x eager" if rows else ""), flush=True)
        rows.append(c)
    if args.profile and cuda:
        rows[-1]["profile"] = profile(step, None if args.compile else model)
    del model, main, grads, opt, moe, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def profile(step, model: torch.nn.Module | None) -> dict:
    """Two profiled steps: wall time, GPU busy time and span, kernel count, time by kernel kind, top kernels
    (``k3train.training.kernel_time``); with
    an eager ``model``, also GPU time and kernels by module, forward and backward (module_time.py)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ranges = module_ranges(model) if model is not None else contextlib.nullcontext()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, ranges:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / 2
    summary = kernel_summary(prof.events(), steps=2)
    print(f"profiled step: wall {wall_ms:.1f} ms; " + format_summary(summary))
    result = {"wall_ms": wall_ms, **summary}
    if model is not None:  # GPU kernel time, then host time (ops' own CPU time: dispatch and launch)
        for key, device in (("by_module", True), ("by_module_host", False)):
            result[key] = by_module = {
                path: {k: v / 2 for k, v in row.items()}
                for path, row in time_by_module(prof.events(), device=device, labels=("Optimizer.step#",)).items()}
            print(format_table(by_module, device=device))
    return result


if __name__ == "__main__":
    main()
