"""Start-up checks that a dataset's files belong together and match the tokenizer.

For every ``PREFIX`` in ``data.paths``:
- ``PREFIX.idx`` is a Megatron-Core index whose sequences add up to exactly the size of ``PREFIX.bin``
  (an ``.idx`` from another dataset or a cut ``.bin`` is caught before step 1);
- ``PREFIX.meta.json`` (written by ``data_prep``), when present, agrees with the index (documents,
  tokens, dtype) and with the tokenizer (EOD id, largest id, the tokenizer's fingerprint).

Every failure is a one-line ``ValueError`` naming the file and the fix. Reads only the index
header and arrays (memory-mapped), never the ``.bin``.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from k3train.data.tokenizer import K3Tokenizer

INDEX_HEADER = b"MMIDIDX\x00\x00"
# Megatron-Core's DType codes (megatron/core/datasets/indexed_dataset.py).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
REBUILD = "rebuild the dataset with: python -m data_prep.tokenize_corpus --input <corpus> --output-prefix {prefix}"


def _index(prefix: str) -> dict:
    """Counts, dtype and the bytes of ``.bin`` that ``PREFIX.idx`` describes."""
    path = prefix + ".idx"
    bad = f"{path} is not a complete Megatron-Core index; " + REBUILD.format(prefix=prefix)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != INDEX_HEADER:
        raise ValueError(bad)
    (version,), (code,) = struct.unpack("<Q", head[9:17]), struct.unpack("<B", head[17:18])
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    if version != 1 or code not in DTYPES or size < 34 + 12 * n_seq + 8 * n_doc:
        raise ValueError(bad)
    dtype = np.dtype(DTYPES[code])
    lengths = np.memmap(path, dtype=np.int32, mode="r", offset=34, shape=(n_seq,)) if n_seq else np.zeros(0)
    pointers = (np.memmap(path, dtype=np.int64, mode="r", offset=34 + 4 * n_seq, shape=(n_seq,)) if n_seq
                else np.zeros(0, dtype=np.int64))
    tokens = int(lengths.sum(dtype=np.int64))
    end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if n_seq else 0
    if end != tokens * dtype.itemsize:
        raise ValueError(bad)
    return {"sequences": n_seq, "documents": n_doc - 1, "tokens": tokens, "dtype": dtype, "bin_bytes": end}


def check_dataset(prefix: str, tokenizer: K3Tokenizer) -> None:
    """Raise a one-line ValueError when ``PREFIX.bin/.idx/.meta.json`` disagree or the tokenizer differs."""
    idx = _index(prefix)
    bin_size = os.path.getsize(prefix + ".bin")
    if bin_size != idx["bin_bytes"]:
        raise ValueError(f"{prefix}.bin has {bin_size} bytes but {prefix}.idx describes {idx['bin_bytes']} "
                         f"({idx['tokens']} tokens of {idx['dtype'].name}): the .bin is cut short or the two files "
                         f"come from different datasets; " + REBUILD.format(prefix=prefix))
    path = prefix + ".meta.json"
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path} ({err}); delete it or " + REBUILD.format(prefix=prefix)) from None
    for key, have in (("documents", idx["documents"]), ("tokens", idx["tokens"]), ("dtype", idx["dtype"].name)):
        if key in meta and meta[key] != have:
            raise ValueError(f"{path} says {key}={meta[key]} but {prefix}.idx holds {have}: the files come from "
                             f"different runs of data_prep; " + REBUILD.format(prefix=prefix))
    _check_tokenizer(prefix, meta, tokenizer)


def _check_tokenizer(prefix: str, meta: dict, tokenizer: K3Tokenizer) -> None:
    fix = f"set data.tokenizer to the tokenizer.json the data was made with ({prefix}.tokenizer.json)"
    if "eod" in meta and int(meta["eod"]) != tokenizer.eod:
        raise ValueError(f"dataset {prefix} was tokenized with EOD id {meta['eod']}, but the tokenizer "
                         f"{tokenizer.path} has EOD id {tokenizer.eod}; {fix}")
    if int(meta.get("max_token_id", -1)) >= tokenizer.vocab_size:
        raise ValueError(f"dataset {prefix} holds token id {meta['max_token_id']}, beyond the tokenizer "
                         f"{tokenizer.path} ({tokenizer.vocab_size} ids); {fix}")
    fp = meta.get("tokenizer_fingerprint")
    if fp and fp != tokenizer.fingerprint:
        raise ValueError(f"dataset {prefix} was made with another tokenizer (fingerprint {fp}) than "
                         f"{tokenizer.path} ({tokenizer.fingerprint}); {fix}")
