"""Our model against the independent HF reference forward, through the real export (issue 13).

    python benchmarks/hf_reference_check.py --model k3_bench_1b --seq 256 --weights init,spread

For each weight set it saves ``--model`` as one of our checkpoints, exports it with
``k3train.convert`` (``--experts bf16|mxfp4``) into a temporary folder, reads the written
safetensors back with plain ``safetensors`` and runs, on ``--batch`` x ``--seq`` tokens (random ids
packed into ``--docs`` documents per row, or with ``--tokens corpus`` a window of the embedded default
corpus, the in-distribution input of a checkpoint trained on it), four forwards: ours and ``k3train.convert.hf_reference``
each in fp32 and in bf16. It compares the logits over all positions (cosine, relative Frobenius
error, worst position, top-1 agreement) for four pairs, prints a table and writes JSON:

    ours32~ref32   conversion + implementation, no rounding in the way (the k3_tiny CPU test's 1e-5)
    ours16~ref16   the issue's bf16 line: same bf16 weights, same precision policy on both sides
    ref16~ref32    the noise floor: what bf16 costs an independent, correct implementation
    ours16~ref32   how far our bf16 forward is from the exact answer

Why this is a fair test of "cosine >= 0.9999 in bf16". The reference's bf16 mode follows the
precision K3_SPEC fixes (bf16 weight matmuls; fp32 depth state, AttnRes, norm statistics, short
conv, KDA gates and recurrence, MLA attention output, router and SiTU), so ours16~ref16 measures
disagreement in what the spec leaves open (rounding points, op order, chunked vs per-token
KDA), not a reference that rounds what the spec keeps in fp32 (that gave 0.9648 on bench-1B).
The bar is only attainable where bf16 rounding itself stays below it, i.e. ref16~ref32 >=
``--min-cosine``; bf16 rounding errors grow with depth and with the weights' gain, so on strong
random weights no two bf16 implementations can agree to 1e-4. Hence, per weight set:

    absolute gate (only when the floor allows it): cos(ours16, ref16) >= --min-cosine
    relative gate (always):  1 - cos(ours16, ref32) <= --max-floor-ratio x (1 - cos(ref16, ref32))

The second says our bf16 forward is no further from the exact logits than a few times an
independent bf16 implementation is; it holds on any weights. Weight sets (``--weights``, comma
separated):

    init     the training init (``model.init_std`` matrices, zero AttnRes queries, unit norms,
             zero router bias): the weights of a checkpoint as training starts it, realistic scale.
    spread   every tensor random at a scale that keeps activations O(1) (matrices std
             0.2/sqrt(fan_in), AttnRes queries std 1/sqrt(d), random norm gains, router biases
             and A_log), so that a wrong AttnRes, norm or router tensor changes the logits;
             this is the set the fp32 exactness needs, and the hardest for bf16.
    PATH     one of our checkpoints (e.g. a trained bench-1B run): what a user exports.

Every set is rounded as the export stores it (bf16, fp32 where §4 says so, MXFP4 experts with
``--experts mxfp4``), so both sides see the same weights. On a GPU our fp32 forward runs the
Triton KDA kernels, whose fp32 dots use TF32: ours32~ref32 is then ~1e-4, not 1e-5 (the CPU test
holds the 1e-5 line). The reference is naive (per-token KDA and conv loops, a loop over experts):
fine at a few hundred tokens. Exits non-zero when a gate fails.
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
from k3train.convert.convert import export_hf, load_weights  # noqa: E402
from k3train.convert.dist_checkpoint import write_model_checkpoint  # noqa: E402
from k3train.convert.hf_reference import reference_logits  # noqa: E402
from k3train.convert.mxfp4 import pack_mxfp4, unpack_mxfp4  # noqa: E402
from k3train.model.k3 import K3Model  # noqa: E402
from k3train.model.roles import get_role, interleave_rows  # noqa: E402

KEPT_FP32 = ("conv1d", ".A_log", ".dt_bias", ".o_norm", ".e_score_correction_bias")  # fp32 in the export
PAIRS = (("ours32~ref32", "ours32", "ref32"), ("ours16~ref16", "ours16", "ref16"),
         ("ref16~ref32", "ref16", "ref32"), ("ours16~ref32", "ours16", "ref32"))


@torch.no_grad()
def spread_weights_(model: K3Model, seed: int) -> None:
    """Every tensor random at a scale that keeps activations O(1). A row-interleaved stack (the experts' w13) is
    drawn as its matrices one after another and then interleaved, so a seed gives the same HF tensors (w1, w3)
    as when w13 was stored blocked."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_res.proj"):  # depth-softmax scores of std ~1
            t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)
        elif name.endswith((".A_log", ".e_score_correction_bias")):
            t.normal_(0.0, 0.5, generator=g)
        elif name.endswith(("norm", "norm.weight")):
            t.normal_(1.0, 0.2, generator=g)
        elif t.dim() >= 2 and not name.endswith("conv1d"):
            s = getattr(get_role(t), "row_interleave", 1)
            drawn = t.new_empty(*t.shape[:-2], s, t.shape[-2] // s, t.shape[-1])
            t.copy_(interleave_rows(drawn.normal_(0.0, 0.2 / t.shape[-1] ** 0.5, generator=g)))


@torch.no_grad()
def round_as_exported_(model: K3Model, mxfp4_experts: bool) -> None:
    """Round every tensor as the export stores it: bf16 except §4's fp32 ones; MXFP4 experts."""
    for name, t in model.state_dict(keep_vars=True).items():
        if not name.endswith(KEPT_FP32):
            t.copy_(t.bfloat16())
        if mxfp4_experts and name.endswith((".experts.w13", ".experts.w2")):  # MXFP4 blocks run along rows
            rows = t.view(-1, t.shape[-1])
            rows.copy_(unpack_mxfp4(*pack_mxfp4(rows), dtype=torch.float32))


def build_model(weights: str, model_name: str, seed: int, mxfp4_experts: bool) -> K3Model:
    """``init`` / ``spread`` for ``model_name`` (seeded), or the weights of our checkpoint ``weights``."""
    if weights in ("init", "spread"):
        cfg = load_config([f"model={model_name}"]).model
        torch.manual_seed(seed)
        model = K3Model(cfg, linear_backend="torch")
        if weights == "spread":
            spread_weights_(model, seed + 1)
    else:
        cfg, state = load_weights(Path(weights))
        model = K3Model(cfg, linear_backend="torch")
        model.load_state_dict(state)
    round_as_exported_(model, mxfp4_experts)
    return model.eval()


def save_checkpoint(model: K3Model, out: Path) -> Path:
    """``model`` as a weights-only checkpoint of ours (global shapes, the format training writes)."""
    write_model_checkpoint(out, model.cfg, {n: (tuple(t.shape), t.dtype, lambda t=t: t.detach().cpu().clone())
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


def corpus_batch(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] tokens of the embedded default corpus (the data a default run trains on; built once),
    from a seeded offset, and position ids restarting after every end-of-document token."""
    import numpy as np

    from k3train.data.default_corpus import ensure_default_dataset

    prefix, _ = ensure_default_dataset(None, min(vocab, 512), progress=False)
    meta = json.loads(Path(f"{prefix}.meta.json").read_text())
    data = np.memmap(f"{prefix}.bin", dtype=np.dtype(meta["dtype"]), mode="r")
    start = int(torch.randint(0, len(data) - batch * seq, (1,), generator=torch.Generator().manual_seed(seed)))
    tokens = torch.from_numpy(data[start:start + batch * seq].astype(np.int64)).view(batch, seq)
    pos = torch.arange(seq).repeat(batch, 1)
    for row, toks in zip(pos, tokens):
        for i in (toks[:-1] == meta["eod"]).nonzero().flatten().tolist():
            row[i + 1:] -= int(row[i + 1])
    return tokens, pos


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    a, b = ours.double().flatten(0, -2), ref.double().flatten(0, -2)  # [positions, V]
    return {"cosine": float((a * b).sum() / (a.norm() * b.norm())),
            "rel_err": float((a - b).norm() / b.norm()),
            "max_pos_rel_err": float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).double().mean())}


def gates(pairs: dict[str, dict[str, float]], min_cosine: float, max_floor_ratio: float) -> dict:
    """The module docstring's two gates from the four pairs' cosines."""
    floor = 1.0 - pairs["ref16~ref32"]["cosine"]
    ratio = (1.0 - pairs["ours16~ref32"]["cosine"]) / max(floor, 1e-12)
    absolute = pairs["ref16~ref32"]["cosine"] >= min_cosine
    abs_ok = pairs["ours16~ref16"]["cosine"] >= min_cosine if absolute else None
    return {"floor_allows_bar": absolute, "bar_ok": abs_ok, "floor_ratio": ratio,
            "floor_ratio_ok": ratio <= max_floor_ratio, "passed": abs_ok is not False and ratio <= max_floor_ratio}


def timed(fn, device: torch.device):
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def check(weights: str, args, device: torch.device) -> dict:
    """One weight set: export, four forwards, the pairs and the gates."""
    model, t_build = timed(lambda: build_model(weights, args.model, args.seed, args.experts == "mxfp4"), device)
    model.to(device)
    cfg = model.cfg
    make = corpus_batch(args.batch, args.seq, cfg.vocab_size, args.seed) if args.tokens == "corpus" else \
        packed_batch(args.batch, args.seq, args.docs, cfg.vocab_size, args.seed)
    tokens, pos = (t.to(device) for t in make)
    with tempfile.TemporaryDirectory(prefix="hf_reference_check_") as tmp:
        def export() -> None:
            export_hf(save_checkpoint(model, Path(tmp) / "ours"), Path(tmp) / "hf", args.experts, progress=False)

        _, t_export = timed(export, device)
        tensors, text = read_export(Path(tmp) / "hf", device)
    logits, seconds = {}, {}
    with torch.no_grad():
        for bits, dtype in (("32", torch.float32), ("16", torch.bfloat16)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bits == "16"):
                logits["ours" + bits], seconds["ours" + bits] = timed(lambda: model(tokens, pos).float(), device)
    del model
    with torch.device(device):  # the reference makes its helper tensors on the default device
        for bits, dtype in (("32", torch.float32), ("16", torch.bfloat16)):
            logits["ref" + bits], seconds["ref" + bits] = timed(
                lambda: reference_logits(tensors, text, tokens, pos, dtype), device)
    pairs = {name: compare(logits[a], logits[b]) for name, a, b in PAIRS}
    return {"weights": weights, "model": cfg.name, "experts": args.experts, "batch": args.batch, "seq": args.seq,
            "tokens": args.tokens, "docs": args.docs, "pairs": pairs, **gates(pairs, args.min_cosine, args.max_floor_ratio),
            "build_s": t_build, "save_export_s": t_export, **{f"{k}_s": v for k, v in seconds.items()}}


def print_table(rows: list[dict], min_cosine: float, max_floor_ratio: float) -> None:
    print(f"{'weights':>8} {'pair':>13} {'cosine':>11} {'rel err':>9} {'max pos':>9} {'top1':>7}")
    for r in rows:
        w = Path(r["weights"]).name if r["weights"] not in ("init", "spread") else r["weights"]
        for name, m in r["pairs"].items():
            print(f"{w[:8]:>8} {name:>13} {m['cosine']:>11.8f} {m['rel_err']:>9.2e} {m['max_pos_rel_err']:>9.2e} "
                  f"{m['top1_agree']:>7.1%}")
        bar = ("n/a: floor below the bar" if r["bar_ok"] is None else "ok" if r["bar_ok"] else "FAIL")
        print(f"{'':>8} ours16~ref16 >= {min_cosine}: {bar}; (1-cos ours16~ref32)/(1-cos ref16~ref32) = "
              f"{r['floor_ratio']:.2f} <= {max_floor_ratio}: {'ok' if r['floor_ratio_ok'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_bench_1b", help="model config for the init/spread weight sets")
    ap.add_argument("--weights", default="init,spread", help="comma separated: init, spread, or our checkpoint paths")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", choices=["bf16", "mxfp4"], default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--tokens", choices=["random", "corpus"], default="random",
                    help="random ids packed into --docs documents, or a window of the embedded default corpus "
                         "(the in-distribution input for a checkpoint trained on it)")
    ap.add_argument("--docs", type=int, default=3, help="packed documents per row with --tokens random (1: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-cosine", type=float, default=0.9999)
    ap.add_argument("--max-floor-ratio", type=float, default=4.0)
    ap.add_argument("--json", default="hf_reference_check.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = [check(w, args, device) for w in args.weights.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    docs = "corpus text" if args.tokens == "corpus" else f"random ids, {args.docs} docs/row"
    print(f"hf_reference_check on {name}, {args.batch}x{args.seq} tokens ({docs}), experts {args.experts}")
    print_table(rows, args.min_cosine, args.max_floor_ratio)
    Path(args.json).write_text(json.dumps({"device": name, "min_cosine": args.min_cosine,
                                           "max_floor_ratio": args.max_floor_ratio, "rows": rows}, indent=2) + "\n")
    failed = [r["weights"] for r in rows if not r["passed"]]
    if failed:
        sys.exit(f"hf_reference_check: a gate failed for weights {', '.join(failed)} (see the table)")
    return rows


if __name__ == "__main__":
    main()
