"""The K3 language backbone (K3_SPEC.md §2): embedding → L K3 layers → AttnRes output → LM head.

    P = embed(tokens); B = []; pending = None
    for l in layers: B, P, pending = layer_l(B, P, pending)       (the running sum is P + pending)
    h = RMSNorm_final(Agg_out(B ∪ [P + pending]));  logits = lm_head(h)   (vocabulary sharded over TP)

``forward(tokens, position_ids, labels=None, loss_mask=None)`` returns the mean token loss
when labels are given, else the (TP-local) logits [B, T, V/tp].

Under context parallelism the inputs are this rank's share [B, T/C] of each row
(``k3train.parallel.context_shard``) and the loss is C · Σ_local loss / Σ_rows mask, so that the
mean over the CP ranks (taken with the gradients over DP×CP) is the rows' mean token loss.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from k3train.config.schema import ModelConfig
from k3train.model import document_attention
from k3train.model.attn_res import AttnResAggregator
from k3train.model.documents import Documents
from k3train.model.layer import K3Layer
from k3train.model.moe import LatentMoE
from k3train.model.norm import RMSNorm
from k3train.model.roles import Kind
from k3train.parallel.context_shard import ContextShard
from k3train.parallel.state import ParallelGroups
from k3train.parallel.tensor_parallel import TPSpec


class K3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None, linear_backend: str = "auto",
                 ep_dispatcher: str = "alltoall", precision_recipe: str = "bf16"):
        super().__init__()
        self.cfg = cfg
        self.tp = TPSpec(groups, cfg.init_std, linear_backend, ep_dispatcher, precision_recipe)
        cp = groups is not None and groups.cp_size > 1
        self.context = ContextShard(groups.cp, groups.cp_size, groups.cp_rank) if cp else None
        #: pad the packed documents' offsets to a few lengths (``Documents.from_position_ids``); set by
        #: ``compile_layers``, whose graphs would otherwise meet a new length with every document count
        self.bucket_documents = False
        d = cfg.hidden_size
        self.embed_tokens = self.tp.embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(K3Layer(cfg, self.tp, i) for i in range(cfg.num_layers))
        self.output_attn_res = AttnResAggregator(d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, autocast_output=True)  # feeds the LM head only
        self.lm_head = self.tp.column(d, cfg.vocab_size, what="model.vocab_size", kind=Kind.LM_HEAD)

    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    def documents(self, tokens: torch.Tensor, position_ids: torch.Tensor | None,
                  documents: Documents | None = None) -> Documents:
        """The micro-batch's documents: ``documents`` when the caller built them (the trainer does, from
        the batch's host copy, so that counting them reads nothing back from the GPU), else from
        ``position_ids`` (one document per row without them); on CUDA with FlexAttention, with the
        block mask."""
        if documents is None:
            documents = self._documents(tokens, position_ids)
        flex = document_attention.DOCUMENT_ATTENTION == "flex" and documents.block_mask is None
        if flex and tokens.is_cuda and not documents.one_per_row and documents.shard is None:
            block_mask = document_attention.document_block_mask(documents.doc_ids)
            documents = dataclasses.replace(documents, block_mask=block_mask)
        return documents

    def host_documents(self, position_ids: torch.Tensor, device: torch.device) -> Documents | None:
        """The documents of a host batch's ``position_ids`` [B, T], counted on the host and moved to
        ``device`` (``Documents.to``): nothing read back from the GPU. None under context parallelism,
        whose shards' documents are built on the devices."""
        if self.context is not None:
            return None
        return Documents.from_position_ids(position_ids, bucket=self.bucket_documents).to(device)

    def _documents(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> Documents:
        if position_ids is None and self.context is None:  # one document per row: no host sync
            return Documents.single(*tokens.shape, device=tokens.device)
        if position_ids is None:
            position_ids = self.context.global_index(tokens.shape[1], tokens.device).expand_as(tokens)
        if self.context is None:
            return Documents.from_position_ids(position_ids, bucket=self.bucket_documents)
        return Documents.for_shard(position_ids, self.context)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first partial sum P = e, fp32 [B, T, d]."""
        return self.embed_tokens(tokens).float()

    def head(self, bank: list[torch.Tensor], partial: torch.Tensor, labels: torch.Tensor | None = None,
             loss_mask: torch.Tensor | None = None, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Output AttnRes over B ∪ [P + pending], final norm, LM head; the mean token loss when labels are
        given."""
        h, _ = self.output_attn_res([*bank, partial], self.norm, residual=pending)
        logits = self.lm_head(h)
        if labels is None:
            return logits
        losses = self.tp.cross_entropy(logits, labels, grad_into_logits=True)  # the logits are ours alone
        if loss_mask is None:
            loss_mask = torch.ones_like(losses)
        total, count = (losses * loss_mask).sum(), loss_mask.sum()
        if self.context is not None:
            total, count = total * self.context.size, self.context.all_reduce_sum(count)
        return total / count.clamp(min=1)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        docs = self.documents(tokens, position_ids, documents)
        partial = self.embed(tokens)
        bank: list[torch.Tensor] = []
        pending = None
        for layer in self.layers:
            bank, partial, pending = layer(bank, partial, docs, pending)
        return self.head(bank, partial, labels, loss_mask, pending)
