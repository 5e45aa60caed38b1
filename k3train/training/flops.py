"""Model FLOPs per token for MFU, aware of KDA, MLA and the MoE's active experts.

Forward FLOPs of one token at sequence length T (a multiply-add counts 2):

- every matmul weight a token touches: 2 · (active parameters − input embedding − norms/gains).
  ``count_params(...).active`` already excludes the embedding and the inactive experts;
- MLA core, causal: 2 · (T/2) · H · ((n + r) + v) (scores and the weighted sum over half
  the keys on average);
- KDA core, chunkwise with chunk C: H · (6h² + 3Ch + C²) (Kimi Linear's count per head and
  token; ANCHORS.md uses it for fla's figure).

Training = 3 × forward (backward is twice the forward). ``peak_flops`` gives the device's
dense bf16 peak for MFU; None on CPU, where MFU is not reported.
"""

from __future__ import annotations

import torch

from k3train.config.param_count import count_params
from k3train.config.schema import ModelConfig

KDA_CHUNK = 64

_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0,
                     "GB200": 2500.0}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    d, L = cfg.hidden_size, cfg.num_layers
    n_mla = sum(cfg.is_mla(i) for i in range(L))
    n_kda = L - n_mla
    vector_params = (3 * d + 6 * d * L  # norms and AttnRes
                     + n_kda * (3 * cfg.kda_conv_size * cfg.kda_num_heads * cfg.kda_head_dim  # conv taps
                                + cfg.kda_num_heads * (1 + cfg.kda_head_dim) + cfg.kda_head_dim)
                     + n_mla * (cfg.q_lora_rank + cfg.kv_lora_rank)
                     + sum(cfg.is_moe(i) for i in range(L)) * (cfg.num_experts + cfg.latent_size))
    matmul_params = count_params(cfg).active - vector_params
    flops = 2.0 * matmul_params
    mla_core = 2.0 * (seq_len / 2) * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    h, C = cfg.kda_head_dim, KDA_CHUNK
    kda_core = cfg.kda_num_heads * (6 * h * h + 3 * C * h + C * C)
    return flops + n_mla * mla_core + n_kda * kda_core


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(cfg, seq_len)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one device, or None when unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
