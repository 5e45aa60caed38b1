"""``batch_to_device`` and ``Documents.to`` on CUDA (run with ``pytest -m gpu``): the micro-batch and its
documents arrive intact, and the calls do not wait for the kernels already queued (a copy from pageable
host memory would, and so would counting the documents on the device)."""

from __future__ import annotations

import pytest
import torch

from k3train.data.batches import batch_to_device
from k3train.model.documents import Documents

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copy_is_exact_and_does_not_wait_for_queued_kernels():
    dev = torch.device("cuda")
    batch = {"tokens": torch.randint(0, 163840, (4, 4096)), "position_ids": torch.arange(4096).repeat(4, 1),
             "loss_mask": torch.rand(4, 4096)}
    a = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize()
    for _ in range(20):  # ~tens of ms of queued work
        a = a @ a / 8192**0.5
    queued = torch.cuda.Event()
    queued.record()
    out = batch_to_device(batch, dev)
    assert not queued.query(), "batch_to_device waited for the kernels queued before it"
    torch.cuda.synchronize()
    for k, v in batch.items():
        assert out[k].device.type == "cuda" and out[k].dtype == v.dtype and torch.equal(out[k].cpu(), v), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_documents_from_the_host_batch_do_not_wait_for_queued_kernels():
    dev = torch.device("cuda")
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([1000, 3000, 96], [4096])])
    a = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a / 8192**0.5
    queued = torch.cuda.Event()
    queued.record()
    docs = Documents.from_position_ids(pos, bucket=True).to(dev)
    assert not queued.query(), "building the documents waited for the kernels queued before them"
    want = Documents.from_position_ids(pos.to(dev), bucket=True)
    for name in ("position_ids", "doc_ids", "cu_seqlens"):
        got = getattr(docs, name)
        assert got.device.type == "cuda" and torch.equal(got, getattr(want, name)), name
    assert docs.one_per_row == want.one_per_row


def test_cpu_batches_stay_as_they_are():
    batch = {"tokens": torch.arange(6).view(2, 3)}
    out = batch_to_device(batch, torch.device("cpu"))
    assert torch.equal(out["tokens"], batch["tokens"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_forward_backward_reads_nothing_back():
    """k3_tiny_kernel (K3 head dims, every Triton kernel) on packed rows, given the documents counted on the
    host as the trainer gives them: forward and backward under ``set_sync_debug_mode("error")``, so any
    read-back (a document count, KDA's offset check, a routing count) raises."""
    from pathlib import Path

    import yaml

    from k3train.config.schema import ModelConfig
    from k3train.model.k3 import K3Model

    cfg = ModelConfig(**yaml.safe_load((Path(__file__).parents[2] / "conf/model/k3_tiny_kernel.yaml").read_text()))
    model = K3Model(cfg).cuda()
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([100, 300, 112], [512])])
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, 512), device="cuda") for _ in range(2))
    for watched in (False, True):  # the first call warms up (Triton compiles and tunes, lazy inits)
        docs = Documents.from_position_ids(pos).to(torch.device("cuda"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if watched else "default")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens, labels=labels, documents=docs)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
