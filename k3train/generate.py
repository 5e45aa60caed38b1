"""Text generation from a checkpoint: ``python -m k3train.generate --checkpoint PATH --prompt TEXT``.

PATH is one of our checkpoints (a ``step_XXXXXXXX`` folder or a run directory) or an HF Kimi K3
folder. Decoding is greedy (``--greedy``) or top-p sampling (``--top-p``, ``--temperature``,
``--seed``), on CPU or GPU (bf16 autocast). Each new token re-runs the whole sequence (no KV/KDA
state cache): simple and exact, meant for checks of small models, not for serving.

Tokenizer: ``--tokenizer`` (a tokenizer.json or a tiktoken BPE file), else the checkpoint folder's
own ``tokenizer.json`` / ``tiktoken.model`` (an HF folder, or what ``from-hf`` carried over), else
the data tokenizer of the run that wrote the checkpoint (its ``.hydra/config.yaml``), else the
default corpus's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch


def top_p_sample(logits: torch.Tensor, top_p: float, temperature: float, generator: torch.Generator) -> int:
    """One token id from logits [V]: the smallest set of tokens whose probability reaches ``top_p``."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(0) - sorted_p < top_p  # always keeps the most likely token
    sorted_p = torch.where(keep, sorted_p, 0.0)
    choice = torch.multinomial(sorted_p.cpu() / sorted_p.sum().cpu(), 1, generator=generator)
    return int(order[choice.to(order.device)])


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, greedy: bool = True,
             top_p: float = 0.9, temperature: float = 1.0, seed: int = 0, eod: int | None = None,
             device: torch.device | str = "cpu") -> list[int]:
    """Prompt ids → prompt + up to ``max_new_tokens`` new ids (stops after ``eod``)."""
    device = torch.device(device)
    ids = list(prompt)
    g = torch.Generator().manual_seed(seed)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    for _ in range(max_new_tokens):
        with amp:
            logits = model(torch.tensor([ids], device=device))[0, -1]
        nxt = int(logits.argmax()) if greedy else top_p_sample(logits, top_p, temperature, g)
        ids.append(nxt)
        if nxt == eod:
            break
    return ids


def find_tokenizer(checkpoint: Path, explicit: str | None, vocab_size: int):
    from k3train.data.tokenizer import load_tokenizer, tokenizer_in

    if explicit:
        return load_tokenizer(explicit)
    if tokenizer_in(str(checkpoint)):
        return load_tokenizer(tokenizer_in(str(checkpoint)))
    from k3train.config.schema import DataConfig
    from k3train.convert.dist_checkpoint import resolve_checkpoint
    from k3train.data.datasets import resolve_data

    data = DataConfig(cache_dir=os.environ.get("K3TRAIN_CACHE", "~/.cache/k3train"))
    ckpt = resolve_checkpoint(checkpoint)
    for run in (ckpt.parent.parent, checkpoint):
        hydra = run / ".hydra" / "config.yaml"
        if hydra.is_file():
            from omegaconf import OmegaConf

            saved = OmegaConf.load(hydra).get("data", {})
            data = DataConfig(paths=list(saved.get("paths") or []), tokenizer=saved.get("tokenizer"),
                              cache_dir=data.cache_dir)
            break
    return load_tokenizer(resolve_data(data, min(vocab_size, 512)).tokenizer_path)


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    p = argparse.ArgumentParser(prog="python -m k3train.generate", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: top-p sampling)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer",
                   help="a tokenizer.json or tiktoken BPE file (default: the checkpoint's, else the data's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = p.parse_args(argv)
    try:
        from k3train.convert.convert import load_weights
        from k3train.data.tokenizer import check_vocab
        from k3train.model.k3 import K3Model
        from k3train.parallel.state import pick_device

        if not 0.0 < args.top_p <= 1.0 or args.temperature <= 0:
            raise ValueError(f"--top-p={args.top_p} must be in (0, 1] and --temperature={args.temperature} > 0")
        device = pick_device(args.device)
        cfg, state = load_weights(args.checkpoint)
        tok = find_tokenizer(args.checkpoint, args.tokenizer, cfg.vocab_size)
        check_vocab(cfg.vocab_size, tok)
        model = K3Model(cfg, linear_backend="torch")
        model.load_state_dict(state)
        model.to(device).eval()
        ids = generate(model, tok.encode(args.prompt), args.max_new_tokens, args.greedy, args.top_p,
                       args.temperature, args.seed, tok.eod, device)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        if os.environ.get("K3TRAIN_TRACEBACK") == "1":
            raise
        sys.exit(f"k3train.generate: error: {err}")
    print(tok.decode(ids))


if __name__ == "__main__":
    main()
