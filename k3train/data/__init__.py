"""Data: tokenizer, Megatron-Core GPT datasets, deterministic DP batches, the default corpus.

Typical use (every rank)::

    from k3train.data import resolve_data, load_tokenizer, check_vocab, build_datasets, BatchIterator

    data = resolve_data(cfg.data, vocab_size=min(cfg.model.vocab_size, 512))
    tok = load_tokenizer(data.tokenizer_path)
    check_vocab(cfg.model.vocab_size, tok)
    train_ds, valid_ds = build_datasets(cfg.data, cfg.data.seq_len, n_train, n_valid, tok,
                                        paths=data.paths, weights=data.weights)
    it = BatchIterator(train_ds, micro_batch_size, dp_rank, dp_size, consumed_samples)

Importing this package does not import Megatron-Core; ``build_datasets`` does.
"""

from k3train.data.batches import BatchIterator
from k3train.data.datasets import ResolvedData, build_datasets, check_dataset_files, resolve_data
from k3train.data.default_corpus import ensure_default_dataset, resolve_cache_dir
from k3train.data.tokenizer import (
    EOD_TOKEN,
    K3Tokenizer,
    check_vocab,
    default_tokenizer_path,
    load_tokenizer,
    train_byte_level_bpe,
)

__all__ = [
    "BatchIterator",
    "EOD_TOKEN",
    "K3Tokenizer",
    "ResolvedData",
    "build_datasets",
    "check_dataset_files",
    "check_vocab",
    "default_tokenizer_path",
    "ensure_default_dataset",
    "load_tokenizer",
    "resolve_cache_dir",
    "resolve_data",
    "train_byte_level_bpe",
]
