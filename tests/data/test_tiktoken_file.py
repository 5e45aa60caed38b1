"""A tiktoken BPE file as a tokenizer: ids equal tiktoken's rank-merge rule (a naive reference
here), Kimi's pre-tokenizer splits, special tokens from tokenizer_config.json, bad files refused,
and data_prep / generate's tokenizer lookup work with it. The test builds its own small file."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest

from data_prep.tokenize_corpus import tokenize_corpus
from k3train.data import load_tokenizer, train_byte_level_bpe
from k3train.data.tiktoken_file import NUM_RESERVED_SPECIAL_TOKENS, byte_to_char, tiktoken_tokenizer
from k3train.data.tokenizer import tokenizer_in


def tiktoken_encode(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's rule: a piece that is a token stays whole; else merge the adjacent pair whose
    concatenation has the lowest rank (leftmost on ties) until no pair is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        rank, i = min((ranks.get(parts[i] + parts[i + 1], math.inf), i) for i in range(len(parts) - 1))
        if rank == math.inf:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


@pytest.fixture
def tiktoken_file(tmp_path, rng, random_text):
    """A tiktoken file whose ranks follow a byte-level BPE trained here (merge order = rank order,
    the 256 bytes shuffled first), with a tokenizer_config.json naming three special tokens."""
    trained = train_byte_level_bpe([random_text(rng, rng.randint(5, 60)) for _ in range(80)], 700)
    to_byte = {c: b for b, c in byte_to_char().items()}
    by_id = sorted((i, t) for t, i in trained.get_vocab().items() if i > 0)  # id 0 is the EOD token
    tokens = [bytes(to_byte[c] for c in t) for _, t in by_id]
    singles, merged = [t for t in tokens if len(t) == 1], [t for t in tokens if len(t) > 1]
    rng.shuffle(singles)
    ranks = {t: r for r, t in enumerate(singles + merged)}
    path = tmp_path / "kimi" / "tiktoken.model"
    path.parent.mkdir()
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(n): {"content": "[BOS]", "special": True}, str(n + 1): {"content": "[EOS]", "special": True},
        str(n + 2): {"content": "<|im_end|>", "special": True}}}))
    return path, ranks


def to_bytes(byte_level: str) -> bytes:
    to_byte = {c: b for b, c in byte_to_char().items()}
    return bytes(to_byte[c] for c in byte_level)


def test_ids_follow_tiktoken_rank_merges(tiktoken_file, rng, random_text):
    path, ranks = tiktoken_file
    tok = load_tokenizer(str(path))
    assert len(ranks) > 256 + 100  # merges were learned
    for text in [random_text(rng, rng.randint(1, 80)) for _ in range(40)] + ["\x00\x07 \u2028 \U0001F600 ﻿", ""]:
        pieces = tok.backend.pre_tokenizer.pre_tokenize_str(text)
        assert b"".join(to_bytes(p) for p, _ in pieces) == text.encode("utf-8")
        want = [i for p, _ in pieces for i in tiktoken_encode(to_bytes(p), ranks)]
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text


def test_byte_map_is_byte_levels(tiktoken_file):
    from tokenizers import pre_tokenizers

    m = byte_to_char()
    assert sorted(m) == list(range(256)) and set(m.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for cp in [*range(0x20, 0x800, 7), 0x4E2D, 0x1F600]:
        (got, _), = level.pre_tokenize_str(chr(cp))
        assert got == "".join(m[b] for b in chr(cp).encode("utf-8"))


def test_kimi_pre_tokenizer_splits(tiktoken_file):
    tok = load_tokenizer(str(tiktoken_file[0]))

    def split(text: str) -> list[str]:
        return [to_bytes(p).decode("utf-8") for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]

    assert split("中文English混合") == ["中文", "English", "混合"]  # Han runs alone
    assert split("Hello, world!") == ["Hello", ",", " world", "!"]
    assert split("1234567") == ["123", "456", "7"]
    assert split("I'm HERE's") == ["I'm", " HERE's"]
    assert split("a\n\nb") == ["a", "\n\n", "b"]
    assert split("x  y") == ["x", " ", " y"]


def test_special_tokens_and_vocab(tiktoken_file):
    path, ranks = tiktoken_file
    n = len(ranks)
    tok = load_tokenizer(str(path))
    assert tok.vocab_size == n + NUM_RESERVED_SPECIAL_TOKENS
    assert (tok.eod_token, tok.eod) == ("[EOS]", n + 1)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    assert vocab["[BOS]"] == n and vocab["<|im_end|>"] == n + 2
    assert vocab[f"<|reserved_token_{n + 3}|>"] == n + 3 and vocab[f"<|reserved_token_{n + 255}|>"] == n + 255
    assert tok.eod not in tok.encode("a[EOS]b")  # special names in text are plain text
    again = load_tokenizer(str(path.parent))  # an HF folder: its tiktoken.model
    assert again.fingerprint == tok.fingerprint and again.path == str(path)
    assert tokenizer_in(str(path.parent)) == str(path)


def test_bad_files_are_one_line_errors(tmp_path, tiktoken_file):
    path, ranks = tiktoken_file
    lines = path.read_text().splitlines()
    bad = tmp_path / "kimi" / "bad.model"
    bad.write_text("\n".join(lines[:5] + ["not base64!! 5"] + lines[5:]))
    with pytest.raises(ValueError, match=r"bad.model:6: not a tiktoken BPE line"):
        tiktoken_tokenizer(str(bad))
    bad.write_text("\n".join(lines[:-1] + [lines[-1].split()[0] + " 3"]))  # a repeated rank
    with pytest.raises(ValueError, match="ranks are not 0"):
        tiktoken_tokenizer(str(bad))
    cfg = path.parent / "tokenizer_config.json"
    cfg.write_text(json.dumps({"added_tokens_decoder": {"7": {"content": "[EOS]"}}}))
    with pytest.raises(ValueError, match="do not belong together"):
        tiktoken_tokenizer(str(path))
    cfg.unlink()  # no names: only reserved tokens, so no EOD
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(str(path))
    assert load_tokenizer(str(path), eod_token=f"<|reserved_token_{len(ranks)}|>").eod == len(ranks)


def test_data_prep_with_tiktoken_file(tmp_path, tiktoken_file, make_jsonl):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path, _ = tiktoken_file
    corpus, texts = make_jsonl(n=12)
    prefix = str(tmp_path / "data" / "corpus")
    s = tokenize_corpus([str(corpus)], prefix, tokenizer=str(path), progress=False)
    tok = load_tokenizer(str(path))
    saved = load_tokenizer(prefix + ".tokenizer.json")  # the converted copy the trainer reads
    assert s.eod == tok.eod and saved.fingerprint == tok.fingerprint
    ds = IndexedDataset(prefix)
    for i, text in enumerate(texts):
        assert np.asarray(ds[i]).tolist() == tok.encode(text) + [tok.eod] == saved.encode(text) + [saved.eod]
