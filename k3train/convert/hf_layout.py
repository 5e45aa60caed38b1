"""State-dict adapter: our K3 tensor names and shapes ↔ the Hugging Face Kimi K3 layout (K3_SPEC.md §4).

A ``Mapping`` ties one of our tensors (a name of ``K3Model.state_dict()``, e.g.
``layers.1.mlp.experts.w13`` [E, 2I, ℓ]) to the HF tensors it becomes, e.g.
``language_model.model.layers.1.block_sparse_moe.experts.{e}.{w1,w3}.weight`` [I, ℓ] or, as
MXFP4, ``...weight_packed`` uint8 [I, ℓ/2] and ``...weight_scale`` uint8 [I, ℓ/32].

Rules (each both ways):

- names: ``language_model.model.`` prefix (the LM head is ``language_model.lm_head``),
  ``mlp.`` → ``block_sparse_moe.`` on MoE layers, ``kv_a_proj`` → ``kv_a_proj_with_mqa``,
  AttnRes ``X_res.proj``/``X_res.norm`` → ``X_res_proj.weight``/``X_res_norm.weight``;
- experts: our stacked ``w13`` (rows interleaved: row 2j = gate_j, row 2j + 1 = up_j) splits into
  per-expert ``w1`` (gate) = rows 0::2 and ``w3`` (up) = rows 1::2, and import interleaves them
  again; ``w2`` [E, ℓ, I] into per-expert ``w2`` [ℓ, I];
- ``A_log`` [H] is padded with zeros to a multiple of 128 (96 → 128 in K3); on import the tail
  must be zero and is dropped;
- dtypes: the short convs, ``A_log``, ``dt_bias``, ``o_norm`` and the router bias are fp32, the
  rest bf16 (or fp32 when asked).

The adapter is pure: no files, no model forward. Its tensors are produced one HF tensor at a
time so a converter can stream them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from k3train.config.schema import ModelConfig
from k3train.convert.mxfp4 import pack_mxfp4, unpack_mxfp4
from k3train.model.roles import interleave_rows

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
A_LOG_MULTIPLE = 128  # K3 ships A_log [128] for 96 heads (K3_SPEC §4); the rounding rule is our reading
PASSTHROUGH = ("vision_tower.", "mm_projector.")  # tensors we do not own: carried unchanged
_FP32 = re.compile(r"(_conv1d\.weight|\.A_log|\.dt_bias|\.o_norm\.weight|\.e_score_correction_bias)$")
EXPERT_FORMATS = ("bf16", "mxfp4")


class LayoutError(ValueError):
    """An HF tensor is missing, has the wrong shape/dtype, or holds non-zero padding."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Mapping:
    """Our tensor ``ours`` [our_shape] ↔ the HF tensors ``hf`` (in file order). ``kind``:
    "copy", "a_log", "w13" or "w2" (experts); ``experts`` is "bf16" or "mxfp4"."""

    ours: str
    our_shape: tuple[int, ...]
    kind: str
    hf: tuple[TensorSpec, ...]
    experts: str = "bf16"


def padded_a_log_len(heads: int) -> int:
    return -(-heads // A_LOG_MULTIPLE) * A_LOG_MULTIPLE


def hf_name(ours: str, cfg: ModelConfig) -> str:
    """HF name of one of our non-expert tensors, e.g. ``layers.3.self_attn.kv_a_proj.weight`` →
    ``language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight``."""
    if ours == "lm_head.weight":
        return LM_HEAD
    name = re.sub(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)$", r"\1_\2.weight", ours)
    name = re.sub(r"\.(q_conv1d|k_conv1d|v_conv1d|o_norm)$", r".\1.weight", name)
    name = name.replace(".self_attn.kv_a_proj.", ".self_attn.kv_a_proj_with_mqa.")
    m = re.match(r"layers\.(\d+)\.mlp\.", name)
    if m and cfg.is_moe(int(m.group(1))):
        name = name.replace(".mlp.", ".block_sparse_moe.", 1)
    return PREFIX + name


def _expert_specs(base: str, proj: str, rows: int, cols: int, experts: str, dtype: torch.dtype
                  ) -> tuple[TensorSpec, ...]:
    if experts == "bf16":
        return (TensorSpec(f"{base}.{proj}.weight", (rows, cols), dtype),)
    return (TensorSpec(f"{base}.{proj}.weight_packed", (rows, cols // 2), torch.uint8),
            TensorSpec(f"{base}.{proj}.weight_scale", (rows, cols // 32), torch.uint8))


def mapping_for(ours: str, shape: tuple[int, ...], cfg: ModelConfig, experts: str = "bf16",
                dtype: torch.dtype = torch.bfloat16) -> Mapping:
    """The mapping of one of our tensors; ``dtype`` is the HF dtype of the non-fp32 tensors."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r}: use one of {EXPERT_FORMATS}")
    if ours.endswith(".experts.w13") or ours.endswith(".experts.w2"):
        base = hf_name(ours.rsplit(".", 1)[0], cfg)  # ...block_sparse_moe.experts
        E, rows, cols = shape
        if ours.endswith(".w13"):
            inter = rows // 2
            specs = tuple(s for e in range(E) for proj in ("w1", "w3")
                          for s in _expert_specs(f"{base}.{e}", proj, inter, cols, experts, dtype))
            return Mapping(ours, shape, "w13", specs, experts)
        specs = tuple(s for e in range(E) for s in _expert_specs(f"{base}.{e}", "w2", rows, cols, experts, dtype))
        return Mapping(ours, shape, "w2", specs, experts)
    name = hf_name(ours, cfg)
    hf_dtype = torch.float32 if _FP32.search(name) else dtype
    if ours.endswith(".A_log"):
        return Mapping(ours, shape, "a_log", (TensorSpec(name, (padded_a_log_len(shape[0]),), hf_dtype),))
    return Mapping(ours, shape, "copy", (TensorSpec(name, shape, hf_dtype),))


def build_mappings(our_tensors: dict[str, tuple[int, ...]], cfg: ModelConfig, experts: str = "bf16",
                   dtype: torch.dtype = torch.bfloat16) -> list[Mapping]:
    """Mappings of every tensor in ``our_tensors`` (name → shape, in state-dict order)."""
    return [mapping_for(n, tuple(s), cfg, experts, dtype) for n, s in our_tensors.items()]


def our_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``K3Model(cfg).state_dict()``, built on the meta device (no memory)."""
    from k3train.model.k3 import K3Model

    with torch.device("meta"):
        model = K3Model(cfg, linear_backend="torch")
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


# --- ours → HF ---------------------------------------------------------------------------------

def to_hf(m: Mapping, t: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Our tensor ``t`` [m.our_shape] → its HF tensors, one at a time, in ``m.hf`` order."""
    if tuple(t.shape) != m.our_shape:
        raise LayoutError(f"{m.ours}: got shape {tuple(t.shape)}, expected {m.our_shape}")
    if m.kind == "copy":
        yield m.hf[0], t.to(m.hf[0].dtype).contiguous()
        return
    if m.kind == "a_log":
        spec = m.hf[0]
        padded = torch.zeros(spec.shape, dtype=spec.dtype)
        padded[: t.shape[0]] = t.to(spec.dtype)
        yield spec, padded
        return
    specs = iter(m.hf)
    for matrix in _expert_matrices(m, t):
        if m.experts == "bf16":
            spec = next(specs)
            yield spec, matrix.to(spec.dtype).contiguous()
        else:
            packed, scale = pack_mxfp4_canonical(matrix)
            yield next(specs), packed
            yield next(specs), scale


def pack_mxfp4_canonical(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 bytes of ``w`` [rows, cols] that re-encode to themselves after a decode.

    RCEIL picks the block scale from the block's amax, so a block whose largest code rounds
    down to 3 decodes to values that re-encode with the next smaller scale (same values, other
    bytes). Encoding the decoded values once more gives the fixed point: an export of an
    imported export is byte-identical, and the values are those of one plain encoding.
    """
    packed, scale = pack_mxfp4(w.float().contiguous(), backend="torch")
    values = unpack_mxfp4(packed, scale, dtype=torch.float32, backend="torch")
    packed, scale = pack_mxfp4(values, backend="torch")
    return packed.contiguous(), scale.contiguous()


def _expert_matrices(m: Mapping, t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Per-expert matrices in HF order: w13 → (w1_0, w3_0, w1_1, ...) with w1_e = w13[e, 0::2] (gate) and
    w3_e = w13[e, 1::2] (up); w2 → (w2_0, w2_1, ...)."""
    for e in range(t.shape[0]):
        if m.kind == "w13":
            yield t[e, 0::2]
            yield t[e, 1::2]
        else:
            yield t[e]


# --- HF → ours ---------------------------------------------------------------------------------

def check_spec(spec: TensorSpec, t: torch.Tensor, where: str) -> None:
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise LayoutError(f"{where}: tensor {spec.name} is {t.dtype} {list(t.shape)}, expected {spec.dtype} "
                          f"{list(spec.shape)} (K3_SPEC §4); the file does not match config.json")


def from_hf(m: Mapping, get: Callable[[TensorSpec], torch.Tensor], dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    """The HF tensors of ``m`` (``get(spec)`` reads one, already checked) → our tensor [m.our_shape]."""
    if m.kind == "copy":
        return get(m.hf[0]).to(dtype)
    if m.kind == "a_log":
        spec = m.hf[0]
        full = get(spec)
        heads = m.our_shape[0]
        if torch.any(full[heads:] != 0):
            raise LayoutError(f"{spec.name}: padding entries {heads}..{spec.shape[0] - 1} are not zero "
                              f"(K3_SPEC §4: A_log holds {heads} heads then zeros); the checkpoint is corrupt "
                              f"or has more KDA heads than config.json says")
        return full[:heads].to(dtype)
    if m.experts == "bf16":
        mats = [get(spec).to(dtype) for spec in m.hf]
    else:
        mats = [unpack_mxfp4(get(p), get(s), dtype=torch.float32, backend="torch").to(dtype)
                for p, s in zip(m.hf[0::2], m.hf[1::2])]
    if m.kind == "w13":  # (w1_0, w3_0, w1_1, ...) → [E, 2, I, ℓ] → rows interleaved
        return interleave_rows(torch.stack(mats).unflatten(0, (-1, 2)))
    return torch.stack(mats)


def is_passthrough(name: str) -> bool:
    return name.startswith(PASSTHROUGH)
