"""data_prep at scale: huge documents encoded in pieces (same ids, bounded memory) and
``--workers N`` (output byte-identical to one process)."""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from data_prep.tokenize_corpus import (
    CorpusError,
    can_split_documents,
    main,
    split_document,
    tokenize_corpus,
    write_tokens,
)
from k3train.data import K3Tokenizer, load_tokenizer, train_byte_level_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Characters the tokenizer's regex engine and Python may class differently, or that are
# whitespace only to one of them: a cut must never rely on them.
ODD_SPACE = ["\x1c", "\x1f", "\x85", "\xa0", "\u2028", "\u3000", "\u200b", "\ufeff", "\x0b", "\x0c"]
WORDS = ["def", "return", "self", "x", "_private", "café", "ß", "中文", "🙂", "it's", "we'll", "42",
         "3.14", "(", ")", "):", "==", "#", '"""', "'", "<|endoftext|>"]


def random_document(rng, n_lines: int) -> str:
    """Code-like text: indentation, blank and whitespace-only lines, trailing spaces, CRLF,
    tabs, unicode, odd whitespace, and now and then a very long line with no newline."""
    lines = []
    for _ in range(n_lines):
        r = rng.random()
        if r < 0.08:
            lines.append(rng.choice(["", " ", "    ", "\t", "  \t "]))
            continue
        if r < 0.12:  # a long line: few or no places to cut
            unit = rng.choice(["abcdefgh", "0123", "=+-*", "中文字", "ab cd ", "x\u3000y"])
            lines.append(unit * rng.randint(50, 400))
            continue
        words = []
        for _ in range(rng.randint(1, 12)):
            w = rng.choice(WORDS) if rng.random() < 0.5 else "".join(
                rng.choice("abcxyz_09") for _ in range(rng.randint(1, 9)))
            words.append(w)
        seps = [rng.choice([" ", " ", " ", "  ", "\t", "", rng.choice(ODD_SPACE)]) for _ in words]
        line = "".join(s + w for s, w in zip(seps, words))
        lines.append(" " * rng.choice([0, 0, 2, 4, 8]) + line + rng.choice(["", "", " ", "  ", "\r"]))
    return "\n".join(lines) + rng.choice(["", "\n", "\n\n", "  "])


def _pretokens(tok: K3Tokenizer, text: str):
    return [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.fixture
def code_tokenizer(rng):
    docs = [random_document(rng, 80) for _ in range(30)]
    return K3Tokenizer(train_byte_level_bpe(docs, 600))


def test_pieces_encode_exactly_like_the_whole_document(rng, code_tokenizer, tmp_path):
    tok = code_tokenizer
    assert can_split_documents(tok.backend.to_str(), tok.backend.encode_special_tokens)
    cut_somewhere = 0
    for _ in range(25):
        doc = random_document(rng, rng.randint(20, 200))
        piece_chars = rng.choice([1, 8, 50, 200, 1000])
        pieces = split_document(doc, piece_chars)
        assert "".join(pieces) == doc and all(pieces)
        cut_somewhere += len(pieces) > 1
        at = 0
        for p in pieces[:-1]:  # each cut: before a space/newline that follows a non-space
            at += len(p)
            assert doc[at] in " \n" and not doc[at - 1].isspace() and doc[at - 1] not in ODD_SPACE
        for p in pieces[:-1]:
            assert len(p) >= piece_chars
        whole = tok.encode(doc)
        assert sum((tok.encode(p) for p in pieces), []) == whole
        assert sum((_pretokens(tok, p) for p in pieces), []) == _pretokens(tok, doc)
        # the writer: ids of the narrow dtype, EOD last, one length per document
        with open(tmp_path / "doc.bin", "wb") as f:
            lengths = write_tokens([doc], f, tok, np.uint16, piece_chars=piece_chars)
        assert np.fromfile(tmp_path / "doc.bin", dtype=np.uint16).tolist() == whole + [tok.eod]
        assert lengths == [len(whole) + 1]
    assert cut_somewhere >= 20


def test_where_a_document_cannot_be_cut(code_tokenizer):
    # Cutting right after a newline is unsafe when whitespace comes before it: alone,
    # "a  \n" ends in one whitespace pre-token; followed by "b", it is "  " and "\n".
    tok = code_tokenizer
    assert _pretokens(tok, "a  \n") + _pretokens(tok, "b") != _pretokens(tok, "a  \nb")
    # so the cuts come before the spaces that follow "a", never after the newline
    assert split_document("a  \nb" * 50, 3) == ["a  \nba", *(["  \nba"] * 48), "  \nb"]
    # no space or newline after a non-space: the stretch stays whole
    assert split_document("x" * 1000, 10) == ["x" * 1000]
    assert split_document("   \n   " * 100, 10) == ["   \n   " * 100]
    assert split_document("y\u3000" * 500, 10) == ["y\u3000" * 500]
    assert split_document("a" * 500 + "\n" + "b" * 500, 10) == ["a" * 500, "\n" + "b" * 500]
    assert split_document("short doc", 100) == ["short doc"]


def test_only_byte_level_regex_tokenizers_are_split(code_tokenizer):
    from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

    def cfg(**change):
        c = json.loads(code_tokenizer.backend.to_str())
        c.update(change)
        return json.dumps(c)

    ours = code_tokenizer.backend.to_str()
    assert can_split_documents(ours)
    assert not can_split_documents(cfg(normalizer=json.loads(normalizers.NFKC().__getstate__())))
    for pre in (pre_tokenizers.ByteLevel(add_prefix_space=True), pre_tokenizers.ByteLevel(use_regex=False),
                pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False)]),
                pre_tokenizers.WhitespaceSplit()):
        assert not can_split_documents(cfg(pre_tokenizer=json.loads(pre.__getstate__()))), pre
    # special tokens are plain text to K3Tokenizer; matched, ours still could not span a cut
    assert can_split_documents(ours, encode_special_tokens=False)
    for token in (AddedToken("\n\n", special=False), AddedToken("foo", rstrip=True, special=False)):
        t = Tokenizer.from_str(ours)
        t.add_tokens([token])
        assert not can_split_documents(t.to_str()), token
    t = Tokenizer.from_str(ours)
    t.add_tokens([AddedToken("foo", special=False)])
    assert can_split_documents(t.to_str())


def _corpus(tmp_path, rng, n=300):
    texts = [random_document(rng, rng.randint(1, 12)) for _ in range(n)]
    for i in rng.sample(range(n), 5):  # a few long documents, cut into pieces below
        texts[i] = random_document(rng, 400)
    texts = [t for t in texts if t.strip()]
    path = tmp_path / "c.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path, texts


def test_workers_write_byte_identical_output(tmp_path, rng, code_tokenizer, capsys):
    path, texts = _corpus(tmp_path, rng)
    tok_path = str(tmp_path / "tok.json")
    code_tokenizer.save(tok_path)
    tok = load_tokenizer(tok_path)
    out = {}
    for name, kw in [("w1", dict(workers=1)), ("w2", dict(workers=2)), ("w3", dict(workers=3))]:
        s = tokenize_corpus([str(path)], str(tmp_path / name), tokenizer=tok_path, progress=False,
                            piece_chars=2000, **kw)
        assert s.stats.documents == len(texts)
        out[name] = {ext: open(tmp_path / f"{name}{ext}", "rb").read() for ext in (".bin", ".idx")}
    assert out["w2"] == out["w1"] and out["w3"] == out["w1"]
    # ... and that output is the whole documents' ids, in input order
    ids = np.frombuffer(out["w1"][".bin"], dtype=np.uint16).tolist()
    assert ids == sum((tok.encode(t) + [tok.eod] for t in texts), [])
    assert max(len(t) for t in texts) > 2000 * 3  # some documents really went in pieces
    # the CLI (spawn), then write_tokens with fork
    assert main(["-i", str(path), "-o", str(tmp_path / "cli"), "--tokenizer", tok_path, "--workers", "2",
                 "--no-progress"]) == 0
    assert open(tmp_path / "cli.bin", "rb").read() == out["w1"][".bin"]
    with open(tmp_path / "fork.bin", "wb") as f:
        lengths = write_tokens(texts, f, tok, np.uint16, workers=2, piece_chars=500, start_method="fork")
    assert open(tmp_path / "fork.bin", "rb").read() == out["w1"][".bin"]
    assert lengths == [len(tok.encode(t)) + 1 for t in texts]
    capsys.readouterr()
    assert main(["-i", str(path), "-o", str(tmp_path / "bad"), "--tokenizer", tok_path, "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    with pytest.raises(CorpusError, match="--workers"):
        write_tokens(texts, open(os.devnull, "wb"), tok, np.uint16, workers=0)


# Measured on an 18 MiB document (2-core CI machine): 0.3–0.7 GB peak RSS in pieces, depending on
# the document and the tokenizers build (interpreter, tokenizer and the text included), where
# encoding it whole peaked at 3.4 GB. The bound leaves room for the former and catches the latter.
RSS_BOUND_MB = 1200

_RSS_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from data_prep.tokenize_corpus import Stats, write_tokens
    from k3train.data import load_tokenizer

    tok = load_tokenizer(sys.argv[1])
    text = open(sys.argv[2], encoding="utf-8", newline="").read()
    stats = Stats()
    with open(sys.argv[3], "wb") as f:
        lengths = write_tokens([text], f, tok, np.uint16, stats=stats)
    print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "chars": len(text), "lengths": lengths, "tokens": stats.tokens}))
""")


def test_huge_document_peak_memory_is_bounded(tmp_path, code_tokenizer):
    tok_path = str(tmp_path / "tok.json")
    code_tokenizer.save(tok_path)
    block = random_document(random.Random(0), 3000)  # one fixed document: the bound is a measurement
    doc = (block * (18 * 2**20 // len(block) + 1))[: 18 * 2**20]
    (tmp_path / "big.py").write_text(doc, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, tok_path, str(tmp_path / "big.py"),
                        str(tmp_path / "big.bin")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(res)
    assert res["chars"] == len(doc) and res["lengths"] == [res["tokens"]]
    assert os.path.getsize(tmp_path / "big.bin") == 2 * res["tokens"]
    assert res["tokens"] > len(doc) // 8
    assert res["peak_mb"] < RSS_BOUND_MB, res
