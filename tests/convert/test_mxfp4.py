"""K3 MXFP4 expert encoding: shapes, round trip against the QAT fake quant, and an independent
decode written from K3_SPEC.md §4."""

from __future__ import annotations

import pytest
import torch

from k3train.convert.mxfp4 import (export_routed_experts, import_routed_experts, pack_mxfp4,
                                   unpack_mxfp4)
from k3train.precision.mx_qat import mx_fake_quant

SPEC_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def spec_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K3_SPEC.md §4, element by element: byte i of a row holds column 2i in its low nibble and
    column 2i+1 in its high nibble; bit 3 is the sign, bits 0-2 index the LUT;
    W[r, c] = LUT[code] * 2^(scale[r, c // 32] - 127)."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half, dtype=torch.float64)
    for r in range(rows):
        for i in range(half):
            byte = int(packed[r, i])
            for c, nib in ((2 * i, byte & 0xF), (2 * i + 1, byte >> 4)):
                mag = SPEC_LUT[nib & 0x7] * 2.0 ** (int(scale[r, c // 32]) - 127)
                out[r, c] = -mag if nib & 0x8 else mag
    return out


def _weight(rows, cols, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w = w * torch.exp2(torch.randint(-6, 6, (rows, cols // 32), generator=g).float()
                       ).repeat_interleave(32, dim=1)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_round_trip_equals_fake_quant(dtype):
    w = _weight(48, 192, 0, dtype)
    packed, scale = pack_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 96)
    assert scale.dtype == torch.uint8 and scale.shape == (48, 6)
    back = unpack_mxfp4(packed, scale, dtype=dtype)
    fq = mx_fake_quant(w)  # the QAT weight quantizer (MXFP4, RCEIL)
    assert back.dtype == dtype and torch.equal(back, fq)
    # a QAT-trained (already representable) weight ships without further rounding (the bytes
    # may differ: a block whose amax rounded down to 3*2^k re-encodes as 6*2^(k-1))
    assert torch.equal(unpack_mxfp4(*pack_mxfp4(fq), dtype=dtype), fq)


def test_matches_independent_spec_decode():
    w = _weight(6, 96, 1)
    w[0, :32] = 0.0          # all-zero block
    w[1, 5] = -0.0
    w[2, 40] = 50.0          # outlier
    packed, scale = pack_mxfp4(w)
    ref = spec_decode(packed, scale)
    got = unpack_mxfp4(packed, scale, dtype=torch.float32)
    assert torch.equal(got.double(), ref)
    assert torch.equal(unpack_mxfp4(packed, scale), ref.to(torch.bfloat16))
    # scale = 2^ceil(log2(amax / 6)) (the Megatron-Bridge export rule)
    amax = w.double().reshape(6, 3, 32).abs().amax(-1)
    nz = amax > 0
    want = torch.ceil(torch.log2(amax[nz] / 6)) + 127
    assert torch.equal(scale[nz].double(), want)


def test_k3_shapes():
    # K3 w1/w3 [3072, 3584] -> [3072, 1792] + [3072, 112]; w2 [3584, 3072] -> [3584, 1536] + [3584, 96]
    # (same arithmetic at 1/16 of the rows)
    for rows, cols in ((192, 3584), (224, 3072)):
        p, s = pack_mxfp4(torch.zeros(rows, cols, dtype=torch.bfloat16))
        assert p.shape == (rows, cols // 2) and s.shape == (rows, cols // 32)


def test_errors():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        pack_mxfp4(torch.randn(4, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        pack_mxfp4(torch.randn(64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="not supported"):
        pack_mxfp4(torch.randn(4, 64, dtype=torch.float16))
    p, s = pack_mxfp4(torch.randn(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not match scale shape"):
        unpack_mxfp4(p, s[:, :1])
    with pytest.raises(ValueError, match="does not match scale shape"):
        unpack_mxfp4(p[:3], s)
    with pytest.raises(ValueError, match="2-D"):
        unpack_mxfp4(p.reshape(-1), s)


def test_export_import_routed_experts():
    E, I, ell = 3, 64, 32
    w13 = _weight(E * 2 * I, ell, 2).reshape(E, 2 * I, ell)
    w2 = _weight(E * ell, I, 3).reshape(E, ell, I)
    prefix = "language_model.model.layers.1.block_sparse_moe"
    t = export_routed_experts(w13, w2, prefix)
    assert len(t) == E * 3 * 2
    assert t[f"{prefix}.experts.0.w1.weight_packed"].shape == (I, ell // 2)
    assert t[f"{prefix}.experts.2.w2.weight_scale"].shape == (ell, I // 32)
    # w1 = gate = the even rows of w13, w3 = up = the odd rows (interleaved pairs)
    for name, rows in (("w1", slice(0, None, 2)), ("w3", slice(1, None, 2))):
        assert torch.equal(unpack_mxfp4(t[f"{prefix}.experts.1.{name}.weight_packed"],
                                        t[f"{prefix}.experts.1.{name}.weight_scale"]),
                           mx_fake_quant(w13[1, rows].contiguous()))
    a13, a2 = import_routed_experts(t, prefix, E)
    assert torch.equal(a13, mx_fake_quant(w13)) and torch.equal(a2, mx_fake_quant(w2))
    with pytest.raises(KeyError, match="missing MXFP4 tensor"):
        import_routed_experts(t, prefix, E + 1)
    with pytest.raises(ValueError, match="not \\[E, 2I, l\\]"):
        export_routed_experts(w13, w2[:, :, :32], prefix)


def test_triton_backend_matches():
    from kernels.mx.triton_mx import interpreter_active
    if not (torch.cuda.is_available() or interpreter_active()):
        pytest.skip("Triton interpreter off in this process; tests/kernels/test_mx.py covers the "
                    "Triton kernels in a subprocess")
    w = _weight(16, 128, 4)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p_ref, s_ref = pack_mxfp4(w, backend="reference")
    p, s = pack_mxfp4(w.to(dev), backend="triton")
    assert torch.equal(p.cpu(), p_ref) and torch.equal(s.cpu(), s_ref)
    assert torch.equal(unpack_mxfp4(p, s, backend="triton").cpu(),
                       unpack_mxfp4(p_ref, s_ref, backend="reference"))
