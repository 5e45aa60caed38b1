"""Megatron-Core's ``MoEAlltoAllTokenDispatcher`` behind the dispatcher interface of
``benchmarks/moe_ep.py``: the peer row, on the expert-parallel groups ``init_parallel`` set up.

    peer = MegatronAlltoAll(num_experts, top_k, latent, device)
    routing_map, probs = peer.route(experts, weights)             # untimed: the router's output
    grouped, tokens_per_expert, handle = peer.dispatch(z, (routing_map, probs))
    u = peer.combine(experts_module(grouped, tokens_per_expert), weights, handle)

Its dispatch sends the gate weights with the tokens (a second all-to-all) and ``combine`` scales
the expert outputs by them before its all-to-all back; ours sends tokens only and weights the sum
after. Dropless, unfused permutation (``moe_permute_fusion`` off: it needs Transformer Engine).

Three CUDA-only points of Megatron-Core 0.16.1 refuse a CPU-only torch; on CPU (gloo), and only
there, ``on_host`` stands in for them:
1. ``MoEAlltoAllTokenDispatcher.__init__`` makes a ``torch.cuda.Stream`` for its device-to-host
   copies (the class attribute ``cuda_dtoh_stream``): preset to a placeholder while it builds;
2. ``_maybe_dtoh_and_synchronize`` moves the split sizes to the host on that stream: on CPU
   they are already there, and only become numpy arrays as on the GPU path (``_HostSplits``);
3. ``tensor_parallel.mappings`` allocates the all-to-all and all-gather outputs on
   ``torch.cuda.current_device()``: that answers ``cpu`` while ``on_host`` is entered.
The data path (permute, all-to-alls, chunk sort, unpermute) is Megatron-Core's own on both.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch


def _host_splits_class():
    """Megatron-Core's dispatcher with the device-to-host step done in place (CPU tensors)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class _HostSplits(MoEAlltoAllTokenDispatcher):
        def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
            if point == self.cuda_dtoh_point:
                for name in ("input_splits", "output_splits", "output_splits_tp"):
                    if torch.is_tensor(getattr(self, name)):
                        setattr(self, name, getattr(self, name).numpy())
            return tokens_per_expert

    return _HostSplits


@contextlib.contextmanager
def on_host(device: torch.device):
    """Point 3 of the module docstring on CPU; nothing on CUDA."""
    if device.type == "cuda":
        yield
        return
    with mock.patch("torch.cuda.current_device", lambda: torch.device("cpu")):
        yield


class MegatronAlltoAll:
    """Megatron-Core's all-to-all dispatcher over parallel_state's EP group (TP = 1)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, device: torch.device):
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig

        groups = get_default_pg_collection()
        ep_size, ep_rank = groups.ep.size(), groups.ep.rank()
        local = num_experts // ep_size
        config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, add_bias_linear=False,
                                   num_moe_experts=num_experts, moe_router_topk=top_k,
                                   moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)
        cls, stream = MoEAlltoAllTokenDispatcher, contextlib.nullcontext()
        if device.type != "cuda":
            cls = _host_splits_class()
            stream = mock.patch.object(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
        with stream:
            self.mcore = cls(local, list(range(ep_rank * local, (ep_rank + 1) * local)), config, groups)
        self.num_experts = num_experts

    def route(self, experts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """experts, weights [N, k] → Megatron-Core's routing map [N, E] bool and probs [N, E]."""
        N = experts.shape[0]
        routing_map = torch.zeros(N, self.num_experts, dtype=torch.bool, device=experts.device)
        probs = torch.zeros(N, self.num_experts, dtype=weights.dtype, device=weights.device)
        return routing_map.scatter_(1, experts, True), probs.scatter(1, experts, weights)

    def dispatch(self, z: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor]):
        """z [N, ℓ] → rows for this rank's experts [M, ℓ] sorted by expert, tokens per expert
        [E_l] (on z's device), their gate weights [M] (the handle)."""
        tokens, probs = self.mcore.dispatch_preprocess(z, *route)
        tokens, probs = self.mcore.token_dispatch(tokens, probs)
        grouped, tokens_per_expert, probs = self.mcore.dispatch_postprocess(tokens, probs)
        return grouped, tokens_per_expert.to(z.device), probs

    def expert_stacks(self, experts, probs) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2): the home stacks (no replicas)."""
        return experts.w13, experts.w2

    def combine(self, y: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """y [M, ℓ] → u [N, ℓ]; the gate weights came with the rows (``weights`` is unused). The
        weighted rows keep y's dtype, as Megatron-Core's experts return them."""
        y = self.mcore.combine_preprocess((y * probs[:, None]).to(y.dtype))
        return self.mcore.combine_postprocess(self.mcore.token_combine(y))
