"""bench-1B's MoE dims as command-line arguments, shared by the MoE benchmarks (``moe.py``, ``moe_ep.py``,
``moe_components.py``, ``grouped_wgrad.py``): E = 128 routed experts, k = 8 a token, latent ℓ = 512,
expert width I = 256."""

from __future__ import annotations

import argparse


def add_moe_dims(ap: argparse.ArgumentParser, tokens: int, tokens_help: str = "tokens") -> None:
    """--experts, --topk, --latent, --width and --tokens (default ``tokens``) on ``ap``."""
    ap.add_argument("--experts", type=int, default=128, help="routed experts E")
    ap.add_argument("--topk", type=int, default=8, help="experts a token, k")
    ap.add_argument("--latent", type=int, default=512, help="latent width ℓ")
    ap.add_argument("--width", type=int, default=256, help="expert intermediate size I")
    ap.add_argument("--tokens", type=int, default=tokens, help=tokens_help)
