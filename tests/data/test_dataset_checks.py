"""Issue 14 item 2: data that does not match is refused at start-up, in one line naming the file.

The ``.idx`` must describe exactly the ``.bin`` beside it and agree with ``PREFIX.meta.json``; the
tokenizer must be the one the data was made with.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from k3train.data.checks import check_dataset


@pytest.fixture
def datasets(tmp_path, make_jsonl, tiny_tokenizer):
    from data_prep.tokenize_corpus import tokenize_corpus

    prefixes = []
    for name, n in (("a", 30), ("b", 45)):
        corpus, _ = make_jsonl(n, name=f"{name}.jsonl")
        prefix = str(tmp_path / name)
        tokenize_corpus([str(corpus)], prefix, tokenizer=tiny_tokenizer.path, progress=False)
        prefixes.append(prefix)
    return prefixes, tiny_tokenizer


def _fails(prefix, tokenizer, *needles):
    with pytest.raises(ValueError) as err:
        check_dataset(prefix, tokenizer)
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_matching_data_passes(datasets):
    (a, b), tok = datasets
    check_dataset(a, tok)
    check_dataset(b, tok)


def test_idx_of_another_dataset(datasets):
    (a, b), tok = datasets
    shutil.copy(b + ".idx", a + ".idx")
    _fails(a, tok, a + ".idx", "data_prep")


@pytest.mark.parametrize("cut", ["10_bytes", "half"])
def test_short_bin(datasets, cut):
    (a, _), tok = datasets
    size = os.path.getsize(a + ".bin")
    os.truncate(a + ".bin", size - 10 if cut == "10_bytes" else size // 2)
    _fails(a, tok, a + ".bin", str(size))


def test_metadata_disagrees(datasets):
    (a, _), tok = datasets
    path = a + ".meta.json"
    meta = json.loads(open(path).read())
    meta["tokens"] += 1
    open(path, "w").write(json.dumps(meta))
    _fails(a, tok, path, "tokens")


def test_other_tokenizer_with_the_same_vocab_size(datasets, tmp_path, random_text):
    import random

    from k3train.data import K3Tokenizer, load_tokenizer, train_byte_level_bpe

    (a, _), tok = datasets
    rng = random.Random(7)
    other = K3Tokenizer(train_byte_level_bpe([random_text(rng, 80)[::-1] for _ in range(60)], 300))
    other.save(str(tmp_path / "other.json"))
    other = load_tokenizer(str(tmp_path / "other.json"))
    assert other.vocab_size == tok.vocab_size and other.fingerprint != tok.fingerprint
    _fails(a, other, "tokenizer", str(tmp_path / "other.json"), "data.tokenizer")


def test_build_datasets_checks_at_start_up(datasets):
    from k3train.config.schema import DataConfig
    from k3train.data.datasets import build_datasets

    (a, _), tok = datasets
    os.truncate(a + ".bin", os.path.getsize(a + ".bin") // 2)
    with pytest.raises(ValueError, match=r"a\.bin"):
        build_datasets(DataConfig(paths=[a], cache_dir=os.path.dirname(a)), 32, 8, 0, tok)
