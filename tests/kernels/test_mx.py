"""MX formats: the float64 reference against first principles, and the Triton kernels against
the reference bit for bit (CPU: Triton interpreter; GPU: ``-m gpu``)."""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from kernels.mx import (E2M1, mx_dequantize, mx_fake_quantize, mx_quantize, pack_fp4,
                        unpack_fp4)
from kernels.mx import reference as R
from kernels.mx.formats import E2M1_VALUES

FMTS = ["e4m3", "e5m2", "e2m1"]
RULES = ["floor", "rceil"]
DTYPES = [torch.float32, torch.bfloat16]


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal except that any NaN matches any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    a, b = torch.where(na, 0, a), torch.where(nb, 0, b)
    ia = a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16)
    ib = b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16)
    return torch.equal(ia, ib)


def random_input(shape, dtype, seed) -> torch.Tensor:
    """Normal data with a per-block magnitude spread over ~2^±40, never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    blocks = x.reshape(-1, 32)
    mag = torch.exp2(torch.randint(-40, 40, (blocks.shape[0], 1), generator=g).float())
    return (blocks * mag).reshape(shape).to(dtype)


def edge_input(fmt: str) -> torch.Tensor:
    """One edge case per block of 32 (fp32)."""
    f = R.get_format(fmt)
    g = torch.Generator().manual_seed(7)
    rows = []

    def block(vals=None, fill=0.0):
        b = torch.full((32,), fill)
        if vals is not None:
            vals = torch.as_tensor(vals, dtype=torch.float32)
            b[:len(vals)] = vals
        rows.append(b)

    block()                                             # 0 all zero
    block(fill=-0.0)                                    # 1 all negative zero
    block(torch.randn(32, generator=g) * 2.0 ** -135)   # 2 fp32 subnormals only
    block([2.0 ** -149, -(2.0 ** -149), 2.0 ** -126, 3 * 2.0 ** -140] + [0.0] * 4)  # 3 tiny
    block([1.0] + list(torch.randn(31, generator=g) * 2.0 ** -12))  # 4 element subnormals
    block(torch.cat([torch.tensor([4.0]), torch.rand(31, generator=g) * 4]))   # 5 amax = 2^2
    block(torch.cat([torch.tensor([-1024.0]), torch.randn(31, generator=g)]))  # 6 amax = -2^10
    block([f.max_value] + [1.0] * 31)                                          # 7 amax = max elem
    block([f.max_value * 2.0 ** 5] + [3.0] * 31)                               # 8 = max * 2^k
    nxt = torch.nextafter(torch.tensor(f.max_value * 8), torch.tensor(1e30)).item()
    block([nxt, 1.0, -2.0])                                                    # 9 just above
    block([-0.0, 0.0, 1.0, -0.0, -1e-30, 2.0, -3.0])                           # 10 signed zeros
    block(torch.cat([torch.tensor([1e30]), torch.randn(31, generator=g)]))     # 11 outlier
    block(torch.cat([torch.tensor([-3e38]), torch.randn(31, generator=g)]))    # 12 near FLT_MAX
    block([3.4028234663852886e38] * 2 + [-3.4028234663852886e38])              # 13 FLT_MAX
    block([float("inf"), 1.0, -2.0])                                           # 14 +inf
    block([1.0, float("-inf"), -0.0])                                          # 15 -inf
    block([float("nan"), 1.0, -2.0])                                           # 16 nan
    # 17 exact ties between grid points (in units of the block's element step)
    if fmt == "e2m1":
        block([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.26, -1.75])
    elif fmt == "e4m3":
        block([448.0, 1.0625, 1.1875, 0.001953125 * 1.5, 0.001953125 * 0.5, -17.0, 19.0, 460.0])
    else:
        block([57344.0, 1.125, 1.375, 2.0 ** -16 * 1.5, 2.0 ** -17, -5.0, 7.0, 60000.0])
    block(torch.randn(32, generator=g).sign() * 2.0 ** torch.randint(-20, 20, (32,), generator=g))  # 18
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------
# the reference against first principles
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_rounding_matches_torch_float8(fmt):
    f = R.get_format(fmt)
    y = (torch.rand(20000, dtype=torch.float64) * 2 - 1) * f.max_value
    y = torch.cat([y, y * 2.0 ** -12, torch.tensor([0.0, -0.0, f.max_value, -f.max_value])])
    y = y.to(torch.float32).to(torch.float64)  # torch converts from fp32 (RNE)
    got = torch.copysign(R.round_to_format(y, f), y)
    want = y.to(torch.float32).to(f.torch_dtype).to(torch.float64)
    assert torch.equal(got, want)


def test_reference_rounding_e2m1_bruteforce():
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    y = torch.cat([torch.rand(5000, dtype=torch.float64) * 7, lut,
                   (lut[1:] + lut[:-1]) / 2, torch.tensor([6.5, 100.0])])
    got = R.round_to_format(y, E2M1)
    d = (y[:, None] - lut[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best  # nearest; a tie picks the even code (mantissa bit 0)
    idx = torch.where(cand.sum(1) > 1, (cand & (torch.arange(8) % 2 == 0)).float().argmax(1),
                      cand.float().argmax(1))
    assert torch.equal(got, lut[idx])


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_scale_rules(fmt):
    f = R.get_format(fmt)
    amax = torch.cat([torch.exp2(torch.rand(2000, dtype=torch.float64) * 200 - 100),
                      f.max_value * torch.exp2(torch.arange(-20, 20, dtype=torch.float64)),
                      torch.exp2(torch.arange(-20, 20, dtype=torch.float64))])
    kf = R.block_scale_exponent(amax, f, "floor")
    assert torch.equal(kf, torch.floor(torch.log2(amax)).long() - f.emax)
    kr = R.block_scale_exponent(amax, f, "rceil").double()
    assert bool((amax <= f.max_value * torch.exp2(kr)).all())
    assert bool((amax > f.max_value * torch.exp2(kr - 1)).all())
    z = R.block_scale_exponent(torch.zeros(3, dtype=torch.float64), f, "rceil")
    assert z.tolist() == [-127] * 3


def test_pack_layout_low_nibble_is_even_column():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
def test_reference_edge_semantics(fmt, rule):
    f = R.get_format(fmt)
    x = edge_input(fmt)
    codes, scale = R.quantize_codes(x, f, rule)
    y = R.dequantize_codes(codes, scale, f)
    sign = 1 << (f.bits - 1)
    assert scale[0].item() == 0 and codes[0].eq(0).all()             # zero block
    assert scale[1].item() == 0 and codes[1].eq(sign).all()          # -0 keeps its sign
    assert torch.signbit(y[1]).all()
    assert scale[2].item() == 0                                      # subnormal amax -> k = -127
    assert codes[10, 0].item() == sign and codes[10, 3].item() == sign and codes[10, 4] == sign
    assert codes[10, 1].item() == 0
    if rule == "floor":                                              # amax = 2^2 -> k = 2 - emax
        assert scale[5].item() == 127 + 2 - f.emax
    assert scale[7].item() == 127                                    # amax = max elem -> k = 0
    if rule == "rceil":
        assert scale[8].item() == 127 + 5 and y[8, 0].item() == x[8, 0].item()
        assert scale[9].item() == 127 + 4                            # one ulp above max * 2^3
    assert y[11, 0].item() == pytest.approx(1e30, rel=0.25)          # outlier survives ...
    assert y[11, 1:].abs().max().item() == 0.0                       # ... the rest flush to zero
    for r in (14, 15, 16):                                           # non-finite blocks
        assert scale[r].item() == 255 and torch.isnan(y[r]).all()
    assert torch.isfinite(y[:14]).all() or rule == "rceil"
    # everything representable: fake quant is idempotent
    fin = torch.isfinite(y).all(1)
    c2, s2 = R.quantize_codes(y[fin], f, rule)
    assert torch.equal(R.dequantize_codes(c2, s2, f), y[fin])


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_error_bound(fmt):
    f = R.get_format(fmt)
    x = random_input((16, 256), torch.float32, 1)
    y = R.fake_quantize(x, f, "rceil")
    amax = x.reshape(-1, 32).abs().amax(1, keepdim=True)
    err = (y - x).reshape(-1, 32).abs()
    # RCEIL never saturates: error <= half a step of the top binade of the block
    step = torch.exp2(torch.ceil(torch.log2(amax / f.max_value)) + f.emax - f.mbits)
    assert bool((err <= step / 2 * (1 + 1e-6)).all())


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_errors(backend):
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mx_quantize(torch.randn(4, 48), "e4m3", backend=backend)
    with pytest.raises(TypeError, match="not supported"):
        mx_quantize(torch.randn(4, 64).half(), "e4m3", backend=backend)
    with pytest.raises(TypeError, match="not supported"):
        mx_fake_quantize(torch.randint(0, 5, (4, 64)), "e2m1", backend=backend)
    with pytest.raises(ValueError, match="unknown MX element format"):
        mx_quantize(torch.randn(4, 64), "e3m2", backend=backend)
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        mx_quantize(torch.randn(4, 64), "e4m3", rule="ceil", backend=backend)
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not match scale shape"):
        mx_dequantize(packed, torch.zeros(4, 3, dtype=torch.uint8), "e2m1", backend=backend)
    with pytest.raises(ValueError, match="does not match scale shape"):
        mx_dequantize(packed, torch.zeros(5, 2, dtype=torch.uint8), "e2m1", backend=backend)
    with pytest.raises(TypeError, match="scale must be uint8"):
        mx_dequantize(packed, torch.zeros(4, 2), "e2m1", backend=backend)
    with pytest.raises(TypeError, match="output dtype"):
        mx_dequantize(packed, torch.zeros(4, 2, dtype=torch.uint8), "e2m1", dtype=torch.float16,
                      backend=backend)
    with pytest.raises(TypeError, match="must be"):
        mx_dequantize(torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.uint8), "e4m3",
                      backend=backend)


# ----------------------------------------------------------------------------------------------
# Triton == reference, bit for bit
# ----------------------------------------------------------------------------------------------

def _check_triton(x_cpu: torch.Tensor, fmt: str, rule: str, backend: str = "triton"):
    f = R.get_format(fmt)
    x = x_cpu.to(DEV if backend == "triton" else "cpu")
    d_ref, s_ref = R.quantize(x_cpu, f, rule)
    d_tr, s_tr = mx_quantize(x, fmt, rule, backend=backend)
    assert d_tr.dtype == d_ref.dtype and d_tr.shape == d_ref.shape
    assert torch.equal(_bits(d_tr).cpu(), _bits(d_ref)), f"{fmt}/{rule}: element codes differ"
    assert torch.equal(s_tr.cpu(), s_ref), f"{fmt}/{rule}: scales differ"
    for dt in DTYPES:
        y_ref = R.dequantize(d_ref, s_ref, f, dt)
        y_tr = mx_dequantize(d_tr, s_tr, fmt, dtype=dt, backend=backend)
        assert _same_values(y_tr.cpu(), y_ref), f"{fmt}/{rule}: dequantize to {dt} differs"
    fq = mx_fake_quantize(x, fmt, rule, backend=backend)
    assert _same_values(fq.cpu(), R.dequantize(d_ref, s_ref, f, x.dtype)), "fake quant differs"


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_torch_backend_bit_exact(fmt, rule):
    """The vectorized torch port (the CPU fast path used by ``backend='auto'``)."""
    for dtype in DTYPES:
        for i, shape in enumerate([(1, 32), (3, 5, 64), (65, 512)]):
            _check_triton(random_input(shape, dtype, seed=200 + i), fmt, rule, backend="torch")
        _check_triton(edge_input(fmt).to(dtype), fmt, rule, backend="torch")
    f = R.get_format(fmt)
    data = torch.randint(0, 256, (128, 32 if f.packed else 64), dtype=torch.uint8)
    scale = torch.arange(256, dtype=torch.uint8).reshape(128, 2)
    if not f.packed:
        data = data.view(f.torch_dtype)
    for dt in DTYPES:
        assert _same_values(mx_dequantize(data, scale, fmt, dtype=dt, backend="torch"),
                            R.dequantize(data, scale, f, dt))
    assert mx_fake_quantize(torch.empty(0, 32), fmt, rule).shape == (0, 32)


@triton_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_random_bit_exact(fmt, rule, dtype):
    for i, shape in enumerate([(1, 32), (4, 96), (3, 5, 64), (33, 256)]):
        _check_triton(random_input(shape, dtype, seed=100 + i), fmt, rule)


@triton_cpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_edge_cases_bit_exact(fmt, rule):
    x = edge_input(fmt)
    # all rows: a program holding a block with k < -109 takes the exact integer paths
    _check_triton(x, fmt, rule)
    _check_triton(x.to(torch.bfloat16), fmt, rule)
    # without the zero / subnormal blocks (rows 0-3): the fast float paths
    _check_triton(x[4:], fmt, rule)
    _check_triton(x[4:].to(torch.bfloat16), fmt, rule)
    # no huge blocks either (rows 12, 13): dequantize takes its fast path too
    fast = x[[r for r in range(4, x.shape[0]) if r not in (12, 13)]]
    _check_triton(fast, fmt, rule)
    _check_triton(fast.to(torch.bfloat16), fmt, rule)
    # ordinary data through the integer paths (one all-zero block in the same program)
    r = random_input((16, 64), torch.float32, 9)
    r[0] = 0.0
    _check_triton(r, fmt, rule)


@triton_cpu
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_dequantize_any_bytes(fmt):
    """Every code and scale byte (Inf/NaN codes and the NaN scale included) decodes alike."""
    f = R.get_format(fmt)
    g = torch.Generator().manual_seed(3)
    cols = 64
    scale = torch.arange(256, dtype=torch.uint8).reshape(128, 2)
    data = torch.randint(0, 256, (128, cols // 2 if f.packed else cols), generator=g,
                         dtype=torch.uint8)
    if not f.packed:
        data[:, :2].copy_(torch.arange(256, dtype=torch.uint8).reshape(128, 2))
        data = data.view(f.torch_dtype)
    # every byte (slow integer path), then scales in [LOW_K, HIGH_K] plus NaN (fast path)
    fast = torch.randint(127 - 109, 128 + 127 - f.emax, (128, 2), generator=g, dtype=torch.uint8)
    fast[::7, 1] = 255
    for s in (scale, fast):
        for dt in DTYPES:
            y_ref = R.dequantize(data, s, f, dt)
            y_tr = mx_dequantize(data.to(DEV), s.to(DEV), fmt, dtype=dt, backend="triton")
            assert _same_values(y_tr.cpu(), y_ref)


@triton_cpu
def test_triton_empty_and_noncontiguous():
    x = torch.empty(0, 64)
    d, s = mx_quantize(x.to(DEV), "e2m1", backend="triton")
    assert d.shape == (0, 32) and s.shape == (0, 2)
    assert mx_fake_quantize(x.to(DEV), "e4m3", backend="triton").shape == (0, 64)
    base = random_input((64, 40), torch.float32, 5)
    xt = base.t()[:, :32]  # non-contiguous [40, 32]
    _check_triton(xt.contiguous(), "e4m3", "floor")
    assert torch.equal(mx_fake_quantize(xt.to(DEV), "e4m3", backend="triton").cpu(),
                       R.fake_quantize(xt, "e4m3", "floor"))
    # contiguous views that start off a pair-word boundary (the kernels read element pairs)
    for dt in DTYPES:
        odd = random_input((1, 128), dt, 6).reshape(-1)[1:97].reshape(3, 32)
        assert odd.is_contiguous() and odd.storage_offset() == 1
        _check_triton(odd, "e4m3", "rceil")
        _check_triton(odd, "e2m1", "floor")
    d, s = mx_quantize(random_input((3, 32), torch.float32, 8), "e5m2", backend="reference")
    d_odd = torch.cat([torch.zeros(1, dtype=torch.uint8), d.view(torch.uint8).reshape(-1)])[1:]
    d_odd = d_odd.reshape(3, 32).view(torch.float8_e5m2)
    assert d_odd.storage_offset() == 1
    assert _same_values(mx_dequantize(d_odd.to(DEV), s.to(DEV), "e5m2", backend="triton").cpu(),
                        R.dequantize(d, s, "e5m2"))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_bit_exact_large(fmt, rule, dtype):
    assert torch.cuda.is_available(), "needs CUDA"
    _check_triton(random_input((512, 4096), dtype, seed=11), fmt, rule)
    _check_triton(random_input((7, 3, 96), dtype, seed=12), fmt, rule)
    _check_triton(edge_input(fmt).to(dtype), fmt, rule)
    _check_triton(edge_input(fmt)[4:].to(dtype), fmt, rule)
    _check_triton(edge_input(fmt)[[4, 5, 6, 7, 8, 9, 10, 11, 14, 15, 16, 17, 18]].to(dtype), fmt,
                  rule)  # dequantize's fast path on edge rows
    if rule == "rceil" and dtype == torch.float32:
        test_triton_dequantize_any_bytes(fmt)


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton():
    x = random_input((64, 128), torch.bfloat16, 13)
    d, s = mx_quantize(x.cuda(), "e2m1", "rceil")  # auto -> Triton on CUDA
    d_ref, s_ref = R.quantize(x, "e2m1", "rceil")
    assert d.is_cuda and torch.equal(d.cpu(), d_ref) and torch.equal(s.cpu(), s_ref)


# ----------------------------------------------------------------------------------------------
# cross-check against torchao's MX emulation (optional: torchao is not a project dependency)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", FMTS)
def test_matches_torchao_emulation(fmt, rule):
    mxt = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor",
                              reason="torchao not installed (optional cross-check)")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    elem = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
            "e2m1": torch.float4_e2m1fn_x2}[fmt]
    mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rule]
    edge = edge_input(fmt)
    # rows where we differ by design (docs/mx_notes.md): fp32-subnormal blocks (torchao divides
    # by a subnormal scale) and +-Inf blocks (OCP: NaN scale; torchao keeps Inf)
    keep = [r for r in range(edge.shape[0]) if r not in (2, 3)]
    for dtype in DTYPES:
        e = edge[keep].to(dtype)
        e = e[~torch.isinf(e.float()).any(1)]  # (bf16 also turns FLT_MAX into Inf)
        for x in (random_input((64, 256), dtype, 21), e):
            scale_ao, data_ao = mxt.to_mx(x, elem, 32, mode)
            theirs = mxt.to_dtype(data_ao, scale_ao, elem, 32, torch.float32).reshape(x.shape)
            d, s = mx_quantize(x, fmt, rule, backend="torch")
            ours = mx_dequantize(d, s, fmt)
            fin = torch.isfinite(x.float().reshape(-1, 32)).all(1).reshape(s.shape)
            sa = scale_ao.view(torch.uint8).reshape(s.shape)
            assert torch.equal(sa[fin], s[fin])  # NaN blocks: both decode to NaN, bytes differ
            assert bool(((ours == theirs) | (ours.isnan() & theirs.isnan())).all())
