"""Deterministic, resumable micro-batches for data-parallel training.

The dataset is read in index order (Megatron-Core already shuffled it). Each
global micro-batch covers ``micro_batch_size * dp_size`` consecutive samples
starting at ``consumed_samples``; DP rank ``r`` takes the ``r``-th slice of
``micro_batch_size``. ``consumed_samples`` counts samples over all DP ranks, as
Megatron does, so a checkpoint taken at any DP size resumes at the same place.
Iteration stops (on every rank at once) when a whole global micro-batch no
longer fits in the dataset. Under context parallelism the CP ranks of one DP rank
read the same samples and each keeps its share of every row (``ContextShard.split``).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import torch

from k3train.parallel.context_shard import ContextShard

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
_DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32, "position_ids": torch.int64}


def batch_to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A CPU micro-batch on ``device``. To a GPU through pinned host memory: a copy from pageable memory
    waits for every kernel already queued on the stream (the host stalls, as on a read-back), a copy
    from pinned memory is queued behind them and the host goes on."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


class BatchIterator:
    """Yields ``{"tokens", "labels", "loss_mask", "position_ids"}``, each a CPU tensor [b, s]
    (int64, int64, float32, int64). ``position_ids`` restart at 0 at every document start."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, context: ContextShard | None = None):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if dataset is None:
            raise ValueError("dataset is None (is the split empty? check data.split)")
        self.dataset = dataset
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.consumed_samples = int(consumed_samples)
        self.context = context

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches left."""
        return max(0, (len(self.dataset) - self.consumed_samples) // self.global_micro_batch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.consumed_samples
        if start + self.global_micro_batch > len(self.dataset):
            raise StopIteration
        first = start + self.dp_rank * self.micro_batch_size
        samples = [self.dataset[i] for i in range(first, first + self.micro_batch_size)]
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]).to(_DTYPES[k]) for k in KEYS}
        self.consumed_samples = start + self.global_micro_batch
        if self.context is not None:
            batch = {k: self.context.split(v) for k, v in batch.items()}
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "consumed_samples" not in state:
            raise ValueError("data iterator state has no 'consumed_samples'")
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"data iterator state has consumed_samples={consumed} < 0")
        n = state.get("dataset_len")
        if n is not None and int(n) != len(self.dataset):
            warnings.warn(
                f"resuming data at sample {consumed} of a dataset that had {n} samples and now has "
                f"{len(self.dataset)} (different train.steps, batch size or data?): the sample order "
                f"may differ from the original run",
                stacklevel=2,
            )
        if consumed % self.global_micro_batch:
            warnings.warn(
                f"consumed_samples={consumed} is not a multiple of micro_batch_size*dp_size="
                f"{self.global_micro_batch}; batches are cut at a different place than before",
                stacklevel=2,
            )
        self.consumed_samples = consumed
