import pytest

from k3train.data import EOD_TOKEN, K3Tokenizer, check_vocab, load_tokenizer, train_byte_level_bpe


def test_round_trip_and_vocab(rng, tmp_path, random_text):
    texts = [random_text(rng, rng.randint(1, 80)) for _ in range(60)]
    vocab = rng.choice([300, 400, 512])
    tok = K3Tokenizer(train_byte_level_bpe(texts, vocab))
    assert 257 <= tok.vocab_size <= vocab
    assert tok.eod == 0 and tok.eod_token == EOD_TOKEN
    # Any string round-trips, also unseen bytes, control characters and odd unicode.
    probes = texts[:10] + [random_text(rng, 30) + "\x00\x07 \u2028 \U0001F600 ﻿", "  leading", ""]
    for t in probes:
        ids = tok.encode(t)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == t
    # Merges were learned: text compresses below one token per byte.
    s = " ".join(texts)
    assert len(tok.encode(s)) < len(s.encode("utf-8"))
    # Saved and reloaded tokenizers agree.
    path = tmp_path / "tok.json"
    tok.save(str(path))
    tok2 = load_tokenizer(str(path))
    assert tok2.vocab_size == tok.vocab_size and tok2.eod == tok.eod
    assert tok2.encode(texts[0]) == tok.encode(texts[0])
    assert tok2.fingerprint == tok.fingerprint


def test_literal_eod_text_is_not_a_boundary(rng, random_text):
    tok = K3Tokenizer(train_byte_level_bpe([random_text(rng, 40) for _ in range(20)], 300))
    text = f"a{EOD_TOKEN}b"
    ids = tok.encode(text)
    assert tok.eod not in ids
    assert tok.decode(ids) == text


def test_training_is_deterministic(rng, random_text):
    texts = [random_text(rng, 40) for _ in range(40)]
    a = train_byte_level_bpe(texts, 400).to_str()
    b = train_byte_level_bpe(list(texts), 400).to_str()
    assert a == b


def test_vocab_too_small_for_bytes():
    with pytest.raises(ValueError, match="at least 257"):
        train_byte_level_bpe(["abc"], 200)


def test_check_vocab(tiny_tokenizer):
    check_vocab(tiny_tokenizer.vocab_size, tiny_tokenizer)
    check_vocab(10**6, tiny_tokenizer)
    with pytest.raises(ValueError) as e:
        check_vocab(tiny_tokenizer.vocab_size - 1, tiny_tokenizer)
    msg = str(e.value)
    assert "model.vocab_size" in msg and str(tiny_tokenizer.vocab_size) in msg and "\n" not in msg


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        load_tokenizer(str(bad))


def test_user_tokenizer_without_eod(rng, tmp_path, random_text):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator([random_text(rng, 20)], trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                                      show_progress=False))
    path = tmp_path / "user.json"
    t.save(str(path))
    assert load_tokenizer(str(path)).eod == t.token_to_id("</s>")
    with pytest.raises(ValueError, match="no token"):
        load_tokenizer(str(path), eod_token="<eod>")
