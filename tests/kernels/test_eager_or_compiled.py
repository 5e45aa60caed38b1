"""The Triton kernels' two call paths (``kernels.backend.eager_or_compiled``): eagerly the
autograd.Functions launch the kernels directly, with no ``torch.library`` custom-op dispatch (tens
of µs a call on the GPU); inside ``torch.compile`` the ``k3::`` custom ops, which inductor keeps in
its graphs. Every kernel folder's Triton path, forward and backward, on CPU under Triton's
interpreter; dynamo's graphs are read by a recording backend that runs them as captured."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_cpu import rerun_under_interpreter, triton_interpreter

from kernels.attn_res import attn_res_aggregate, attn_res_rms_norm
import kernels.kda
from kernels.backend import eager_or_compiled, triton_on_cpu, use_triton
from kernels.moe_permute import combine_rows, dispatch_rows
from kernels.moe_plan import routing_plan
from kernels.short_conv import causal_conv_with_resets
from kernels.rms_norm import rms_norm
from kernels.situ import situ_glu, situ_glu_interleaved


class _OpsSeen(TorchDispatchMode):
    """The ops that reach the dispatcher below autograd (a custom op shows up as ``k3::...``)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _k3(names) -> list[str]:
    return [n for n in names if n.startswith("k3::")]


def _graph_ops(fn, *args) -> tuple[list[str], object]:
    """``fn(*args)`` under torch.compile (fullgraph): the k3 ops dynamo's graph holds, and the output."""
    torch._dynamo.reset()
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)  # with the
                    for n in m.graph.nodes if n.op == "call_function")  # subgraphs of traced autograd.Functions
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return [s for s in seen if s.startswith("k3.")], out


def test_auto_backend_takes_cpu_tensors_within_the_switch_only():
    x = torch.randn(4)
    assert not use_triton(x, "auto", "test") and not kernels.kda._triton_ok(x)
    with triton_on_cpu():
        assert use_triton(x, "auto", "test") and kernels.kda._triton_ok(x)
        assert not use_triton(x, "torch", "test")
    assert not use_triton(x, "auto", "test") and not kernels.kda._triton_ok(x)


def test_helper_picks_eager_outside_compile_and_the_op_inside():
    calls = []
    call = eager_or_compiled(lambda x: calls.append("eager") or x + 1, lambda x: calls.append("compiled") or x + 1)
    x = torch.zeros(3)
    call(x)
    torch._dynamo.reset()
    torch.compile(call, backend="eager", fullgraph=True)(x)
    assert calls == ["eager", "compiled"]  # dynamo traced the compiled branch only, and ran its graph


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    n, k, ell = 6, 2, 16
    order = torch.randperm(n * k, generator=g)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n * k)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    return {
        "situ_glu": (lambda a, b: situ_glu(a, b, backend="triton"), (r(2, 3, 16), r(2, 3, 16)),
                     "_SiTUGLU", "k3.situ_glu"),
        "situ_glu_interleaved": (lambda a: situ_glu_interleaved(a, backend="triton"), (r(2, 3, 32),),
                                 "_SiTUGLUInterleaved", "k3.situ_glu_interleaved"),
        "short_conv": (lambda x, w: causal_conv_with_resets(x, w, pos, backend="triton"), (r(1, 8, 24), r(24, 1, 4)),
                       "_CausalConvWithResets", "k3.short_conv"),
        "attn_res": (lambda a, b, q, gain: attn_res_aggregate([a, b], q, gain, backend="triton"),
                     (r(2, 5, 32), r(2, 5, 32), r(1, 32), r(32)), "_AttnRes", "k3.attn_res"),
        "attn_res_rms_norm": (lambda a, b, q, gain, nw: attn_res_rms_norm([a, b], q, gain, nw, 1e-5, backend="triton"),
                              (r(2, 5, 32), r(2, 5, 32), r(1, 32), r(32), r(32)), "_AttnRes", "k3.attn_res"),
        "moe_dispatch": (lambda z: dispatch_rows(z, order, inverse, k, backend="triton"), (r(n, ell),),
                         "_DispatchRows", "k3.moe_dispatch_rows"),
        "moe_combine": (lambda y, w: combine_rows(y, w, order, inverse, backend="triton"), (r(n * k, ell), r(n, k)),
                        "_CombineRows", "k3.moe_combine_rows"),
        "rms_norm": (lambda x, w: rms_norm(x, w, 1e-5, backend="triton"), (r(2, 5, 24), r(24)),
                     "_RMSNorm", "k3.rms_norm"),
        "rms_norm_gated": (lambda x, w, g: rms_norm(x, w, 1e-5, gate=g, backend="triton"),
                           (r(2, 5, 24), r(24), r(2, 5, 24)), "_RMSNorm", "k3.rms_norm"),
    }


@triton_interpreter
@pytest.mark.parametrize("name", list(_cases()))
def test_triton_eager_launches_directly_and_compile_holds_the_op(name):
    fn, args, function, op = _cases()[name]
    leaves = [a.clone().requires_grad_() for a in args]
    with _OpsSeen() as seen:
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
    assert type(out.grad_fn).__name__.startswith(function)
    assert _k3(seen.names) == [], _k3(seen.names)  # no custom-op dispatch, forward or backward
    eager_grads = [a.grad for a in leaves]

    leaves = [a.clone().requires_grad_() for a in args]
    ops, compiled_out = _graph_ops(fn, *leaves)
    assert op + ".default" in ops, ops
    compiled_out.backward(torch.ones_like(compiled_out))  # the op's registered autograd: its backward op
    torch.testing.assert_close(compiled_out, out)
    for got, want in zip((a.grad for a in leaves), eager_grads):
        torch.testing.assert_close(got, want)


@triton_interpreter
def test_triton_routing_plan_eager_launches_directly_and_compile_holds_the_op():
    """The routing plan has no gradient: eagerly the kernels launch directly, compiled the graph holds the op."""
    experts = torch.rand(9, 8, generator=torch.Generator().manual_seed(1)).argsort(1)[:, :2]
    with _OpsSeen() as seen:
        eager = routing_plan(experts, 8, 4, backend="triton")
    assert _k3(seen.names) == [], _k3(seen.names)
    ops, compiled = _graph_ops(lambda e: tuple(routing_plan(e, 8, 4, backend="triton")), experts)
    assert "k3.moe_routing_plan.default" in ops, ops
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


@triton_interpreter
def test_triton_kda_eager_is_the_function_and_the_op_matches_it_with_spare_chunk_slots():
    """KDA eagerly: KDAFunction (exact chunk count, no k3 op). The custom op (chunk buffers sized
    from shapes: 3 chunks in 70 // 32 + 3 = 5 slots, two empty) gives the same output and
    gradients, and is what a compiled graph holds."""
    from kernels.kda.chunk import kda_triton

    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 70, 2, 16, 16
    q, k, v, gate = (torch.randn(B, T, H, d, generator=g) for d in (K, K, V, K))
    beta = torch.randn(B, T, H, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.1, torch.randn(H * K, generator=g) * 0.1
    cu = torch.tensor([0, 32, 64, 70])

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, gate, beta, A_log, dt_bias)]
        o = fn(*leaves)
        o.backward(torch.ones_like(o))
        return o, [t.grad for t in leaves]

    def eager(*t):
        return kda_triton(*t, cu_seqlens=cu)[0]

    with _OpsSeen() as seen:
        o, grads = run(eager)
    assert type(o.grad_fn).__name__.startswith("KDAFunction") and _k3(seen.names) == []

    def op(*t):
        return torch.ops.k3.kda(*t, None, cu, -5.0, K ** -0.5, True, False, None)[0]

    o_op, grads_op = run(op)
    torch.testing.assert_close(o_op, o)
    for got, want in zip(grads_op, grads):
        torch.testing.assert_close(got, want)

    ops, _ = _graph_ops(lambda *t: kda_triton(*t, cu_seqlens=cu, validate=False)[0], q, k, v, gate, beta, A_log,
                        dt_bias)
    assert "k3.kda.default" in ops, ops


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)
