"""Our model against the independent HF reference forward, through the real export (issue 13).

    python benchmarks/hf_reference_check.py --model k3_bench_1b --seq 256 --json hf_reference_check.json

Builds ``--model`` with random weights (seeded), saves it as one of our checkpoints, exports that
with ``k3train.convert`` (``--experts bf16|mxfp4``) into a temporary folder, and reads the written
safetensors back with plain ``safetensors``. On ``--batch`` x ``--seq`` random tokens packed into
``--docs`` documents per row it runs our forward (bf16 autocast, or fp32) and
``k3train.convert.hf_reference`` on the exported tensors (computed in bf16, or fp32), and compares
the logits over all positions: cosine, relative Frobenius error, the worst position's relative
error and top-1 agreement. Exits non-zero when the cosine is below ``--min-cosine``.

The weights are not the training init (std 0.006, zero AttnRes queries, unit norms, zero router
biases), under which the blocks barely move the logits and a wrong AttnRes, norm or router tensor
would go unseen: matrices get std 0.2/sqrt(fan_in), the AttnRes queries std 1/sqrt(d), and router
biases, A_log and the norm gains random values. Tensors the export stores in bf16 are rounded to bf16 and, with
``--experts mxfp4``, the routed experts to MXFP4, so both sides see the same weights and what is
left is the arithmetic. The reference is naive (per-token KDA and conv loops, a loop over
experts): about T x layers small kernels, fine at a few hundred tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3train.config.load import load_config  # noqa: E402
from k3train.convert.convert import export_hf  # noqa: E402
from k3train.convert.dist_checkpoint import stored_shape, write_model_checkpoint  # noqa: E402
from k3train.convert.hf_reference import reference_logits  # noqa: E402
from k3train.convert.mxfp4 import pack_mxfp4, unpack_mxfp4  # noqa: E402
from k3train.model.k3 import K3Model  # noqa: E402
from k3train.model.roles import get_role  # noqa: E402

KEPT_FP32 = ("conv1d", ".A_log", ".dt_bias", ".o_norm", ".e_score_correction_bias")  # fp32 in the export


@torch.no_grad()
def random_weights_(model: K3Model, seed: int, mxfp4_experts: bool) -> None:
    """Every tensor random at a scale that keeps activations O(1), rounded as the export stores it."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_res.proj"):  # depth-softmax scores of std ~1
            t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)
        elif name.endswith((".A_log", ".e_score_correction_bias")):
            t.normal_(0.0, 0.5, generator=g)
        elif name.endswith(("norm", "norm.weight")):
            t.normal_(1.0, 0.2, generator=g)
        elif t.dim() >= 2 and not name.endswith("conv1d"):
            t.normal_(0.0, 0.2 / t.shape[-1] ** 0.5, generator=g)
        if not name.endswith(KEPT_FP32):
            t.copy_(t.bfloat16())
        if mxfp4_experts and name.endswith((".experts.w13", ".experts.w2")):  # MXFP4 blocks run along rows
            rows = t.view(-1, t.shape[-1])
            rows.copy_(unpack_mxfp4(*pack_mxfp4(rows), dtype=torch.float32))


def save_checkpoint(model: K3Model, out: Path) -> Path:
    """``model`` as a weights-only checkpoint of ours (global shapes, the format training writes)."""
    roles = {n: get_role(p) for n, p in model.named_parameters()}
    write_model_checkpoint(out, model.cfg, {
        n: (stored_shape(tuple(t.shape), roles.get(n)), t.dtype, lambda t=t: t.detach().cpu().clone())
        for n, t in model.state_dict().items()})
    return out


def read_export(folder: Path, device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    """The exported tensors (every shard, plain safetensors) and config.json's text_config."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard), device=str(device)))
    return tensors, json.loads((folder / "config.json").read_text())["text_config"]


def packed_batch(batch: int, seq: int, docs: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens [B, T] and position ids restarting at ``docs - 1`` random cuts per row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.arange(seq).repeat(batch, 1)
    for row in pos:
        for c in sorted(torch.randperm(seq - 1, generator=g)[:docs - 1].add(1).tolist()):
            row[c:] -= int(row[c])
    return tokens, pos


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)  # [positions, V]
    return {"cosine": float((a * b).sum() / (a.norm() * b.norm())),
            "rel_err": float((a - b).norm() / b.norm()),
            "max_pos_rel_err": float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).double().mean())}


def timed(fn, device: torch.device):
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_bench_1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: our forward under bf16 autocast, the reference computed in bf16")
    ap.add_argument("--experts", choices=["bf16", "mxfp4"], default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--docs", type=int, default=3, help="packed documents per row (1: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-cosine", type=float, default=0.9999)
    ap.add_argument("--json", default="hf_reference_check.json")
    args = ap.parse_args(argv)
    device, bf16 = torch.device(args.device), args.dtype == "bf16"

    cfg = load_config([f"model={args.model}"]).model
    torch.manual_seed(args.seed)

    def build() -> K3Model:
        model = K3Model(cfg, linear_backend="torch").eval()
        random_weights_(model, args.seed + 1, args.experts == "mxfp4")
        return model.to(device)

    model, t_build = timed(build, device)
    tokens, pos = (t.to(device) for t in packed_batch(args.batch, args.seq, args.docs, cfg.vocab_size, args.seed))

    with tempfile.TemporaryDirectory(prefix="hf_reference_check_") as tmp:
        def export() -> None:
            ckpt = save_checkpoint(model, Path(tmp) / "ours")
            export_hf(ckpt, Path(tmp) / "hf", args.experts, progress=False)

        _, t_export = timed(export, device)
        tensors, text = read_export(Path(tmp) / "hf", device)

    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        ours, t_ours = timed(lambda: model(tokens, pos).float(), device)
    del model
    with torch.device(device):  # the reference makes its helper tensors on the default device
        ref, t_ref = timed(lambda: reference_logits(tensors, text, tokens, pos,
                                                    torch.bfloat16 if bf16 else torch.float32).float(), device)
    row = {"model": args.model, "dtype": args.dtype, "experts": args.experts, "batch": args.batch,
           "seq": args.seq, "docs": args.docs, "device": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", **compare(ours, ref), "min_cosine": args.min_cosine,
           "build_s": t_build, "save_export_s": t_export, "ours_s": t_ours, "reference_s": t_ref}
    print(f"{'model':>12} {'dtype':>5} {'experts':>7} {'B×T':>8} {'cosine':>10} {'rel err':>9} {'max pos':>9} "
          f"{'top1':>6} {'export s':>8} {'ours s':>7} {'ref s':>7}")
    print(f"{args.model:>12} {args.dtype:>5} {args.experts:>7} {f'{args.batch}×{args.seq}':>8} "
          f"{row['cosine']:>10.7f} {row['rel_err']:>9.2e} {row['max_pos_rel_err']:>9.2e} {row['top1_agree']:>6.1%} "
          f"{t_export:>8.1f} {t_ours:>7.2f} {t_ref:>7.1f}")
    Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    if row["cosine"] < args.min_cosine:
        sys.exit(f"hf_reference_check: cosine {row['cosine']:.7f} < --min-cosine {args.min_cosine}")
    return row


if __name__ == "__main__":
    main()
