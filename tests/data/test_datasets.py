import json

import numpy as np
import pytest
import torch

from data_prep.tokenize_corpus import tokenize_corpus
from k3train.config.schema import DataConfig
from k3train.data import BatchIterator, build_datasets, load_tokenizer, resolve_data


def _cfg(tmp_path, paths, **kw):
    return DataConfig(paths=[str(p) for p in paths], cache_dir=str(tmp_path / "cache"), **kw)


def _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=200, name="syn", first_value=1):
    lengths = [rng.randint(1, 60) for _ in range(n_docs)]
    values = [first_value + i for i in range(n_docs)]
    prefix = str(tmp_path / name)
    write_synthetic_dataset(prefix, lengths, values)
    return prefix, lengths, values


def test_batches_keep_document_boundaries(make_jsonl, tmp_path, rng):
    path, texts = make_jsonl(n=60, words=(1, 40))
    prefix = str(tmp_path / "ds")
    tokenize_corpus([str(path)], prefix, vocab_size=300, progress=False)
    tok = load_tokenizer(prefix + ".tokenizer.json")
    seq = rng.choice([16, 32, 64])
    train, valid = build_datasets(_cfg(tmp_path, [prefix], split="90,10,0"), seq, 40, 8, tok)
    it = BatchIterator(train, micro_batch_size=4, dp_rank=0, dp_size=1)
    n_eod = 0
    for b in it:
        assert set(b) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert b["tokens"].shape == (4, seq) and b["tokens"].dtype == torch.int64
        assert b["labels"].dtype == torch.int64 and b["position_ids"].dtype == torch.int64
        assert b["loss_mask"].dtype == torch.float32
        tokens, pos = b["tokens"], b["position_ids"]
        # labels are the next tokens
        assert torch.equal(b["labels"][:, :-1], tokens[:, 1:])
        # position 0 at the row start and exactly after each EOD; +1 elsewhere
        after_eod = torch.zeros_like(tokens, dtype=torch.bool)
        after_eod[:, 1:] = tokens[:, :-1] == tok.eod
        after_eod[:, 0] = True
        assert torch.equal(pos == 0, after_eod)
        assert torch.equal(pos[:, 1:][~after_eod[:, 1:]], pos[:, :-1][~after_eod[:, 1:]] + 1)
        # the EOD input position (label = next document's first token) is not trained
        assert torch.equal(b["loss_mask"] == 0, tokens == tok.eod)
        n_eod += int((tokens == tok.eod).sum())
    assert it.consumed_samples == len(train) - len(train) % 4 >= 40
    assert n_eod > 0  # rows really are packed with several documents
    # the text between two EODs of a row decodes to a whole original document
    row = next(iter(BatchIterator(train, 1, 0, 1)))["tokens"][0].tolist()
    eods = [i for i, t in enumerate(row) if t == tok.eod]
    for a, b in zip(eods, eods[1:]):
        assert tok.decode(row[a + 1:b]) in texts


def test_train_valid_disjoint(tmp_path, rng, tiny_tokenizer, write_synthetic_dataset):
    prefix, lengths, values = _synthetic(tmp_path, write_synthetic_dataset, rng)
    cfg = _cfg(tmp_path, [prefix], split="90,10,0")
    train, valid = build_datasets(cfg, 32, 300, 20, tiny_tokenizer)
    seen = {}
    for name, ds in (("train", train), ("valid", valid)):
        vals = set()
        for i in range(len(ds)):
            vals |= set(ds[i]["tokens"].tolist()) | set(ds[i]["labels"].tolist())
        seen[name] = vals - {tiny_tokenizer.eod}
    assert seen["train"] and seen["valid"]
    assert not seen["train"] & seen["valid"]
    # the split is by document order: validation holds the last 10% of the documents
    assert min(seen["valid"]) > max(seen["train"])
    assert len(train) >= 300 and len(valid) >= 20


def test_blend_with_weights(tmp_path, rng, tiny_tokenizer, write_synthetic_dataset):
    a, _, _ = _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=100, name="a", first_value=1)
    b, _, _ = _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=100, name="b", first_value=150)
    cfg = _cfg(tmp_path, [a, b], weights=[0.75, 0.25], split="95,5,0")
    train, valid = build_datasets(cfg, 16, 400, 8, tiny_tokenizer)
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert len(train) == 400 and abs((ids == 0).mean() - 0.75) < 0.02
    for i in range(0, len(train), 7):
        toks = set(train[i]["tokens"].tolist()) - {0}
        assert all(t < 150 for t in toks) if ids[i] == 0 else all(t >= 150 for t in toks)
    batch = next(BatchIterator(train, 4, 0, 1))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_resume_is_exact_and_dp_slices(tmp_path, rng, tiny_tokenizer, write_synthetic_dataset):
    prefix, _, _ = _synthetic(tmp_path, write_synthetic_dataset, rng)
    cfg = _cfg(tmp_path, [prefix], seed=rng.randrange(1000))
    train, _ = build_datasets(cfg, 24, 200, 0, tiny_tokenizer)
    straight = [b["tokens"] for _, b in zip(range(10), BatchIterator(train, 3, 0, 1))]
    it = BatchIterator(train, 3, 0, 1)
    first = [next(it)["tokens"] for _ in range(4)]
    state = json.loads(json.dumps(it.state_dict()))  # checkpoints store plain data
    assert state["consumed_samples"] == 12
    # a fresh process: rebuild the dataset (from its index cache) and resume
    train2, _ = build_datasets(cfg, 24, 200, 0, tiny_tokenizer)
    it2 = BatchIterator(train2, 3, 0, 1)
    it2.load_state_dict(state)
    rest = [next(it2)["tokens"] for _ in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(straight, first + rest))
    # consumed_samples given to the constructor does the same
    it3 = BatchIterator(train2, 3, 0, 1, consumed_samples=12)
    assert torch.equal(next(it3)["tokens"], straight[4])
    # DP: rank r takes the r-th micro-batch slice of each global micro-batch
    ranks = [BatchIterator(train, 3, r, 2) for r in range(2)]
    whole = BatchIterator(train, 6, 0, 1)
    for _ in range(3):
        parts = [next(r)["tokens"] for r in ranks]
        assert torch.equal(torch.cat(parts), next(whole)["tokens"])
    assert ranks[0].consumed_samples == ranks[1].consumed_samples == whole.consumed_samples == 18
    # a different seed gives a different order
    cfg2 = _cfg(tmp_path, [prefix], seed=cfg.seed + 1)
    other, _ = build_datasets(cfg2, 24, 200, 0, tiny_tokenizer)
    assert not torch.equal(next(BatchIterator(other, 3, 0, 1))["tokens"], straight[0])


def test_iterator_stops_on_all_ranks_together(tmp_path, rng, tiny_tokenizer, write_synthetic_dataset):
    prefix, _, _ = _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=50)
    train, _ = build_datasets(_cfg(tmp_path, [prefix]), 16, 10, 0, tiny_tokenizer)
    counts = [len(list(BatchIterator(train, 2, r, 3))) for r in range(3)]
    assert counts[0] == counts[1] == counts[2] == len(train) // 6
    with pytest.raises(ValueError, match="dp_rank"):
        BatchIterator(train, 2, 3, 3)


def test_missing_files_and_bad_config(tmp_path, rng, tiny_tokenizer, write_synthetic_dataset):
    missing = str(tmp_path / "nowhere" / "corpus")
    with pytest.raises(FileNotFoundError) as e:
        build_datasets(_cfg(tmp_path, [missing]), 16, 10, 2, tiny_tokenizer)
    msg = str(e.value)
    assert f"{missing}.bin" in msg and "data_prep.tokenize_corpus" in msg and "\n" not in msg
    with pytest.raises(FileNotFoundError, match="corpus.bin"):
        resolve_data(_cfg(tmp_path, [missing]), 512)
    prefix, _, _ = _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=20)
    (tmp_path / "syn.idx").rename(tmp_path / "moved.idx")
    with pytest.raises(FileNotFoundError, match=r"syn\.idx"):
        build_datasets(_cfg(tmp_path, [prefix]), 16, 10, 2, tiny_tokenizer)
    (tmp_path / "moved.idx").rename(tmp_path / "syn.idx")
    with pytest.raises(ValueError, match="data.weights has 1 entries but data.paths has 2"):
        build_datasets(_cfg(tmp_path, [prefix, prefix], weights=[1.0]), 16, 10, 2, tiny_tokenizer)
    with pytest.raises(ValueError, match="valid split .* is empty"):
        build_datasets(_cfg(tmp_path, [prefix], split="99,1,0"), 16, 10, 2, tiny_tokenizer)
    for bad in ("abc", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="data.split="):
            build_datasets(_cfg(tmp_path, [prefix], split=bad), 16, 10, 2, tiny_tokenizer)
    with pytest.raises(ValueError, match="gives training no share"):
        build_datasets(_cfg(tmp_path, [prefix], split="0,1,0"), 16, 10, 2, tiny_tokenizer)
    # a tokenizer without data paths would not match the default corpus
    with pytest.raises(ValueError, match="data.tokenizer is set but data.paths is empty"):
        resolve_data(DataConfig(tokenizer=tiny_tokenizer.path, cache_dir=str(tmp_path)), 512)
    # no tokenizer next to a dataset made elsewhere
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        resolve_data(_cfg(tmp_path, [prefix]), 512)


def test_tokenizer_must_match_the_data(make_jsonl, tmp_path, tiny_tokenizer):
    path, _ = make_jsonl(n=30)
    prefix = str(tmp_path / "ds")
    tokenize_corpus([str(path)], prefix, vocab_size=512, progress=False)
    tok = load_tokenizer(prefix + ".tokenizer.json")
    meta = json.load(open(prefix + ".meta.json"))
    if meta["max_token_id"] >= tiny_tokenizer.vocab_size:
        with pytest.raises(ValueError, match="beyond the tokenizer"):
            build_datasets(_cfg(tmp_path, [prefix]), 16, 10, 2, tiny_tokenizer)
    resolved = resolve_data(_cfg(tmp_path, [prefix]), 512)
    assert resolved.tokenizer_path == prefix + ".tokenizer.json" and resolved.paths == [prefix]
    train, valid = build_datasets(_cfg(tmp_path, [prefix], split="80,20,0"), 16, 10, 2, tok)
    assert len(train) >= 10 and len(valid) >= 2


def test_passes_over_data_counts_megatrons_train_split(tmp_path, rng, tiny_tokenizer, write_synthetic_dataset):
    from k3train.data.datasets import MEMORISE_PASSES, passes_over_data, train_split_tokens

    prefix, lengths, values = _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=120)
    cfg = _cfg(tmp_path, [prefix], split="80,20,0")
    train, _ = build_datasets(cfg, 16, 400, 8, tiny_tokenizer)
    # the documents Megatron-Core put in the train split, told apart by their token values
    seen = set()
    for i in range(len(train)):
        seen |= set(train[i]["tokens"].tolist())
    in_train = [n + 1 for n, v in zip(lengths, values) if v in seen]
    assert len(in_train) == 96
    assert train_split_tokens([prefix], cfg.split) == [sum(in_train)]

    passes, line = passes_over_data(cfg, [prefix], None, 16, 400)
    assert passes == pytest.approx(400 * 16 / sum(in_train))
    assert f"{passes:.2f} passes" in line
    assert ("memorises" in line) == (passes > MEMORISE_PASSES)
    # a blend: each dataset reads its weight's share; the line reports the most-read one
    b, lengths_b, _ = _synthetic(tmp_path, write_synthetic_dataset, rng, n_docs=120, name="b", first_value=300)
    tokens_b = train_split_tokens([b], cfg.split)[0]
    passes, _ = passes_over_data(cfg, [prefix, b], [0.9, 0.1], 16, 400)
    assert passes == pytest.approx(max(0.9 * 6400 / sum(in_train), 0.1 * 6400 / tokens_b))
    few, line = passes_over_data(cfg, [prefix], None, 16, 1)
    assert few < 1 and "memorises" not in line
