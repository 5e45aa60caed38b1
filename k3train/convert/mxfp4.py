"""K3 MXFP4 checkpoint encoding of the routed experts (K3_SPEC.md §4).

Each expert matrix W [rows, cols] (cols = the reduction dim) is stored as

* ``weight_packed`` uint8 [rows, cols/2]: byte i of a row holds column 2i in its low
  nibble and column 2i+1 in its high nibble; a nibble is bit 3 = sign, bits 0-2 index
  {0, .5, 1, 1.5, 2, 3, 4, 6};
* ``weight_scale`` uint8 [rows, cols/32]: E8M0, ``W[r, c] = LUT[code] * 2**(scale[r, c//32] - 127)``.

Encoding uses the RCEIL scale rule (scale 2^ceil(log2(amax/6)), the rule of the
Megatron-Bridge export) with round-to-nearest-even, i.e. exactly the values of the
MXFP4 weight fake quant used for QAT (``k3train.precision.mx_qat`` defaults), so a
QAT-trained expert ships without any further rounding.

HF names: ``{prefix}.experts.{e}.{w1,w3,w2}.{weight_packed,weight_scale}``, w1 = gate,
w3 = up, w2 = down; our stacked ``w13`` [E, 2I, ℓ] interleaves them: row 2j = w1's row j, row 2j + 1 =
w3's row j (so w1 = rows 0::2, w3 = rows 1::2).
"""

from __future__ import annotations

import torch

from k3train.model.roles import interleave_rows
from kernels.mx import mx_dequantize, mx_quantize

__all__ = ["pack_mxfp4", "unpack_mxfp4", "export_routed_experts", "import_routed_experts",
           "MXFP4_RULE"]

MXFP4_RULE = "rceil"


def pack_mxfp4(weight: torch.Tensor, rule: str = MXFP4_RULE, backend: str = "auto"):
    """bf16/fp32 weight [rows, cols] -> (weight_packed uint8 [rows, cols/2],
    weight_scale uint8 [rows, cols/32]). cols must be a multiple of 32."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"pack_mxfp4 expects a 2-D weight [rows, cols], got "
                         f"{getattr(weight, 'shape', type(weight))}")
    packed, scale = mx_quantize(weight.detach(), "e2m1", rule=rule, backend=backend)
    return packed, scale


def unpack_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack_mxfp4`: -> weight [rows, cols] in ``dtype`` (bf16 or fp32)."""
    if weight_packed.dim() != 2 or weight_scale.dim() != 2:
        raise ValueError(f"unpack_mxfp4 expects 2-D weight_packed [rows, cols/2] and weight_scale "
                         f"[rows, cols/32], got {tuple(weight_packed.shape)} and "
                         f"{tuple(weight_scale.shape)}")
    return mx_dequantize(weight_packed, weight_scale, "e2m1", dtype=dtype, backend=backend)


def export_routed_experts(w13: torch.Tensor, w2: torch.Tensor, prefix: str,
                          backend: str = "auto") -> dict[str, torch.Tensor]:
    """Stacked expert weights (w13 [E, 2I, ℓ] with interleaved gate/up rows, w2 [E, ℓ, I]) -> HF MXFP4 tensors."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] % 2 \
            or w13.shape[1] // 2 != w2.shape[2] or w13.shape[2] != w2.shape[1]:
        raise ValueError(f"export_routed_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
                         f"are not [E, 2I, l] and [E, l, I]")
    out: dict[str, torch.Tensor] = {}
    for e in range(w13.shape[0]):
        for name, w in (("w1", w13[e, 0::2]), ("w3", w13[e, 1::2]), ("w2", w2[e])):
            packed, scale = pack_mxfp4(w.contiguous(), backend=backend)
            out[f"{prefix}.experts.{e}.{name}.weight_packed"] = packed
            out[f"{prefix}.experts.{e}.{name}.weight_scale"] = scale
    return out


def import_routed_experts(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int,
                          dtype: torch.dtype = torch.bfloat16, backend: str = "auto"):
    """HF MXFP4 tensors -> (w13 [E, 2I, ℓ] with interleaved gate/up rows, w2 [E, ℓ, I]) in ``dtype``."""
    def get(e, name):
        base = f"{prefix}.experts.{e}.{name}"
        try:
            return unpack_mxfp4(tensors[base + ".weight_packed"], tensors[base + ".weight_scale"],
                                dtype=dtype, backend=backend)
        except KeyError as err:
            raise KeyError(f"missing MXFP4 tensor {err.args[0]}") from None

    w13, w2 = [], []
    for e in range(num_experts):
        w13.append(interleave_rows(torch.stack([get(e, "w1"), get(e, "w3")])))
        w2.append(get(e, "w2"))
    return torch.stack(w13), torch.stack(w2)
