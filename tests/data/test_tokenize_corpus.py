import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_prep.tokenize_corpus import CorpusError, main, tokenize_corpus
from k3train.data import load_tokenizer


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return ds, [np.asarray(ds[i]) for i in range(len(ds))]


def test_jsonl_to_indexed_dataset(make_jsonl, tmp_path, rng):
    path, texts = make_jsonl(n=rng.randint(20, 50))
    # blank lines are ignored; a whitespace-only document is skipped and counted
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"text": "  \n "}) + "\n")
    prefix = str(tmp_path / "out" / "corpus")
    s = tokenize_corpus([str(path)], prefix, vocab_size=400, progress=False)
    assert s.stats.documents == len(texts) and s.stats.skipped_empty == 1
    tok = load_tokenizer(prefix + ".tokenizer.json")
    ds, seqs = _read(prefix)
    assert len(ds) == len(texts)
    assert list(ds.document_indices) == list(range(len(texts) + 1))  # one sequence per document
    assert sum(len(q) for q in seqs) == s.stats.tokens
    for q, t in zip(seqs, texts):
        assert q[-1] == tok.eod and tok.eod not in q[:-1].tolist()
        assert tok.decode(q[:-1].tolist()) == t
    assert ds.index.dtype == np.uint16
    meta = json.load(open(prefix + ".meta.json"))
    assert meta["documents"] == len(texts) and meta["tokens"] == s.stats.tokens
    assert meta["eod"] == tok.eod and meta["max_token_id"] < tok.vocab_size <= 400
    assert not [f for f in os.listdir(tmp_path / "out") if ".tmp-" in f]
    line = s.line()
    assert f"{len(texts)} documents" in line and f"{s.stats.tokens} tokens" in line and prefix in line


def test_directory_with_glob_and_given_tokenizer(tmp_path, rng, tiny_tokenizer, random_text):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / ".git").mkdir()
    texts = {}
    for name in ["b.py", "a.py", "pkg/c.py", "pkg/notes.txt"]:
        texts[name] = random_text(rng, rng.randint(3, 30))
        (src / name).write_text(texts[name], encoding="utf-8")
    (src / ".git" / "x.py").write_text("hidden")
    (src / "blob.py").write_bytes(b"\x00\x01\x02binary")
    prefix = str(tmp_path / "code")
    s = tokenize_corpus([str(src)], prefix, tokenizer=tiny_tokenizer.path, globs=["**/*.py"], progress=False)
    assert s.stats.documents == 3 and s.stats.skipped_binary == 1
    _, seqs = _read(prefix)
    # sorted by relative path: a.py, b.py, pkg/c.py
    assert [tiny_tokenizer.decode(q[:-1].tolist()) for q in seqs] == [texts["a.py"], texts["b.py"], texts["pkg/c.py"]]
    assert load_tokenizer(prefix + ".tokenizer.json").fingerprint == tiny_tokenizer.fingerprint


def test_invalid_utf8_error_names_file_and_offset(tmp_path):
    good = json.dumps({"text": "hello world"}) + "\n"
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good.encode() + b'{"text": "x \xff y"}\n' + good.encode())
    with pytest.raises(CorpusError) as e:
        tokenize_corpus([str(path)], str(tmp_path / "o"), vocab_size=300, progress=False)
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg and f"byte {len(good) + 12}" in msg and "\n" not in msg
    s = tokenize_corpus([str(path)], str(tmp_path / "o"), vocab_size=300, on_invalid_utf8="skip", progress=False)
    assert s.stats.documents == 2 and s.stats.skipped_invalid_utf8 == 1
    # a plain file: the byte offset inside the file
    f = tmp_path / "t.txt"
    f.write_bytes(b"abc\xc3(def")
    with pytest.raises(CorpusError, match=r"t\.txt at byte 3"):
        tokenize_corpus([str(f)], str(tmp_path / "p"), vocab_size=300, progress=False)
    # a lone surrogate escaped in JSON is not valid text either
    g = tmp_path / "sur.jsonl"
    g.write_text('{"text": "a\\udc80b"}\n')
    with pytest.raises(CorpusError, match="surrogate"):
        tokenize_corpus([str(g)], str(tmp_path / "q"), vocab_size=300, progress=False)


def test_bad_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n" + json.dumps({"text": " "}) + "\n")
    with pytest.raises(CorpusError, match="no documents"):
        tokenize_corpus([str(empty)], str(tmp_path / "o"), vocab_size=300, progress=False)
    with pytest.raises(CorpusError, match="input not found: .*missing.jsonl"):
        tokenize_corpus([str(tmp_path / "missing.jsonl")], str(tmp_path / "o"), progress=False)
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text(json.dumps({"content": "abc"}) + "\n")
    with pytest.raises(CorpusError, match="line 1: no 'text' field"):
        tokenize_corpus([str(nokey)], str(tmp_path / "o"), progress=False)
    s = tokenize_corpus([str(nokey)], str(tmp_path / "o"), text_key="content", vocab_size=300, progress=False)
    assert s.stats.documents == 1
    notjson = tmp_path / "x.jsonl"
    notjson.write_text("{oops\n")
    with pytest.raises(CorpusError, match="line 1: not valid JSON"):
        tokenize_corpus([str(notjson)], str(tmp_path / "o2"), progress=False)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match="no files match"):
        tokenize_corpus([str(tmp_path / "emptydir")], str(tmp_path / "o3"), progress=False)


def test_existing_output_is_never_damaged(make_jsonl, tmp_path):
    path, _ = make_jsonl(n=10)
    prefix = str(tmp_path / "ds")
    tokenize_corpus([str(path)], prefix, vocab_size=300, progress=False)
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx", ".tokenizer.json", ".meta.json")}
    with pytest.raises(CorpusError, match="output exists"):
        tokenize_corpus([str(path)], prefix, vocab_size=300, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(open(path, "rb").read() + b'{"text": "\xfe"}\n')
    with pytest.raises(CorpusError, match="invalid UTF-8"):
        tokenize_corpus([str(bad)], prefix, vocab_size=300, overwrite=True, progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(CorpusError, match="no documents"):
        tokenize_corpus([str(empty)], prefix, tokenizer=prefix + ".tokenizer.json", overwrite=True, progress=False)
    after = {ext: open(prefix + ext, "rb").read() for ext in before}
    assert after == before
    assert sorted(os.listdir(tmp_path)) == sorted(["bad.jsonl", "corpus.jsonl", "empty.jsonl"] +
                                                  [f"ds{ext}" for ext in before])


def test_max_bytes_caps_whole_documents(make_jsonl, tmp_path):
    path, texts = make_jsonl(n=30)
    s = tokenize_corpus([str(path)], str(tmp_path / "cap"), vocab_size=300, max_bytes=500, progress=False)
    assert 1 <= s.stats.documents < 30 and s.stats.bytes >= 500


def test_cli(make_jsonl, tmp_path, capsys):
    path, texts = make_jsonl(n=8)
    prefix = str(tmp_path / "cli")
    assert main(["-i", str(path), "-o", prefix, "--vocab-size", "300", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "8 documents" in out[0]
    assert main(["-i", str(path), "-o", prefix, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenize_corpus: error: output exists")


def test_cli_help_runs_as_module():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "data_prep.tokenize_corpus", "--help"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0 and "--output-prefix" in r.stdout and "--on-invalid-utf8" in r.stdout


def test_gzip_jsonl_and_large_vocab_uses_int32(tmp_path, rng, random_text):
    import gzip

    from tokenizers import Tokenizer, models, pre_tokenizers

    texts = [random_text(rng, rng.randint(3, 20)) for _ in range(12)]
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    # a word-level tokenizer whose ids go beyond uint16 (like the full K3 vocabulary)
    vocab = {"<|endoftext|>": 0, "[UNK]": 70_000}
    for t in texts:
        for w in t.split():
            vocab.setdefault(w, 100_000 + len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_path = tmp_path / "big.json"
    tk.save(str(tok_path))
    prefix = str(tmp_path / "big")
    s = tokenize_corpus([str(path)], prefix, tokenizer=str(tok_path), progress=False)
    assert s.stats.documents == len(texts) and s.vocab_size > 100_000
    ds, seqs = _read(prefix)
    assert ds.index.dtype == np.int32
    assert [q[:-1].tolist() for q in seqs] == [[vocab[w] for w in t.split()] for t in texts]
