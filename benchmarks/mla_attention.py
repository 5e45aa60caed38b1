"""MLA's attention core over packed documents: SDPA with a dense mask against FlexAttention with the
document block mask, and causal SDPA on one document per row as the reference point.

    python benchmarks/mla_attention.py [--batch 2] [--seq 4096] [--heads 8] [--mean-doc 1024] [--json out.json]

bench-1B's MLA shapes by default (q/k 192 = nope 128 + extra 64, v 128, 8 heads, 2×4096 tokens), bf16.
Layouts: "one per row" (causal) and "packed" (document lengths drawn from an exponential distribution
of mean ``--mean-doc`` tokens, seed 0, cut at the row end). Each row: forward and forward+backward
(median of ``triton.testing.do_bench``, ms), the FLOPs of the (query, key) pairs the mask allows
(2·(Dqk + Dv) per pair forward, 2.5× that forward+backward) as TFLOP/s, and the time to build the
block mask (once per micro-batch, shared by the MLA layers). Before timing, FlexAttention's
output must match SDPA's within bf16 noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from k3train.model.document_attention import allowed, attend, document_block_mask  # noqa: E402
from k3train.model.documents import Documents  # noqa: E402
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
    ap.add_argument("--json", default="mla_attention.json")
    args = ap.parse_args()
    B, H, T, Dqk, Dv = args.batch, args.heads, args.seq, args.qk_dim, args.v_dim
    dev, bf16, scale = "cuda", torch.bfloat16, args.qk_dim ** -0.5
    g = torch.Generator(device=dev).manual_seed(1)
    q, k = (torch.randn(B, H, T, Dqk, device=dev, dtype=bf16, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, T, Dv, device=dev, dtype=bf16, generator=g).requires_grad_()
    do = torch.randn(B, H, T, Dv, device=dev, dtype=bf16, generator=g)

    def timed(**how) -> tuple[float, float]:
        fwd = median_ms(lambda: attend(q, k, v, scale, **how), dev, 25, 100)
        both = median_ms(lambda: torch.autograd.grad(attend(q, k, v, scale, **how), (q, k, v), do), dev, 25, 100)
        return fwd, both

    rows = []
    for layout in ("one per row", "packed"):
        pos = torch.arange(T).expand(B, T) if layout == "one per row" else packed_position_ids(B, T, args.mean_doc)
        docs = Documents.from_position_ids(pos.to(dev))
        mask = allowed(docs.doc_ids, docs.doc_ids, torch.arange(T, device=dev)).unsqueeze(1)
        pairs = int(mask.sum()) * H
        ways = {"sdpa mask": dict(causal_only=False, mask=mask)}
        block_mask = document_block_mask(docs.doc_ids)
        ways["flex"] = dict(causal_only=False, block_mask=block_mask)
        if layout == "one per row":
            ways = {"sdpa causal": dict(causal_only=True), **ways}
        with torch.no_grad():
            ref = attend(q, k, v, scale, causal_only=False, mask=mask).float()
            err = float((attend(q, k, v, scale, **ways["flex"]).float() - ref).norm() / ref.norm())
        assert err < 2e-2, f"flex differs from SDPA by {err:.2e} ({layout})"
        mask_ms = median_ms(lambda: document_block_mask(docs.doc_ids), dev, 25, 100)
        for way, how in ways.items():
            fwd, both = timed(**how)
            flops = 2 * (Dqk + Dv) * pairs
            rows.append(dict(layout=layout, way=way, documents=docs.cu_seqlens.numel() - 1, fwd_ms=fwd,
                             fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9, fwd_bwd_tflops=2.5 * flops / both / 1e9,
                             block_mask_ms=mask_ms if way == "flex" else None, flex_vs_sdpa_err=err))
    print(f"MLA attention on {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={B} H={H} T={T} "
          f"qk {Dqk} v {Dv}")
    print(f"{'layout':>12} {'way':>12} {'docs':>5} {'fwd ms':>8} {'f+b ms':>8} {'fwd TF/s':>9} {'f+b TF/s':>9} "
          f"{'mask ms':>8}")
    for r in rows:
        mask_col = f"{r['block_mask_ms']:8.3f}" if r["block_mask_ms"] is not None else f"{'':>8}"
        print(f"{r['layout']:>12} {r['way']:>12} {r['documents']:>5} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['fwd_tflops']:9.1f} {r['fwd_bwd_tflops']:9.1f} {mask_col}")
    with open(args.json, "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=B, heads=H, seq=T, qk_dim=Dqk,
                       v_dim=Dv, mean_doc=args.mean_doc, rows=rows), fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
