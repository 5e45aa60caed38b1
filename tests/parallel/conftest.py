"""The one-rank reference runs the multi-rank training tests compare against (k3_tiny, 6 steps,
checkpoints at 3 and 6), each trained once per test process."""

from __future__ import annotations

import pytest

from parallel_runs import MUON, STEPS
from test_training_helpers import train


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train(out, *STEPS)
    return out


@pytest.fixture(scope="session")
def single_muon(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_muon")
    train(out, *STEPS, *MUON)
    return out


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory) -> list[str]:
    """Overrides for a dataset of short documents (2–12 words, ~23 tokens) in the default corpus's
    tokenizer, so that every 64-token row packs several documents and some cross the chunk edges of
    context parallelism (the default corpus's documents are longer than a test row)."""
    import json
    import random

    from data_prep.tokenize_corpus import tokenize_corpus
    from k3train.config.schema import DataConfig
    from k3train.data.datasets import resolve_data

    out = tmp_path_factory.mktemp("packed_data")
    rng = random.Random(0)
    words = ["the", "model", "attention", "state", "chunk", "rank", "delta", "expert", "token", "router",
             "residual", "block", "gate", "sequence", "layer"]
    with open(out / "docs.jsonl", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))}) + "\n")
    tokenizer = resolve_data(DataConfig(), 512).tokenizer_path
    tokenize_corpus([str(out / "docs.jsonl")], str(out / "ds"), tokenizer=tokenizer, progress=False)
    return [f"data.paths=[{out / 'ds'}]", f"data.tokenizer={tokenizer}"]


@pytest.fixture(scope="session")
def single_packed(tmp_path_factory, packed_data):
    out = tmp_path_factory.mktemp("single_packed")
    train(out, *STEPS, *packed_data)
    return out
