"""``python -m k3train.convert`` (console script ``k3train-convert``).

    k3train-convert to-hf --checkpoint runs/k3_tiny --out hf/k3_tiny [--experts mxfp4|bf16]
    k3train-convert from-hf --hf hf/k3_tiny --out ckpt/k3_tiny_init
    k3train-convert inspect PATH              # an HF folder or one of our checkpoints
    k3train-convert inspect --model k3 --experts mxfp4   # the HF listing of a config (meta device)

Errors in the user's input print one line naming the file and the fix (K3TRAIN_TRACEBACK=1
shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3train-convert", description="Kimi K3 HF layout <-> k3train checkpoints")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-hf", help="export one of our checkpoints to the HF Kimi K3 layout")
    a.add_argument("--checkpoint", required=True, type=Path, help="step_XXXXXXXX folder or a run directory")
    a.add_argument("--out", required=True, type=Path)
    a.add_argument("--experts", choices=["bf16", "mxfp4"], default=None,
                   help="routed-expert format (default: mxfp4 for a QAT-trained run, else bf16)")
    a.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="dtype of the non-fp32 tensors")
    a.add_argument("--shard-size-gb", type=float, default=5.0)
    b = sub.add_parser("from-hf", help="import an HF Kimi K3 folder as a weights-only k3train checkpoint")
    b.add_argument("--hf", required=True, type=Path)
    b.add_argument("--out", required=True, type=Path)
    c = sub.add_parser("inspect", help="list tensors, shapes, dtypes, counts and bytes")
    c.add_argument("path", nargs="?", type=Path)
    c.add_argument("--model", help="instead of a path: a conf/model name, listed as to-hf would write it")
    c.add_argument("--experts", choices=["bf16", "mxfp4"], default="mxfp4")
    c.add_argument("--summary", action="store_true", help="only the totals")
    for sp in (a, b):
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def print_listing(title: str, specs: list, summary: bool = False) -> None:
    """One line per tensor (name, shape, dtype, bytes) unless ``summary``, then totals per dtype."""
    if not summary:
        for s in specs:
            print(f"{s.name}\t{list(s.shape)}\t{str(s.dtype).replace('torch.', '')}\t{s.nbytes}")
    by_dtype: dict[str, list[int]] = {}
    for s in specs:
        row = by_dtype.setdefault(str(s.dtype).replace("torch.", ""), [0, 0, 0])
        row[0] += 1
        row[1] += s.numel
        row[2] += s.nbytes
    total = sum(s.nbytes for s in specs)
    print(f"# {title}: {len(specs)} tensors, {sum(s.numel for s in specs):,} elements, {total:,} bytes "
          f"({_human(total)})")
    for dt, (n, numel, nbytes) in sorted(by_dtype.items()):
        print(f"#   {dt}: {n} tensors, {numel:,} elements, {nbytes:,} bytes")


def _qat_trained(ckpt_path: Path) -> bool:
    """Whether the run that wrote the checkpoint had precision.expert_qat on (its .hydra config)."""
    from k3train.convert.dist_checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(ckpt_path)
    for run in (ckpt.parent.parent, ckpt_path):
        cfg = run / ".hydra" / "config.yaml"
        if cfg.is_file():
            from omegaconf import OmegaConf

            return bool(OmegaConf.load(cfg).get("precision", {}).get("expert_qat", False))
    return False


def run(args: argparse.Namespace) -> None:
    from k3train.convert import convert

    if args.cmd == "to-hf":
        experts = args.experts or ("mxfp4" if _qat_trained(args.checkpoint) else "bf16")
        specs = convert.export_hf(args.checkpoint, args.out, experts, _DTYPES[args.dtype],
                                  int(args.shard_size_gb * 2**30), progress=not args.quiet)
        print(f"wrote {args.out}: {len(specs)} tensors, {sum(s.nbytes for s in specs):,} bytes, experts={experts}")
    elif args.cmd == "from-hf":
        cfg = convert.import_hf(args.hf, args.out, progress=not args.quiet)
        print(f"wrote {args.out}: k3train weights-only checkpoint ({cfg.num_layers} layers, d={cfg.hidden_size}); "
              f"train with train.init_from={args.out}")
    elif args.model:
        from k3train.config.load import load_config

        cfg = load_config([f"model={args.model}"]).model
        print_listing(f"to-hf {args.model} experts={args.experts}", convert.listing_of_config(cfg, args.experts),
                      args.summary)
    else:
        if args.path is None:
            raise ValueError("inspect needs a PATH (an HF folder or a k3train checkpoint) or --model NAME")
        kind, specs = convert.inspect_path(args.path)
        print_listing(f"{kind} {args.path}", specs, args.summary)


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    args = _parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as err:
        if os.environ.get("K3TRAIN_TRACEBACK") == "1":
            raise
        sys.exit(f"k3train-convert: error: {err}")


if __name__ == "__main__":
    main()
