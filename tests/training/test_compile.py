"""train.compile (``k3train.training.compile``): torch.compile of each decoder layer.

On CPU through the "aot_eager" backend: dynamo's capture and AOT autograd's forward and backward
graphs, without code generation (inductor's C++ build of even a small K3 takes minutes on the CI
machine; tests/gpu/test_compile_gpu.py runs inductor and the GPU's Triton kernels end to end).
Under bf16 autocast, as on the GPU: torch traces the MoE's grouped GEMM (torch._grouped_mm) in bf16
only. Whole layers run the kernels' torch references (the Triton interpreter would take minutes);
KDA's Triton custom op, whose packed-document path the reference cannot trace (it reads the
document lengths on the host), is compiled on its own under the interpreter.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch._dynamo.utils import counters
from triton_cpu import rerun_under_interpreter, triton_interpreter

import kernels.kda
from kernels.backend import triton_on_cpu
from kernels.kda import chunk
from kernels.kda.memo import TensorMemo
from k3train.config.schema import K3Config, ModelConfig
from k3train.config.validate import ConfigError, validate
from k3train.model.documents import Documents
from k3train.model.k3 import K3Model
from k3train.training.compile import compile_layers, eager_layers

# Four layers of three kinds: KDA + dense FFN writing a block, KDA + MoE (twice), MLA + MoE.
CFG = ModelConfig(num_layers=4, full_attn_layers=[4])
SEQ = 16


def _step(model: K3Model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_layers_match_eager_share_graphs_and_never_break():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = K3Model(CFG).train()
    with torch.no_grad():  # non-zero pseudo-queries: the AttnRes softmax is not uniform
        for name, p in eager.named_parameters():
            if name.endswith("_res.proj"):
                p.normal_(0, 0.5)
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled, backend="aot_eager") == 4
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names unchanged: checkpoints load
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # two micro-batches: the statistics the MoE layers keep must not recompile
        tokens, labels = (torch.randint(0, CFG.vocab_size, (2, SEQ), generator=g) for _ in range(2))
        want, want_grads = _step(eager, tokens, labels)
        got, got_grads = _step(compiled, tokens, labels)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
        assert got_grads.keys() == want_grads.keys()
        # bf16 autocast: AOT autograd orders and rounds some sums differently (measured: 0.6% over all
        # gradients, up to 8% on a cancelling sum such as A_log's; bf16 against fp32 eager differs by 20%)
        diffs = {n: float((got_grads[n] - g).norm()) for n, g in want_grads.items()}
        norms = {n: float(g.norm()) for n, g in want_grads.items()}
        assert sum(d * d for d in diffs.values()) ** 0.5 < 2e-2 * sum(v * v for v in norms.values()) ** 0.5
        rel = {n: diffs[n] / max(norms[n], 1e-12) for n in diffs}
        assert max(rel.values()) < 0.2, max(rel.items(), key=lambda kv: kv[1])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # one per layer kind
    for a, b in zip(compiled.moe_layers(), eager.moe_layers()):  # statistics kept in place by the graphs
        torch.testing.assert_close(a.load.tokens, b.load.tokens, rtol=0, atol=0)
        assert b.load.computed == 2 * 2 * SEQ * CFG.num_experts_per_token
        assert a.load.computed == 0  # counted eagerly only (read under expert parallelism, which compile excludes)
        torch.testing.assert_close(a.balancer.counts, b.balancer.counts, rtol=0, atol=0)


def test_evaluation_runs_the_compiled_layers_eagerly():
    """``eager_layers`` (the trainer's evaluation): a no-grad forward of the compiled model compiles no
    graph of its own and equals the eager model's bit for bit; outside it the layers compile again."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = K3Model(CFG).eval()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled, backend="aot_eager")
    tokens = torch.randint(0, CFG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), eager_layers(True):
        got = compiled(tokens)
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])
    with torch.no_grad():
        assert torch.equal(got, eager(tokens))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # compiled graphs take bf16 activations
            compiled(tokens)
    assert counters["stats"]["unique_graphs"] > 0  # the context, not the model, kept the layers eager


@triton_interpreter
def test_triton_kda_op_compiles_packed_documents_once(monkeypatch):
    """KDA through its Triton custom op inside a compiled function, on packed documents whose count
    changes (3, then 5; offsets padded with empty documents): one graph, no break, the reference's
    output and gradients on the unpadded offsets; and the op keeps
    no chunk tables after it returns (under CUDA graphs a kept table is an untracked tensor of the
    graphs' memory pool: the trainer's first evaluation with CUDA graphs failed on exactly four)."""
    monkeypatch.setattr(chunk, "_TABLES", TensorMemo())
    torch._dynamo.reset()
    counters.clear()
    H, K = 2, 16

    def loss(q, k, v, g, beta, A_log, dt_bias, docs, w):
        o, _ = kernels.kda.kda(q, k, v, g, beta, A_log, dt_bias, cu_seqlens=docs.cu_seqlens)
        return (o * w).sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=False)
    gen = torch.Generator().manual_seed(2)
    for lengths in ([9, 20, 11], [3, 8, 1, 20, 8]):
        T = sum(lengths)
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        docs = Documents.from_position_ids(position_ids, bucket=True)  # padded to 16 offsets, as compile_layers asks
        inputs = [torch.randn(1, T, H, K, generator=gen) for _ in range(4)] + [torch.randn(1, T, H, generator=gen),
                  torch.rand(H, generator=gen) - 0.5, torch.randn(H * K, generator=gen)]
        w = torch.randn(1, T, H, K, generator=gen)
        got_in = [t.clone().requires_grad_() for t in inputs]
        with triton_on_cpu():
            compiled(*got_in, docs, w).backward()
        assert not chunk._TABLES._entries, "the compiled op remembered chunk tables"
        want_in = [t.clone().requires_grad_() for t in inputs]
        o, _ = kernels.kda.kda_chunked(*want_in, cu_seqlens=Documents.from_position_ids(position_ids).cu_seqlens)
        (o * w).sum().backward()
        for a, b in zip(got_in, want_in):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4 * float(b.grad.abs().max()))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@triton_interpreter
def test_triton_compiled_step_keeps_no_tensor_it_allocates():
    """Compiled layers with every Triton path (the interpreter on CPU): after a step, the only new
    tensors alive are the gradients. Under CUDA graphs (train.compile_mode=reduce-overhead) a tensor
    allocated inside a graph and kept past it is a tensor of the graphs' pool that no output accounts
    for, and the graph trees stop (KDA's op kept its four chunk tables: the trainer's first CUDA-graph
    run ended at its first evaluation)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = K3Model(ModelConfig(num_layers=2, full_attn_layers=[2])).train()  # KDA + dense, MLA + MoE
    compile_layers(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)

    def step():
        with triton_on_cpu():
            _step(model, *(torch.randint(0, model.cfg.vocab_size, (2, 8), generator=g) for _ in range(2)))
        gc.collect()

    step()  # compiles
    before = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]  # held: no id is reused
    step()
    old = {id(t) for t in before} | {id(p.grad) for p in model.parameters()}
    kept = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and id(t) not in old]
    assert not kept, [(tuple(t.shape), t.dtype) for t in kept]


@triton_interpreter
def test_triton_compiled_layers_keep_their_graphs_over_packed_batches():
    """Packed batches of the trainer's kinds, compiled with every Triton path (the interpreter on CPU):
    three documents, one document a row, then 17 documents (cu_seqlens padded to 32 instead of 16). Each
    layer kind keeps the one graph its first batch compiled. On one H200 the one-document-a-row batch
    re-compiled every layer (41 s) and the longer cu_seqlens every KDA layer (a guard on the host
    offsets' count), in the bench-1B trainer's first 15 steps."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = K3Model(ModelConfig(num_layers=2, full_attn_layers=[2])).train()  # KDA + dense, MLA + MoE
    compile_layers(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    T = 16
    for rows in ([[5, 11], [16]], [[16], [16]], [[1] * 16, [16]]):
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
        tokens, labels = (torch.randint(0, model.cfg.vocab_size, (2, T), generator=g) for _ in range(2))
        model.zero_grad(set_to_none=True)
        with triton_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, position_ids=position_ids, labels=labels)
        with triton_on_cpu():
            loss.backward()
        assert torch.isfinite(loss)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one per layer kind


@pytest.mark.parametrize("override, field", [
    ({"parallel": {"tensor": 2}}, "parallel.tensor"),
    ({"parallel": {"pipeline": 2}}, "parallel.pipeline"),
    ({"parallel": {"context": 2}}, "parallel.context"),
    ({"parallel": {"expert": 2}}, "parallel.expert"),
    ({"precision": {"dtype": "fp32"}}, "precision.dtype"),
    ({"precision": {"linear_backend": "megatron"}}, "precision.linear_backend"),
    ({"precision": {"recipe": "mxfp8"}}, "precision.recipe"),
    ({"precision": {"expert_qat": True}}, "precision.expert_qat"),
    ({"train": {"recompute": "full"}}, "train.recompute"),
    ({"train": {"compile_mode": "max-autotune"}}, "train.compile_mode"),
])
def test_config_refuses_what_is_not_compiled(override, field):
    cfg = K3Config()
    cfg.train.compile = True
    cfg.train.device = "cuda"
    validate(cfg, world_size=4)  # the defaults compile
    for group, values in override.items():
        for key, value in values.items():
            setattr(getattr(cfg, group), key, value)
    with pytest.raises(ConfigError, match=field):
        validate(cfg, world_size=4)


def test_triton_cpu_subprocess():
    """Runs the Triton test above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)
