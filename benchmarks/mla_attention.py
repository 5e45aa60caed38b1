"""MLA's attention core over packed documents, each way of ``k3train.model.document_attention``: SDPA with
the dense mask, FlexAttention with the document block mask, flash attention's variable-length kernels,
and causal SDPA on one document per row as the reference point.

    python benchmarks/mla_attention.py [--batch 2] [--seq 4096] [--heads 8] [--mean-doc 1024] [--json out.json]
    python benchmarks/mla_attention.py --batch 8 --max-logit-tiles 128x128x4x3 128x128x8x3 256x64x8x2

bench-1B's MLA shapes by default (q/k 192 = nope 128 + extra 64, v 128, 8 heads, 2×4096 tokens), bf16.
Layouts: "one per row" (causal) and "packed" (document lengths drawn from an exponential distribution
of mean ``--mean-doc`` tokens, seed 0, cut at the row end). Each row: forward and forward+backward
(median of ``triton.testing.do_bench``, ms), the FLOPs of the (query, key) pairs the mask allows
(2·(Dqk + Dv) per pair forward, 2.5× that forward+backward) as TFLOP/s, and the time to build the
block mask (once per micro-batch, shared by the MLA layers). Before timing, every way's output must
match SDPA's with the dense mask within bf16 noise (2e-2 relative). Then QK-clip's per-head maximum
logit over the same pairs (``kernels.max_logit``, which every MLA layer computes each training step
under the Muon recipe): the Triton kernel against the torch reference (fp32 einsums of query blocks),
which must agree within 1e-4 first; ``--max-logit-tiles`` times the kernel at each (BM × BN × warps ×
stages) tile too (default: its GPU tile alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.model import document_attention  # noqa: E402
from k3train.model.document_attention import allowed, attend, document_block_mask  # noqa: E402
from k3train.model.documents import Documents  # noqa: E402
from kernels.max_logit import max_logit  # noqa: E402
from kernels.max_logit import triton_max_logit  # noqa: E402
from op_timing import median_ms  # noqa: E402
from packed_documents import packed_position_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--qk-dim", type=int, default=192)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--mean-doc", type=float, default=1024)
    ap.add_argument("--max-logit-tiles", nargs="*", default=["x".join(map(str, triton_max_logit.GPU_TILES))],
                    help="the max-logit kernel's tiles to time, BMxBNxWARPSxSTAGES each")
    ap.add_argument("--json", default="mla_attention.json")
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.max_logit_tiles]
    B, H, T, Dqk, Dv = args.batch, args.heads, args.seq, args.qk_dim, args.v_dim
    dev, bf16, scale = "cuda", torch.bfloat16, args.qk_dim ** -0.5
    g = torch.Generator(device=dev).manual_seed(1)
    # [B, T, H, D] tensors seen as [B, H, T, D], as MLA makes them
    q, k = (torch.randn(B, T, H, Dqk, device=dev, dtype=bf16, generator=g).transpose(1, 2).requires_grad_()
            for _ in range(2))
    v = torch.randn(B, T, H, Dv, device=dev, dtype=bf16, generator=g).transpose(1, 2).requires_grad_()
    do = torch.randn(B, H, T, Dv, device=dev, dtype=bf16, generator=g)

    rows, max_logit_rows = [], []
    default_way = document_attention.DOCUMENT_ATTENTION
    for layout in ("one per row", "packed"):
        pos = torch.arange(T).expand(B, T) if layout == "one per row" else packed_position_ids(B, T, args.mean_doc)
        docs = Documents.from_position_ids(pos.to(dev))
        mask = allowed(docs.doc_ids, docs.doc_ids, torch.arange(T, device=dev)).unsqueeze(1)
        pairs = int(mask.sum()) * H
        packed = dataclasses.replace(docs, one_per_row=False)  # the packed-row ways, also for one document a row
        ways = {"sdpa mask": ("sdpa", packed),
                "flex": ("flex", dataclasses.replace(packed, block_mask=document_block_mask(docs.doc_ids))),
                "flash": ("flash", packed)}
        if layout == "one per row":
            ways = {"sdpa causal": ("sdpa", docs), **ways}

        def call(way: str, how: Documents) -> torch.Tensor:
            document_attention.DOCUMENT_ATTENTION = way
            return attend(q, k, v, scale, how, lambda: mask)

        errors = {}
        with torch.no_grad():
            ref = call(*ways["sdpa mask"]).float()
            for name, how in ways.items():
                try:
                    errors[name] = float((call(*how).float() - ref).norm() / ref.norm())
                except Exception as err:  # noqa: BLE001 - a way this torch or GPU lacks: a row saying why
                    rows.append(dict(layout=layout, way=name, error=f"{type(err).__name__}: {str(err)[:300]}"))
        bad = {name: e for name, e in errors.items() if not e < 2e-2}
        assert not bad, f"ways that differ from SDPA with the dense mask ({layout}): {bad}"
        mask_ms = median_ms(lambda: document_block_mask(docs.doc_ids), dev, 25, 100)
        for name, how in ways.items():
            if name not in errors:
                continue
            fwd = median_ms(lambda: call(*how), dev, 25, 100)
            both = median_ms(lambda: torch.autograd.grad(call(*how), (q, k, v), do), dev, 25, 100)
            flops = 2 * (Dqk + Dv) * pairs
            rows.append(dict(layout=layout, way=name, documents=docs.cu_seqlens.numel() - 1, fwd_ms=fwd,
                             fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9, fwd_bwd_tflops=2.5 * flops / both / 1e9,
                             block_mask_ms=mask_ms if name == "flex" else None, rel_err_vs_sdpa_mask=errors[name]))
        q_pos = torch.arange(T, device=dev)
        per_backend = {b: max_logit(q, k, docs.doc_ids, docs.doc_ids, q_pos, scale, backend=b) for b in ("triton", "torch")}
        diff = float((per_backend["triton"] - per_backend["torch"]).abs().max() / per_backend["torch"].abs().max())
        assert diff < 1e-4, f"the max-logit kernel is {diff:.2g} from the reference ({layout})"
        ms = median_ms(lambda: max_logit(q, k, docs.doc_ids, docs.doc_ids, q_pos, scale, backend="torch"), dev, 25, 100)
        max_logit_rows.append(dict(layout=layout, backend="torch", ms=ms, rel_diff=0.0))
        for tile in tiles:
            def kernel():
                return triton_max_logit.max_logit(q, k, docs.doc_ids, docs.doc_ids, q_pos, scale, tiles=tile)
            diff = float((kernel() - per_backend["torch"]).abs().max() / per_backend["torch"].abs().max())
            assert diff < 1e-4, f"the max-logit kernel at tile {tile} is {diff:.2g} from the reference ({layout})"
            max_logit_rows.append(dict(layout=layout, backend="triton", tile="x".join(map(str, tile)),
                                       ms=median_ms(kernel, dev, 25, 100), rel_diff=diff))
    document_attention.DOCUMENT_ATTENTION = default_way
    print(f"MLA attention on {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={B} H={H} T={T} "
          f"qk {Dqk} v {Dv}")
    print(f"{'layout':>12} {'way':>12} {'docs':>5} {'fwd ms':>8} {'f+b ms':>8} {'fwd TF/s':>9} {'f+b TF/s':>9} "
          f"{'mask ms':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:>12} {r['way']:>12}  n/a: {r['error']}")
            continue
        mask_col = f"{r['block_mask_ms']:8.3f}" if r["block_mask_ms"] is not None else f"{'':>8}"
        print(f"{r['layout']:>12} {r['way']:>12} {r['documents']:>5} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['fwd_tflops']:9.1f} {r['fwd_bwd_tflops']:9.1f} {mask_col}")
    print("QK-clip max logit (no gradient):")
    for r in max_logit_rows:
        print(f"{r['layout']:>12} {r['backend']:>12} {r.get('tile', ''):>12} {r['ms']:8.3f} ms")
    with open(args.json, "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=B, heads=H, seq=T, qk_dim=Dqk,
                       v_dim=Dv, mean_doc=args.mean_doc, rows=rows, max_logit=max_logit_rows), fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
