import os
import threading

import pytest

from k3train.config.schema import DataConfig
from k3train.data import BatchIterator, build_datasets, ensure_default_dataset, load_tokenizer, resolve_data
from k3train.data import default_corpus
from k3train.data.default_corpus import resolve_cache_dir, stdlib_files

SMALL = 96 * 1024  # a small slice of the stdlib keeps the test fast; the real default is MAX_BYTES


def test_stdlib_subset_is_deterministic_and_capped():
    a, b = stdlib_files(), stdlib_files()
    assert a == b and len(a) > 20
    total = sum(f.stat().st_size for f in a)
    assert default_corpus.MAX_BYTES <= total <= default_corpus.MAX_BYTES + default_corpus.MAX_FILE_BYTES
    assert all(f.suffix == ".py" and "site-packages" not in f.parts and "test" not in f.parts for f in a)
    assert stdlib_files(SMALL) == a[:len(stdlib_files(SMALL))]


def test_built_once_reused_and_race_safe(tmp_path, capfd):
    cache = str(tmp_path / "cache")
    results, errors = [], []

    def build():
        try:
            results.append(ensure_default_dataset(cache, 300, max_bytes=SMALL, progress=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert capfd.readouterr().err.count("building the default corpus") == 1
    prefix, tok_path = results[0]
    root = os.path.join(cache, "default_corpus")
    assert [d for d in os.listdir(root) if not d.startswith(".lock")] == [os.path.basename(os.path.dirname(prefix))]
    mtimes = {f: os.stat(f).st_mtime_ns for f in (prefix + ".bin", prefix + ".idx", tok_path)}
    assert ensure_default_dataset(cache, 300, max_bytes=SMALL) == (prefix, tok_path)
    assert {f: os.stat(f).st_mtime_ns for f in mtimes} == mtimes
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size <= 300
    # a different vocab is a different dataset
    p2, _ = ensure_default_dataset(cache, 320, max_bytes=SMALL, progress=False)
    assert p2 != prefix


def test_resolve_data_uses_the_default_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(default_corpus, "MAX_BYTES", SMALL)
    monkeypatch.setenv("K3TRAIN_CACHE", str(tmp_path / "envcache"))
    cfg = DataConfig(split="70,30,0")  # cache_dir is the unresolved "${oc.env:K3TRAIN_CACHE,...}" without Hydra
    assert resolve_cache_dir(cfg.cache_dir) == str(tmp_path / "envcache")
    data = resolve_data(cfg, 512)
    assert data.paths[0].startswith(str(tmp_path / "envcache")) and data.weights is None
    tok = load_tokenizer(data.tokenizer_path)
    assert 257 <= tok.vocab_size <= 512
    train, valid = build_datasets(cfg, 64, 16, 4, tok, paths=data.paths)
    b = next(BatchIterator(train, 2, 0, 1))
    text = tok.decode(b["tokens"][0].tolist())
    assert text.isprintable() or "\n" in text
    # build_datasets on an empty data.paths finds the same default dataset by itself
    train2, _ = build_datasets(cfg, 64, 16, 4, tok)
    assert train2[0]["tokens"].tolist() == train[0]["tokens"].tolist()
    built = [d for d in os.listdir(tmp_path / "envcache" / "default_corpus") if not d.startswith(".")]
    assert len(built) == 1


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size >= 257"):
        ensure_default_dataset(str(tmp_path), 256)
