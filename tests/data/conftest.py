"""Fixtures for the data tests: small random corpora and datasets in tmp dirs."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_EXTRA = ["é", "ß", "中文", "🙂", "\t", "def ", "return ", "(", ")", ":", "\n    "]


def random_text(rng: random.Random, n_words: int) -> str:
    words = []
    for _ in range(n_words):
        if rng.random() < 0.1:
            words.append(rng.choice(_EXTRA))
        else:
            words.append("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 8))))
    return " ".join(words) + rng.choice([".", "!\n", "\n\n", ""])


@pytest.fixture(name="random_text")
def random_text_fixture():
    return random_text


@pytest.fixture(name="write_synthetic_dataset")
def write_synthetic_dataset_fixture():
    return write_synthetic_dataset


@pytest.fixture
def rng(request):
    seed = random.SystemRandom().randrange(2**31)
    print(f"random seed {seed} for {request.node.name}")
    return random.Random(seed)


@pytest.fixture
def make_jsonl(tmp_path, rng):
    """Write a JSONL file of ``n`` random documents; return (path, texts)."""

    def make(n: int = 40, name: str = "corpus.jsonl", words=(5, 60)):
        texts = [random_text(rng, rng.randint(*words)) for _ in range(n)]
        path = tmp_path / name
        with open(path, "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t, "id": rng.random()}) + "\n")
        return path, texts

    return make


@pytest.fixture
def tiny_tokenizer(tmp_path, rng):
    """A trained 300-id byte-level BPE saved to disk (K3Tokenizer)."""
    from k3train.data import K3Tokenizer, train_byte_level_bpe

    texts = [random_text(rng, 50) for _ in range(50)]
    tok = K3Tokenizer(train_byte_level_bpe(texts, 300))
    path = tmp_path / "tok.json"
    tok.save(str(path))
    from k3train.data import load_tokenizer

    return load_tokenizer(str(path))


def write_synthetic_dataset(prefix: str, lengths, values, eod: int = 0) -> None:
    """Document i = ``lengths[i]`` copies of ``values[i]``, then EOD. Lets a test tell
    from any token which document (and so which split) it came from."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n, v in zip(lengths, values):
        b.add_item(torch.tensor([v] * n + [eod], dtype=torch.int64))
        b.end_document()
    b.finalize(prefix + ".idx")
