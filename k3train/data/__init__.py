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

import importlib

# Lazy exports: ``import k3train.data.tokenizer`` (the data_prep CLI) must not pull in torch.
_EXPORTS = {
    "BatchIterator": "batches",
    "ResolvedData": "datasets",
    "build_datasets": "datasets",
    "check_dataset_files": "datasets",
    "resolve_data": "datasets",
    "ensure_default_dataset": "default_corpus",
    "resolve_cache_dir": "default_corpus",
    "EOD_TOKEN": "tokenizer",
    "K3Tokenizer": "tokenizer",
    "check_vocab": "tokenizer",
    "default_tokenizer_path": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_byte_level_bpe": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
