"""Train/validation datasets through Megatron-Core's GPTDataset and blended builder.

Samples are ``seq_len + 1`` tokens cut from the concatenation of shuffled
documents (each ending with EOD), so one row can hold several documents. Per
sample, ``position_ids`` restart at 0 on the token after every EOD
(``reset_position_ids=True``) and at the start of the row; the model derives its
document boundaries from that. ``reset_attention_mask=False`` and
``create_attention_mask=False``: no dense [s, s] mask is built, the model masks
per document itself. ``eod_mask_loss=True``: the position whose *input* is EOD
is not trained, because its label is the first token of an unrelated document;
predicting EOD at the end of a document is still trained.

The split (``DataConfig.split``, e.g. "98,2,0") is by whole documents, so train
and validation never share a document. Several ``DataConfig.paths`` are blended
with ``DataConfig.weights`` (or in proportion to their sizes when no weights).

Megatron-Core 0.16.1 notes (CPU):
  * ``BlendedDataset`` calls ``torch.distributed.get_rank()`` on a cache miss even
    without a process group, so the blend-level indices are not cached on disk
    (they are cheap); the per-dataset GPTDataset indices are cached under
    ``<cache_dir>/index_cache/<fingerprint of the .bin/.idx>``, so a rebuilt dataset
    never reuses stale indices.
  * With a process group, the builder builds on global rank 0, barriers, then the
    other ranks load from that cache; every rank must call ``build_datasets``.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from k3train.data.checks import check_dataset
from k3train.data.default_corpus import ensure_default_dataset, resolve_cache_dir
from k3train.data.tokenizer import K3Tokenizer, default_tokenizer_path

PREP_HINT = "python -m data_prep.tokenize_corpus --input <corpus> --output-prefix {prefix}"
MEMORISE_PASSES = 4  # passes over the train split past which passes_over_data's line warns


@dataclass
class ResolvedData:
    paths: list[str]
    weights: Optional[list[float]]
    tokenizer_path: str


def resolve_data(cfg, vocab_size: int) -> ResolvedData:
    """Turn a ``DataConfig`` into dataset prefixes and a tokenizer path.

    With ``cfg.paths`` empty, builds (once) the embedded default corpus with a
    byte-level BPE of ``vocab_size`` (pass ``min(model.vocab_size, 512)``). The
    tokenizer is ``cfg.tokenizer``, else the one written next to the first dataset.
    Call it on every rank; concurrent calls on one node are safe.
    """
    paths = [os.path.expanduser(str(p)) for p in (cfg.paths or [])]
    weights = [float(w) for w in (cfg.weights or [])] or None
    if not paths:
        if weights:
            raise ValueError("data.weights is set but data.paths is empty; give one weight per path")
        if cfg.tokenizer:
            raise ValueError("data.tokenizer is set but data.paths is empty: the default corpus comes with its "
                             "own tokenizer; unset data.tokenizer, or set data.paths to data made with it")
        prefix, tok = ensure_default_dataset(cfg.cache_dir, vocab_size)
        return ResolvedData([prefix], None, tok)
    check_dataset_files(paths)
    tok = os.path.expanduser(str(cfg.tokenizer)) if cfg.tokenizer else default_tokenizer_path(paths[0])
    if not cfg.tokenizer and not os.path.isfile(tok):
        raise FileNotFoundError(f"no tokenizer for dataset {paths[0]}: {tok} is missing; set data.tokenizer "
                                f"to the tokenizer.json the data was made with")
    return ResolvedData(paths, weights, tok)


def check_dataset_files(paths: Sequence[str]) -> None:
    for prefix in paths:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise FileNotFoundError(
                    f"dataset file missing: {prefix}{ext} (data.paths entry {prefix!r}); build it with: "
                    + PREP_HINT.format(prefix=prefix)
                )


def parse_split(split) -> list[float]:
    """Validate ``data.split`` ("train,valid,test" weights, e.g. "98,2,0")."""
    parts = [p.strip() for p in str(split).split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        vals = []
    if not 1 <= len(vals) <= 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ValueError(f"data.split={split!r} must be up to 3 non-negative comma-separated weights "
                         f"(train,valid,test) with a positive sum, e.g. data.split=98,2,0")
    return vals + [0.0] * (3 - len(vals))


def _split_doc_counts(num_docs: int, split_matrix) -> list[int]:
    out = []
    for bookends in split_matrix:
        if bookends is None:
            out.append(0)
        else:
            out.append(int(round(bookends[1] * num_docs)) - int(round(bookends[0] * num_docs)))
    return out


def train_split_tokens(paths: Sequence[str], split) -> list[int]:
    """Tokens (EODs included) in each dataset's train split: its first documents, as many as
    Megatron-Core's builder gives it (``_split_doc_counts`` on its split matrix)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    parse_split(split)  # our error message first
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(str(split)))
    out = []
    for p in paths:
        index = IndexedDataset(os.path.expanduser(str(p)))  # kept alive: its lengths are a view of its mmap
        lengths = index.sequence_lengths
        out.append(int(lengths[: _split_doc_counts(lengths.shape[0], split_matrix)[0]].sum()))
    return out


def passes_over_data(cfg, paths: Sequence[str], weights: Optional[Sequence[float]], seq_len: int,
                     num_train_samples: int) -> tuple[float, str]:
    """How many times a run of ``num_train_samples`` rows of ``seq_len`` tokens reads its train split
    (the most-read dataset of a blend), and a log line that says so. Each dataset gets its weight's
    share of the rows (its size's share without weights), so passes_i = share_i · rows · seq_len /
    tokens_i."""
    paths = list(paths)
    tokens = train_split_tokens(paths, cfg.split)
    shares = [float(w) for w in weights] if weights else [float(t) for t in tokens]
    total = sum(shares)
    passes = max(s / total * num_train_samples * seq_len / max(t, 1) for s, t in zip(shares, tokens))
    line = (f"data: the train split holds {sum(tokens):,} tokens; this run reads "
            f"{num_train_samples * seq_len:,} ({num_train_samples:,} rows of {seq_len}): {passes:.2f} passes")
    if passes > MEMORISE_PASSES:
        line += (f". Over {MEMORISE_PASSES} passes the model memorises the data (the loss falls towards 0 and "
                 f"stops measuring learning); for longer runs or larger batches build a larger corpus: "
                 + PREP_HINT.format(prefix="<prefix>") + " and set data.paths=[<prefix>]")
    return passes, line


def _default_prefix_for(cfg, tokenizer: K3Tokenizer) -> str:
    """The dataset for an empty ``data.paths``: the one this tokenizer was written beside
    (resolve_data's default corpus), else the default corpus at this tokenizer's vocab size."""
    suffix = ".tokenizer.json"
    if tokenizer.path and tokenizer.path.endswith(suffix):
        prefix = tokenizer.path[: -len(suffix)]
        if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            return prefix
    return ensure_default_dataset(cfg.cache_dir, tokenizer.vocab_size)[0]


def build_datasets(cfg, seq_len: int, num_train_samples: int, num_valid_samples: int,
                   tokenizer: K3Tokenizer, *, paths: Optional[Sequence[str]] = None,
                   weights: Optional[Sequence[float]] = None,
                   is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Build ``(train_ds, valid_ds)`` from a ``DataConfig``.

    ``paths``/``weights`` override ``cfg.paths``/``cfg.weights``. With neither, the
    dataset written beside the tokenizer is used (``resolve_data``'s default corpus),
    else the default corpus is built with ``tokenizer.vocab_size``. Each dataset item is a
    dict of 1-D tensors ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of
    length ``seq_len`` (blended datasets add ``dataset_id``). ``valid_ds`` is None when
    the split gives validation no share or ``num_valid_samples`` is 0. Must be called
    on every rank when a process group exists.
    """
    import numpy  # noqa: F401  (megatron needs it; keep the import error readable)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from k3train.data.megatron_gpt import K3GPTDataset

    paths = [os.path.expanduser(str(p)) for p in (paths if paths is not None else cfg.paths)]
    if weights is None:
        weights = [float(w) for w in (cfg.weights or [])] or None
    else:
        weights = [float(w) for w in weights] or None
    if not paths:
        if weights:
            raise ValueError("data.weights is set but data.paths is empty; give one weight per path")
        paths = [_default_prefix_for(cfg, tokenizer)]
    if weights is not None:
        if len(weights) != len(paths):
            raise ValueError(f"data.weights has {len(weights)} entries but data.paths has {len(paths)}; "
                             f"give one weight per path")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"data.weights must be non-negative with a positive sum, got {weights}")
    if seq_len < 1:
        raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
    if num_train_samples < 1:
        raise ValueError(f"num_train_samples must be >= 1, got {num_train_samples}")
    check_dataset_files(paths)
    for p in paths:
        check_dataset(p, tokenizer)  # .idx/.bin/meta.json agree, and the tokenizer is the data's

    parse_split(cfg.split)
    cache_root = os.path.join(resolve_cache_dir(cfg.cache_dir), "index_cache")
    config = GPTDatasetConfig(
        random_seed=int(cfg.seed),
        sequence_length=int(seq_len),
        blend=(paths, weights),
        split=str(cfg.split),
        path_to_cache=None,  # see the module docstring; K3GPTDataset sets its own
        tokenizer=tokenizer,
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=True,
        create_attention_mask=False,
        mmap_bin_files=True,
        num_dataset_builder_threads=1,
    )
    config.k3_index_cache_root = cache_root
    sizes = [int(num_train_samples), max(int(num_valid_samples), 0), 0]
    rank_fn = is_built_on_rank or (lambda: True)
    mlog = logging.getLogger("megatron.core.datasets")
    level = mlog.level
    if level == logging.NOTSET:
        mlog.setLevel(logging.WARNING)
    try:
        if config.split_matrix[0] is None:
            raise ValueError(f"data.split={cfg.split} gives training no share")
        want = [num_train_samples, num_valid_samples, 0]
        for p in paths:
            n_docs = IndexedDataset(p).sequence_lengths.shape[0]
            for name, n, share, req in zip(("train", "valid"), _split_doc_counts(n_docs, config.split_matrix),
                                           config.split_matrix, want):
                if share is not None and req > 0 and n == 0:
                    raise ValueError(f"the {name} split of {p} is empty: data.split={cfg.split} over {n_docs} "
                                     f"documents; use more documents or a larger {name} share")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pad token id.*")
            train_ds, valid_ds, _ = BlendedMegatronDatasetBuilder(K3GPTDataset, sizes, rank_fn, config).build()
    finally:
        mlog.setLevel(level)
    if num_valid_samples <= 0:
        valid_ds = None
    return train_ds, valid_ds
