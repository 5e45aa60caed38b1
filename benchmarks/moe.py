"""MoE routed experts, forward+backward (GPU, bf16): the per-expert loop, our grouped path,
Megatron-Core's experts and a dense GEMM chain of the same FLOPs, on natural and skewed routing.

    python benchmarks/moe.py --json moe_bench.json                  # bench-1B MoE, 16384 tokens
    python benchmarks/moe.py --tokens 32768 --routing skewed
    python benchmarks/moe.py --device cpu --dtype fp32 --tokens 256 --experts 8 --topk 2 \
        --latent 32 --width 32                                      # smoke
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/moe.py --ep
                                  # expert parallelism: benchmarks/moe_ep.py, which takes the other flags

Defaults are bench-1B's MoE dims: E=128 experts, top-k=8, latent l=512, expert width I=256.
A row times dispatch -> experts -> combine from the latent tokens z [N, l], the chosen experts
and gate weights [N, k] (router, W_down and W_up excluded), forward + backward with a fixed
output gradient; medians of triton.testing.do_bench (time.perf_counter on CPU), or with --cuda-graph of
replays captured in a CUDA graph (GPU time without the host's autograd and launch overhead, as under
train.compile_mode=reduce-overhead; each row's JSON says how it was timed). --profile adds each row's
CUDA kernels and their ms per fwd+bwd (torch.profiler over eager calls) to the output and the JSON.
--rounds R times every row R times, round after round (the rows in the same order each round), so that a drift
of the GPU's speed over the run reaches the dense row and the grouped ones alike: a row's ms is then the median
of its rounds, its "of dense" the median of the rounds' dense ms / row ms, with the lowest and highest beside.
* loop: ``RoutedExperts.forward_looped``, one GEMM pair per expert (host syncs).
* grouped: ``LocalTokenDispatcher`` around ``RoutedExperts.forward`` (torch._grouped_mm); with
  ``--grouped-gemms torch,cutlass:0,...`` one such row per grouped GEMM (``RoutedExperts.grouped_gemm``), and with
  ``--plans torch,auto`` one per routing-plan backend (``LocalTokenDispatcher.plan_backend``).
* megatron: Megatron-Core's experts between its ``permute``/``unpermute`` (moe_utils, the
  unfused path): TEGroupedMLP where Transformer Engine imports, else GroupedMLP where the
  ``grouped_gemm`` package imports, else SequentialMLP (a ColumnParallelLinear/RowParallelLinear
  pair per expert). It runs its own SwiGLU (torch.compile-fused on CUDA), not SiTU.
* dense: x [N*k, l] -> SiTU(x W13^T) W2^T with one expert's weights: the same GEMMs and SiTU
  without routing, the ceiling ("of dense" is against it); dense_gemm: the same two GEMMs alone.
Routing: natural = K3's sigmoid top-k router on N(0, 1) inputs of width --router-dim with
N(0, 0.02) router weights; skewed = k distinct experts per token drawn with probability
proportional to a Dirichlet(0.3) expert popularity.
FLOPs per forward 2*M*l*2I + 2*M*I*l with M = N*k, fwd+bwd = 3x; "of dense" = dense ms / row ms.
Before timing, grouped is checked against loop (output and gradients of z, weights, w13, w2;
relative Frobenius error <= 2e-2, asserted), and megatron against loop on megatron's weights
with SiTU's beta, beta_lin -> infinity (= SwiGLU); a megatron row over the limit is reported n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # op_timing, moe_ep (also when imported by a test)

from k3train.config.schema import ModelConfig, ParallelConfig  # noqa: E402
from k3train.model.moe import RoutedExperts, experts_and_combine, grouped_gemm_configs  # noqa: E402
from k3train.model.roles import interleave_rows  # noqa: E402
from k3train.model.router import SigmoidRouter  # noqa: E402
from k3train.parallel.state import destroy_parallel, init_parallel  # noqa: E402
from k3train.parallel.tensor_parallel import TPSpec  # noqa: E402
from k3train.parallel.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from kernels.situ import situ_glu_interleaved  # noqa: E402
from moe_shapes import add_moe_dims  # noqa: E402
from op_timing import graph_ms, kernel_ms  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHECK_LIMIT = 2e-2
IMPLS = {"loop", "grouped", "megatron"}
SWIGLU_BETA = 1e6  # SiTU(a, c) -> silu(a) * c as beta, beta_lin -> infinity


def grouped_name(gemm: str, plan: str = "auto") -> str:
    """The grouped row's impl name: "grouped" on torch's grouped GEMM and the dispatcher's default routing plan,
    "grouped cutlass:<i>" on another GEMM, "... plan:torch" on another plan backend."""
    return ("grouped" if gemm == "torch" else f"grouped {gemm}") + ("" if plan == "auto" else f" plan:{plan}")


def failure(e: Exception) -> str:
    """An exception as the reason a row is n/a."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def make_routing(kind: str, N: int, E: int, k: int, d: int, seed: int = 0):
    """experts [N, k] int64 and gate weights [N, k] fp32 (rows sum to 1), on the CPU."""
    torch.manual_seed(seed)
    if kind == "natural":
        router = SigmoidRouter(d, E, k, 1.0, 0.02)
        with torch.no_grad():
            r = router(torch.randn(N, d))
        return r.experts, r.weights
    if kind == "skewed":
        popularity = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample()
        experts = torch.multinomial(popularity.expand(N, E), k, replacement=False)
        weights = torch.rand(N, k)
        return experts, weights / weights.sum(-1, keepdim=True)
    raise ValueError(f"routing {kind!r}: natural or skewed")


def routed_experts(E, k, ell, I, beta=4.0, linear_beta=25.0) -> RoutedExperts:
    cfg = ModelConfig(num_experts=E, num_experts_per_token=k, latent_size=ell, moe_intermediate_size=I,
                      situ_beta=beta, situ_linear_beta=linear_beta)
    return RoutedExperts(cfg, TPSpec(None, cfg.init_std))


def megatron_experts(E, k, ell, I, dtype, device):
    """The best Megatron-Core experts module that builds here (on this rank's default process
    groups), and why each better one did not."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import experts as mcore_experts
    from megatron.core.transformer.moe.grouped_gemm_util import grouped_gemm_is_available
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=ell, num_attention_heads=1, ffn_hidden_size=I,
                            moe_ffn_hidden_size=I, num_moe_experts=E, moe_router_topk=k,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=device.type == "cuda", bf16=dtype == torch.bfloat16,
                            params_dtype=dtype, use_cpu_initialization=True)
    skipped = {}
    for name, use_te, grouped, available, why in (
            ("TEGroupedMLP", True, True, mcore_experts.HAVE_TE, "transformer_engine is not importable"),
            ("GroupedMLP", False, True, grouped_gemm_is_available(), "grouped_gemm is not importable"),
            ("SequentialMLP", False, False, True, "")):
        if available:
            spec = get_moe_module_spec(use_te=use_te, num_experts=E, moe_grouped_gemm=grouped).submodules.experts
            try:
                module = build_module(spec, E, cfg, pg_collection=get_default_pg_collection())
                return module.to(device), skipped
            except Exception as e:  # noqa: BLE001 - the next implementation down
                why = failure(e)
        skipped[name] = why
    raise RuntimeError(f"no Megatron-Core experts module builds: {skipped}")


def megatron_stacked(module, get):
    """(fc1 [E, 2I, l] with its rows interleaved as our w13's, fc2 [E, l, I]) of a Megatron-Core experts
    module, through get(param). Megatron's fc1 holds [gate; up] blocked: row j of the second half is up_j."""
    E, ell = module.num_local_experts, module.config.hidden_size
    if hasattr(module, "weight1"):  # GroupedMLP: expert e computes x @ weight1.view(E, l, 2I)[e]
        fc1 = get(module.weight1).view(E, ell, -1).transpose(1, 2)
        fc2 = get(module.weight2).view(E, -1, ell).transpose(1, 2)
    else:
        if hasattr(module, "local_experts"):  # SequentialMLP
            pairs = [(m.linear_fc1.weight, m.linear_fc2.weight) for m in module.local_experts]
        else:  # TEGroupedMLP
            pairs = [(getattr(module.linear_fc1, f"weight{e}"), getattr(module.linear_fc2, f"weight{e}"))
                     for e in range(E)]
        fc1, fc2 = torch.stack([get(a) for a, _ in pairs]), torch.stack([get(b) for _, b in pairs])
    return interleave_rows(fc1.unflatten(1, (2, -1))), fc2


def megatron_fn(module, z, experts, probs):
    """u [N, l] through Megatron-Core: permute by a routing map, experts (gate weights applied to
    the activations), unpermute. probs [N, E] holds the gate weights at the chosen experts."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute
    routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, experts, True)

    def f():
        x, permuted_probs, order = permute(z, routing_map, probs=probs, num_out_tokens=experts.numel())
        y, _ = module(x, routing_map.sum(0).cpu(), permuted_probs)
        return unpermute(y, order, z.shape)
    return f


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(got, want):
    """Relative Frobenius errors of [out, dz, dweights, dw13, dw2]."""
    return {n: rel(a, b) for n, a, b in zip(("out", "dz", "dweights", "dw13", "dw2"), got, want)}


def out_and_grads(fn, tensors, dout):
    out = fn()
    return [out.detach(), *torch.autograd.grad(out, tensors, dout, allow_unused=True, materialize_grads=True)]


def cpu_bench(fn, warmup, rep, grad_to_none=()):
    """Median ms of fn, run for warmup ms and then rep ms (at least once each)."""
    def run(ms):
        times, end = [], time.perf_counter() + ms / 1e3
        while not times or time.perf_counter() < end:
            for x in grad_to_none:
                x.grad = None
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    run(warmup)
    return statistics.median(run(rep))


def time_fwd_bwd(fn, dout, grad_to_none, warmup, rep, cuda_graph=False):
    """(median ms, how it was timed) of fn's forward + backward, the gradients of ``grad_to_none`` fresh each call
    (none accumulated into a ``.grad``, which would add a kernel the size of each leaf)."""
    def step():
        torch.autograd.backward(fn(), dout)
    if not dout.is_cuda:
        return cpu_bench(step, warmup, rep, list(grad_to_none)), "perf_counter"
    if cuda_graph:
        ms = graph_ms(lambda: torch.autograd.grad(fn(), list(grad_to_none), dout))
        if ms is not None:
            return ms, "cuda graph"
    from triton.testing import do_bench
    return do_bench(step, warmup=warmup, rep=rep, grad_to_none=list(grad_to_none), return_mode="median"), "do_bench"




def time_rounds(retimers, rounds: int, flops: float) -> None:
    """Rounds 2..R of every row, in the rows' order; then each row's ms is its rounds' median, and its "of dense"
    the median over rounds of (that round's dense ms) / (that round's row ms), the first row being dense."""
    for row, _ in retimers:
        row["ms_rounds"] = [row["ms"]]
    for r in range(2, rounds + 1):
        for row, time_again in retimers:
            row["ms_rounds"].append(time_again())
        print(f"round {r}: " + ", ".join(f"{row['impl']} {row['ms_rounds'][-1]:.3f}" for row, _ in retimers),
              flush=True)
    dense = retimers[0][0]["ms_rounds"]
    for row, _ in retimers:
        row["ms"] = statistics.median(row["ms_rounds"])
        row["TFLOPs"] = flops / row["ms"] / 1e9
        row["of_dense_rounds"] = [d / ms for d, ms in zip(dense, row["ms_rounds"])]
        row["of_dense"] = statistics.median(row["of_dense_rounds"])


def setup_megatron(E, k, ell, I, dtype, device):
    """(experts module, the SwiGLU loop on its weights, info), or (None, None, info with the error)."""
    try:
        from megatron.core import __version__
        init_parallel(ParallelConfig(), device)
        module, skipped = megatron_experts(E, k, ell, I, dtype, device)
    except Exception as e:  # noqa: BLE001 - the megatron rows say why
        return None, None, dict(error=failure(e))
    ref = routed_experts(E, k, ell, I, SWIGLU_BETA, SWIGLU_BETA).to(device, dtype)
    with torch.no_grad():
        for p, w in zip((ref.w13, ref.w2), megatron_stacked(module, torch.Tensor.detach)):
            p.copy_(w)
    return module, ref, dict(version=__version__, experts=type(module).__name__, not_run=skipped)


def megatron_case(module, ref, z, experts, weights, w, dout):
    """Megatron's timed function and its gradient leaves, and its errors against ref's loop."""
    probs = torch.zeros(z.shape[0], module.num_local_experts, device=z.device)
    probs = probs.scatter(1, experts, weights).requires_grad_(True)
    fn = megatron_fn(module, z, experts, probs)
    leaves = [z, probs, *module.parameters()]
    out, dz, dprobs, *dparams = out_and_grads(fn, leaves, dout)
    grads = dict(zip(leaves[2:], dparams))
    got = [out, dz, dprobs.gather(1, experts), *megatron_stacked(module, grads.__getitem__)]
    want = out_and_grads(lambda: ref.forward_looped(z, experts, w), [z, w, ref.w13, ref.w2], dout)
    return fn, leaves, compare(got, want)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--ep" in argv:
        from moe_ep import main as ep_main

        ep_main([a for a in argv if a != "--ep"])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep", action="store_true",
                    help="under torchrun: expert parallelism, alltoall vs balanced vs Megatron-Core's dispatcher "
                         "(benchmarks/moe_ep.py; every other flag is its own)")
    add_moe_dims(ap, tokens=16384)
    ap.add_argument("--router-dim", type=int, default=1024, help="router input width d (natural)")
    ap.add_argument("--routing", default="natural,skewed")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    ap.add_argument("--warmup", type=int, default=25, help="ms of warm-up per row")
    ap.add_argument("--rep", type=int, default=100, help="ms of timed repetitions per row")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every row this many times, round after round; a row reports its rounds' median")
    ap.add_argument("--impls", default="loop,grouped,megatron",
                    help=f"rows after the two dense ones, comma-separated from {sorted(IMPLS)}")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time each row as CUDA-graph replays (GPU time only; rows that cannot be captured, "
                         "such as the loop's host syncs, fall back to do_bench)")
    ap.add_argument("--grouped-gemms", default="torch",
                    help="grouped rows, one per grouped GEMM, comma-separated: torch, cutlass:<i> (forward and dgrad "
                         "by kernels.grouped_gemm_sm90's configuration i, experimental), tiles:<i> (its expert-tiled "
                         "kernel, rows padded per expert), fused:1 (the same with SiTU in the products' epilogues), "
                         "each with :<j> (and the wgrad by configuration j)")
    ap.add_argument("--plans", default="auto",
                    help="grouped rows for each routing-plan backend of kernels.moe_plan, comma-separated: auto "
                         "(the dispatcher's default: triton on a GPU), torch, triton")
    ap.add_argument("--profile", action="store_true",
                    help="also list each row's CUDA kernels with their ms per fwd+bwd (torch.profiler, eager)")
    ap.add_argument("--json", default="moe_bench.json")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    impls = args.impls.split(",")
    if unknown := set(impls) - IMPLS:
        ap.error(f"--impls: unknown {sorted(unknown)}; choose from {sorted(IMPLS)}")
    gemms = args.grouped_gemms.split(",")
    plans = args.plans.split(",")
    if unknown := set(plans) - {"auto", "torch", "triton"}:
        ap.error(f"--plans: unknown {sorted(unknown)}; choose from ['auto', 'torch', 'triton']")
    for gemm in gemms:
        try:
            grouped_gemm_configs(gemm)
        except ValueError as err:
            ap.error(f"--grouped-gemms: {err}")
    E, k, ell, I, N = args.experts, args.topk, args.latent, args.width, args.tokens
    M, dt = N * k, DTYPES[args.dtype]
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    flops = 3 * (2 * M * ell * 2 * I + 2 * M * I * ell)
    info = dict(gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                dtype=args.dtype, experts=E, topk=k, latent=ell, width=I, tokens=N, router_dim=args.router_dim,
                fwdbwd_flops=flops, check_limit=CHECK_LIMIT, rounds=args.rounds,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    rows, loads, checks = [], {}, {}
    retimers = []  # (row, a call that times it again) for rounds 2..R

    def dump():
        with open(args.json, "w") as fh:
            json.dump(dict(info=info, loads=loads, checks=checks, rows=rows), fh, indent=1)

    def timed(routing, impl, fn, leaves, dout, select=lambda: None, **extra):
        """Times fn's fwd+bwd (``select`` sets the module up for it first) into a new row."""
        def time_it():
            select()
            return time_fwd_bwd(fn, dout, leaves, args.warmup, args.rep, args.cuda_graph)
        ms, how = time_it()
        rows.append(dict(routing=routing, impl=impl, ms=ms, TFLOPs=flops / ms / 1e9,
                         of_dense=rows[0]["ms"] / ms if rows else 1.0, timed_by=how, **extra))
        retimers.append((rows[-1], lambda: time_it()[0]))
        print(f"[{routing}] {impl}: {ms:.3f} ms ({how})", flush=True)
        if args.profile and dev.type == "cuda":
            def step():  # fresh .grad each call: no accumulation kernels in the list
                for t in leaves:
                    t.grad = None
                torch.autograd.backward(fn(), dout)
            rows[-1]["kernels"] = kernels = kernel_ms(step)
            print(f"  kernels, ms per fwd+bwd (sum {sum(kernels.values()):.3f}):")
            for name, kms in kernels.items():
                print(f"  {kms:8.4f}  {name}")

    routed = routed_experts(E, k, ell, I).to(dev, dt)
    dispatcher = LocalTokenDispatcher(E)
    try:
        mcore, ref, info["megatron"] = (setup_megatron(E, k, ell, I, dt, dev) if "megatron" in impls
                                        else (None, None, {"error": "not asked for (--impls)"}))
        print(info, flush=True)
        # dense: the same GEMMs and SiTU on M rows with expert 0's weights
        x = torch.randn(M, ell, device=dev, dtype=dt, requires_grad=True)
        a, b = (p[0].detach().clone().requires_grad_(True) for p in (routed.w13, routed.w2))
        d_out = torch.randn(M, ell, device=dev, dtype=dt)
        timed("any", "dense", lambda: situ_glu_interleaved(x @ a.t()) @ b.t(), [x, a, b], d_out)
        timed("any", "dense_gemm", lambda: (x @ a.t())[:, :I] @ b.t(), [x, a, b], d_out)  # GEMMs alone
        for kind in args.routing.split(","):
            experts, weights = make_routing(kind, N, E, k, args.router_dim)
            counts = torch.bincount(experts.flatten(), minlength=E)
            loads[kind] = dict(max=counts.max().item(), mean=M / E, max_over_mean=counts.max().item() * E / M,
                               empty=int((counts == 0).sum()))
            experts, weights = experts.to(dev), weights.to(dev)
            z = torch.randn(N, ell, device=dev, dtype=dt, requires_grad=True)
            w = weights.clone().requires_grad_(True)
            dout = torch.randn(N, ell, device=dev, dtype=dt)
            leaves = [z, w, routed.w13, routed.w2]

            def loop(z=z, experts=experts, w=w):  # bound now: --rounds times it again after the next routing
                return routed.forward_looped(z, experts, w)

            def grouped(z=z, experts=experts, w=w):
                xg, tokens_per_expert, handle = dispatcher.dispatch(z, experts, routed.row_tile, w)
                return experts_and_combine(dispatcher, routed, xg, tokens_per_expert, w, handle)

            reference = out_and_grads(loop, leaves, dout)
            checks[kind] = {}
            for gemm in gemms:
                routed.grouped_gemm = gemm
                for plan in plans:
                    dispatcher.plan_backend = plan
                    name = grouped_name(gemm, plan)
                    checks[kind][name] = err = compare(out_and_grads(grouped, leaves, dout), reference)
                    print(f"check {kind} {name} vs loop: {err}", flush=True)
                    assert max(err.values()) <= CHECK_LIMIT, checks[kind]
            megatron, reason = None, info["megatron"].get("error")
            if mcore is not None:
                try:
                    fn, mleaves, err = megatron_case(mcore, ref, z, experts, weights, w, dout)
                    checks[kind]["megatron"] = err
                    print(f"check {kind} megatron vs loop (SwiGLU): {err}", flush=True)
                    if max(err.values()) <= CHECK_LIMIT:
                        megatron = (fn, mleaves, dout)
                    else:
                        reason = f"differs from the loop reference by {max(err.values()):.3g} > {CHECK_LIMIT}"
                except Exception as e:  # noqa: BLE001 - the row says why
                    reason = failure(e)
            if "loop" in impls:
                timed(kind, "loop", loop, leaves, dout)
            for gemm in gemms:
                for plan in plans:
                    def select(gemm=gemm, plan=plan):
                        routed.grouped_gemm, dispatcher.plan_backend = gemm, plan
                    timed(kind, grouped_name(gemm, plan), grouped, leaves, dout, select=select)
            routed.grouped_gemm = "torch"
            if "megatron" not in impls:
                pass
            elif megatron is None:
                rows.append(dict(routing=kind, impl="megatron", na=reason))
            else:
                timed(kind, "megatron", *megatron, experts=info["megatron"]["experts"])
            del z, w, dout, megatron  # (still held by the row's re-timing when --rounds > 1)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            dump()
        if args.rounds > 1:
            time_rounds(retimers, args.rounds, flops)
    finally:
        if dist.is_initialized():  # by setup_megatron, once megatron.core imported
            destroy_parallel()

    print(f"\nMoE routed experts on {info['gpu']} (torch {info['torch']}), {args.dtype}: E={E} k={k} "
          f"l={ell} I={I} N={N}, fwd+bwd {flops / 1e9:.1f} GFLOP; megatron: "
          f"{info['megatron'].get('experts') or info['megatron']['error']}")
    for kind, ld in loads.items():
        print(f"  {kind} routing: tokens per expert max {ld['max']} / mean {ld['mean']:.0f} = "
              f"{ld['max_over_mean']:.2f}, {ld['empty']} experts without tokens")
    print(f"{'routing':<9}{'impl':<10}{'ms f+b':>9}{'TFLOP/s':>9}{'of dense':>9}"
          + (f"  of dense over {args.rounds} rounds" if args.rounds > 1 else ""))
    for r in rows:
        if "na" in r:
            print(f"{r['routing']:<9}{r['impl']:<10}  n/a: {r['na']}")
        else:
            spread = f"  {min(r['of_dense_rounds']):.3f}-{max(r['of_dense_rounds']):.3f}" if args.rounds > 1 else ""
            print(f"{r['routing']:<9}{r['impl']:<10}{r['ms']:9.3f}{r['TFLOPs']:9.1f}{r['of_dense']:9.2f}{spread}")
    dump()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
