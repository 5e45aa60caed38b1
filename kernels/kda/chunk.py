"""Triton chunkwise KDA (placeholder: falls back to the torch reference until the kernels land)."""
from .reference import kda_chunked


def kda_triton(q, k, v, g, beta, A_log, dt_bias, *, validate=True, **kw):
    return kda_chunked(q, k, v, g, beta, A_log, dt_bias, **kw)
