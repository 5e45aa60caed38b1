"""Two gloo ranks build the datasets (rank 0 first, then the others from its cache) and
read disjoint DP slices that together equal the single-process batches."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3train.config.schema import DataConfig


def _rank_main(rank, world, store, prefix, cache, tok_path, out_dir):
    torch.set_num_threads(1)
    # a file rendezvous, not a port picked beforehand (another test may bind it first: EADDRINUSE in CI)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from k3train.data import BatchIterator, build_datasets, load_tokenizer

        tok = load_tokenizer(tok_path)
        cfg = DataConfig(paths=[prefix], cache_dir=cache, split="90,10,0")
        train, valid = build_datasets(cfg, 32, 64, 8, tok)
        it = BatchIterator(train, 2, dp_rank=rank, dp_size=world)
        batches = [next(it)["tokens"] for _ in range(3)]
        torch.save({"tokens": batches, "consumed": it.consumed_samples, "valid0": valid[0]["tokens"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_build_and_split_batches(tmp_path, make_jsonl):
    from data_prep.tokenize_corpus import tokenize_corpus
    from k3train.data import BatchIterator, build_datasets, load_tokenizer

    path, _ = make_jsonl(n=80)
    prefix = str(tmp_path / "ds")
    tokenize_corpus([str(path)], prefix, vocab_size=300, progress=False)
    tok_path = prefix + ".tokenizer.json"
    cache = str(tmp_path / "cache")
    import megatron.core.datasets.gpt_dataset  # noqa: F401  (imported once here; forked ranks share it)

    # fork, not spawn: a spawned rank would spend ~10 s importing torch and megatron again
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "store"), prefix, cache, tok_path, str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["consumed"] == r1["consumed"] == 12
    # the same data, single process, from the cache the ranks wrote
    cfg = DataConfig(paths=[prefix], cache_dir=cache, split="90,10,0")
    train, valid = build_datasets(cfg, 32, 64, 8, load_tokenizer(tok_path))
    whole = BatchIterator(train, 4, 0, 1)
    for a, b in zip(r0["tokens"], r1["tokens"]):
        assert torch.equal(torch.cat([a, b]), next(whole)["tokens"])
    assert torch.equal(r0["valid0"], valid[0]["tokens"]) and torch.equal(r1["valid0"], valid[0]["tokens"])
