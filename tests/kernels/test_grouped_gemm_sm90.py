"""kernels.grouped_gemm_sm90: every CUTLASS configuration against ``torch._grouped_mm`` (forward and dgrad
layouts, grouped and expert-tiled), against ``kernels.grouped_wgrad``'s aten reference (wgrad) on uneven and
empty groups, and the plain batched kernels against ``torch.bmm`` (GPU, with the library built); on CPU what
can be checked without one: B layouts, argument errors, the expert-tiled layout and its reference, and that the
module's configuration list is the library source's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernels import grouped_gemm_sm90 as gg


def test_config_list_matches_the_library_source():
    source = (Path(gg.__file__).with_name("grouped_gemm.cu")).read_text()
    rows = re.findall(r"^\s*X\((\d+), (true|false), (\d+), (\d+), (\d+), (\d+)\)", source, re.M)
    assert [int(r[0]) for r in rows] == list(range(len(gg.CONFIGS)))
    assert [gg.Config(r[1] == "true", (int(r[2]), int(r[3]), int(r[4])), int(r[5])) for r in rows] == list(gg.CONFIGS)


def test_b_layouts_and_errors():
    w = torch.empty(4, 64, 32)  # [G, N, K] weight
    assert gg.b_layout(w.transpose(1, 2)) == "k-major"  # as the forward passes it: [G, K, N] view
    assert gg.b_layout(torch.empty(4, 32, 64)) == "n-major"
    with pytest.raises(ValueError, match="packed"):
        gg.b_layout(torch.empty(4, 32, 128)[..., :64])
    with pytest.raises(ValueError, match=r"\[G, K, N\]"):
        gg.b_layout(torch.empty(32, 64))
    with pytest.raises(ValueError, match="bf16"):
        gg.grouped_mm(torch.empty(8, 32), w.transpose(1, 2), torch.tensor([2, 4, 6, 8], dtype=torch.int32))


def _uneven_counts(seed: int, groups: int = 16) -> torch.Tensor:
    """0-700 rows a group, two groups empty, one of 333 rows (no tile's multiple)."""
    counts = torch.randint(0, 700, (groups,), generator=torch.Generator().manual_seed(seed))
    counts[[3, groups // 2 + 1]] = 0
    counts[5] = 333
    return counts


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("config", range(len(gg.CONFIGS)))
@pytest.mark.parametrize("layout", ["k-major", "n-major"])
def test_matches_torch_grouped_mm(config, layout):
    """Random bf16 operands, 16 groups of 0-700 rows (two empty, one not a multiple of any tile); the products
    of the experts' forward (k-major) and dgrad (n-major) shapes. Same fp32 accumulation, so the results agree
    to bf16 rounding."""
    g = torch.Generator().manual_seed(config)
    counts = _uneven_counts(config)
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    M, K, N = int(counts.sum()), 512, 256
    a = torch.randn(M, K, generator=g).cuda().bfloat16()
    w = torch.randn(16, N, K, generator=g).cuda().bfloat16()
    b = w.transpose(1, 2) if layout == "k-major" else torch.randn(16, K, N, generator=g).cuda().bfloat16()
    want = torch._grouped_mm(a, b, offs=offsets)
    got = gg.grouped_mm(a, b, offsets, config)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    empty = got.new_zeros(0, N)  # an empty group writes nothing and reads nothing
    assert torch.equal(gg.grouped_mm(a[:0], b, torch.zeros(16, dtype=torch.int32, device="cuda"), config), empty)


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("config", range(len(gg.CONFIGS)))
def test_wgrad_matches_aten(config):
    """dW[e] = g_eᵀ x_e with ragged K: 16 groups of 0-700 rows (two empty: their dW must be exactly 0, which the
    GEMM's mainloop alone would leave unset), the W13 shapes (O = 512, C = 256)."""
    from kernels.grouped_wgrad import reference

    gen = torch.Generator().manual_seed(10 + config)
    counts = torch.randint(0, 700, (16,), generator=gen)
    counts[[0, 9]] = 0
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    M = int(counts.sum())
    g = torch.randn(M, 512, generator=gen).cuda().bfloat16()
    x = torch.randn(M, 256, generator=gen).cuda().bfloat16()
    want = reference.grouped_wgrad_aten(g, x, offsets)
    got = gg.grouped_wgrad(g, x, offsets, config)
    assert got.shape == want.shape == (16, 512, 256)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(got[9], torch.zeros_like(got[9]))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("config", range(len(gg.CONFIGS)))
@pytest.mark.parametrize("skewed", [False, True])
def test_wgrad_pair_matches_single_launches(config, skewed):
    """The W13 and W2 weight gradients in one launch (groups placed by row count) against the aten reference and,
    bit for bit, against one launch each (a tile's accumulation does not depend on which CTA runs it or when):
    32 experts, four empty, near-even or skewed counts (uniform draws to the 8th power), with ties. The outputs may
    reuse a freed block of NaN, so an empty expert's zeros must be written, not found."""
    from kernels.grouped_wgrad import reference

    gen = torch.Generator().manual_seed(30 + config)
    E = 32
    weights = torch.rand(E, generator=gen) ** (8 if skewed else 1)
    counts = (weights / weights.sum() * 6000).round().long()
    counts[[1, 7, 8, 30]] = 0
    counts[[2, 3]] = int(counts[4])  # ties in the by-size order
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    M = int(counts.sum())
    g1, x1 = (torch.randn(M, n, generator=gen).cuda().bfloat16() for n in (512, 384))
    g2, x2 = (torch.randn(M, n, generator=gen).cuda().bfloat16() for n in (384, 256))
    torch.full((4 * E * 512 * 384,), float("nan"), device="cuda")  # freed at once: the outputs may reuse it
    dw1, dw2 = gg.grouped_wgrad_pair(g1, x1, g2, x2, offsets, config)
    assert dw1.shape == (E, 512, 384) and dw2.shape == (E, 384, 256)
    for got, (g, x) in ((dw1, (g1, x1)), (dw2, (g2, x2))):
        want = reference.grouped_wgrad_aten(g, x, offsets)
        assert bool((got[counts.cuda() == 0] == 0).all())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        assert torch.equal(got, gg.grouped_wgrad(g, x, offsets, config))


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("skewed", [False, True])
def test_expert_tiled_wgrad_matches_aten(skewed):
    """The expert-tiled weight gradients (each expert's K range given by the scheduler) on rows padded per expert to
    64, one and two products, against the aten reference: 32 experts, four empty, near-even or skewed counts with
    ties; padding rows hold random values the reference reads too (the kernel reads whole padded groups). The outputs
    may reuse a freed block of NaN, so an empty expert's zeros must be written."""
    from kernels.grouped_wgrad import reference

    gen = torch.Generator().manual_seed(40 + skewed)
    E, tile = 32, gg.EXPERT_WGRAD_ROW_TILE
    weights = torch.rand(E, generator=gen) ** (8 if skewed else 1)
    counts = (weights / weights.sum() * 6000).round().long()
    counts[[1, 7, 8, 30]] = 0
    counts[[2, 3]] = int(counts[4])
    padded = (counts + tile - 1) // tile * tile
    offsets = padded.cumsum(0).to(torch.int32).cuda()
    M = int(padded.sum())
    g1, x1 = (torch.randn(M, n, generator=gen).cuda().bfloat16() for n in (512, 512))
    g2, x2 = (torch.randn(M, n, generator=gen).cuda().bfloat16() for n in (512, 256))
    torch.full((4 * E * 512 * 512,), float("nan"), device="cuda")  # freed at once: the outputs may reuse it
    pair = gg.expert_tiled_wgrad([(g1, x1), (g2, x2)], offsets)
    single = gg.expert_tiled_wgrad([(g2, x2)], offsets)[0]
    for got, (g, x) in ((pair[0], (g1, x1)), (pair[1], (g2, x2)), (single, (g2, x2))):
        want = reference.grouped_wgrad_aten(g, x, offsets)
        assert bool((got[counts.cuda() == 0] == 0).all())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert torch.equal(single, pair[1])
    with pytest.raises(ValueError, match="multiple of 64"):
        gg.expert_tiled_wgrad([(g1[:-1], x1[:-1])], offsets)


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("config", range(len(gg.CONFIGS)))
def test_batched_matches_bmm(config):
    """The plain batched kernels: random bf16 [L, M, K] × k-major [L, K, N], M not a multiple of any tile."""
    gen = torch.Generator().manual_seed(20 + config)
    a = torch.randn(6, 333, 512, generator=gen).cuda().bfloat16()
    b = torch.randn(6, 256, 512, generator=gen).cuda().bfloat16().transpose(1, 2)
    want = torch.bmm(a, b)
    torch.testing.assert_close(gg.batched_mm(a, b, config).float(), want.float(), rtol=2e-2,
                               atol=2e-2 * float(want.abs().max()))
    with pytest.raises(ValueError, match="transposed view"):
        gg.batched_mm(a, b.contiguous(), config)


def test_expert_tiles_layout():
    """Each group's rows start on a tile, keep their order, and fill its tiles; tile_expert names each tile's
    group and -1 after the last; the capacity bound holds for the worst split."""
    counts = _uneven_counts(0)
    offsets = counts.cumsum(0).to(torch.int32)
    M, tile = int(counts.sum()), 128
    cap = gg.capacity_tiles(M, 16, tile)
    row_dest, tile_expert = gg.expert_tiles(offsets, M, tile, cap)
    start, first_tile = 0, 0
    for g, c in enumerate(counts.tolist()):
        assert row_dest[start:start + c].tolist() == list(range(first_tile * tile, first_tile * tile + c))
        n_tiles = -(-c // tile)
        assert tile_expert[first_tile:first_tile + n_tiles].tolist() == [g] * n_tiles
        start, first_tile = start + c, first_tile + n_tiles
    assert (tile_expert[first_tile:] == -1).all() and first_tile <= cap
    worst = torch.tensor([1] * 15 + [M - 15])  # fifteen groups of one row: the most padding
    assert int(((worst + tile - 1) // tile).sum()) <= gg.capacity_tiles(M, 16, tile)


def test_expert_tiled_reference_matches_grouped_product():
    """Padding the rows, multiplying tile by tile and reading the rows back gives each group's product."""
    counts = _uneven_counts(1, groups=6)
    offsets = counts.cumsum(0).to(torch.int32)
    M, K, N, tile = int(counts.sum()), 32, 24, 64
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(M, K, generator=gen), torch.randn(6, K, N, generator=gen)
    cap = gg.capacity_tiles(M, 6, tile)
    row_dest, tile_expert = gg.expert_tiles(offsets, M, tile, cap)
    padded = a.new_zeros(cap * tile, K).index_copy_(0, row_dest, a)
    got = gg.expert_tiled_mm_reference(padded, b, tile_expert, tile)[row_dest]
    want = torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip([0] + offsets[:-1].tolist(), offsets.tolist()))])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="one-CTA-cluster"):
        gg.expert_tiled_mm(padded.bfloat16(), b.bfloat16(), tile_expert, config=3)


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("config", [i for i, c in enumerate(gg.CONFIGS) if c.cluster_m == 1])
@pytest.mark.parametrize("layout", ["k-major", "n-major"])
def test_expert_tiled_matches_torch_grouped_mm(config, layout):
    """The expert-tiled kernel on padded rows, read back, against ``torch._grouped_mm`` on the packed rows:
    random bf16 operands, the uneven groups above, both B layouts."""
    counts = _uneven_counts(30 + config)
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    M, K, N = int(counts.sum()), 512, 256
    gen = torch.Generator().manual_seed(config)
    a = torch.randn(M, K, generator=gen).cuda().bfloat16()
    w = torch.randn(16, N, K, generator=gen).cuda().bfloat16()
    b = w.transpose(1, 2) if layout == "k-major" else torch.randn(16, K, N, generator=gen).cuda().bfloat16()
    tile = gg.CONFIGS[config].tile[0]
    cap = gg.capacity_tiles(M, 16, tile)
    row_dest, tile_expert = gg.expert_tiles(offsets, M, tile, cap)
    padded = a.new_zeros(cap * tile, K).index_copy_(0, row_dest, a)
    got = gg.expert_tiled_mm(padded, b, tile_expert, config)[row_dest]
    want = torch._grouped_mm(a, b, offs=offsets)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def _situ_case(seed: int, width: int, scaled: bool, device: str, groups: int = 16, K: int = 512):
    """Padded rows of uneven groups (zero padding rows), interleaved W13, W2, dy and row scales (0 on padding
    rows, as the dispatcher gives) for the SiTU products; bf16 operands on ``device``; and the rows in use."""
    counts = _uneven_counts(seed, groups=groups)
    offsets = counts.cumsum(0).to(torch.int32)
    M = int(counts.sum())
    gen = torch.Generator().manual_seed(seed)
    cap = gg.capacity_tiles(M, groups, 64)
    row_dest, tile_expert = gg.expert_tiles(offsets, M, 64, cap)
    x = torch.zeros(cap * 64, K).index_copy_(0, row_dest, torch.randn(M, K, generator=gen))
    s = torch.zeros(cap * 64).index_copy_(0, row_dest, torch.rand(M, generator=gen)) if scaled else None
    w13 = torch.randn(groups, 2 * width, K, generator=gen) * 0.08  # pre-activations of a few units: SiTU's curved part
    w2 = torch.randn(groups, K, width, generator=gen) * 0.05
    dy = torch.randn(cap * 64, K, generator=gen)
    bf = lambda t: None if t is None else t.to(device, torch.bfloat16)  # noqa: E731
    return (bf(x), bf(w13), bf(w2), tile_expert.to(device), bf(dy), None if s is None else s.to(device)), row_dest.to(device)


def test_situ_reference_backward_is_the_forward_gradient():
    """The SiTU products' reference: d_pre and ds equal autograd's gradient of Σ dh·h through the reference forward
    (in fp32, at pre-activations that are already bf16 values), so the kernels are checked against a reference
    that is itself consistent."""
    (x, w13, w2, tile_expert, dy, s), rows = _situ_case(3, 24, True, "cpu", groups=6, K=32)
    x, w13, w2, dy = (t.float() for t in (x, w13, w2, dy))
    w13 = w13.bfloat16().float()
    ref = gg.expert_tiled_situ_reference(x, w13, w2, tile_expert, dy, s)
    pre = ref["pre"].bfloat16().float().requires_grad_()
    scale = s.clone().requires_grad_()
    from kernels.situ.reference import situ_forward
    h = situ_forward(pre[:, 0::2], pre[:, 1::2], row_scale=scale)
    dh = gg.expert_tiled_mm_reference(dy, w2, tile_expert, 64)
    d_pre, ds = torch.autograd.grad((h * dh).sum(), (pre, scale))
    torch.testing.assert_close(ref["d_pre"][rows], d_pre[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref["ds"][rows], ds[rows], rtol=1e-5, atol=1e-5)
    assert d_pre[rows].abs().max() > 0 and ds[rows].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not gg.available(), reason="needs an sm_90 GPU and the built library (kernels.grouped_gemm_sm90.build)")
@pytest.mark.parametrize("width", [256, 512])
@pytest.mark.parametrize("scaled", [True, False])
def test_situ_products_match_reference(width, scaled):
    """W13 + SiTU and W2 dgrad + SiTU's backward in the expert-tiled epilogues, on the rows in use: pre equals the
    plain expert-tiled product bit for bit; h, d_pre and ds match the fp32 reference (at I = 512 the W2 dgrad has
    two N tiles, so ds is summed over tiles)."""
    (x, w13, w2, tile_expert, dy, s), rows = _situ_case(40 + width, width, scaled, "cuda")
    pre, h = gg.expert_tiled_situ_forward(x, w13, tile_expert, s)
    d_pre, ds = gg.expert_tiled_situ_backward(dy, w2, pre, tile_expert, s)
    ref = gg.expert_tiled_situ_reference(x, w13, w2, tile_expert, dy, s)
    plain = gg.expert_tiled_mm(x, w13.transpose(1, 2), tile_expert, gg.SITU_CONFIG)
    assert torch.equal(pre[rows], plain[rows])
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    # bf16 outputs (2^-9 relative rounding) from tanh.approx (2^-11): about 2e-3 in Frobenius norm
    assert rel(h[rows], ref["h"][rows]) < 4e-3, rel(h[rows], ref["h"][rows])
    assert rel(d_pre[rows], ref["d_pre"][rows]) < 4e-3, rel(d_pre[rows], ref["d_pre"][rows])
    assert (h[rows].float() - ref["h"][rows]).abs().max() < 2e-2 * float(ref["h"][rows].abs().max())
    if scaled:
        assert rel(ds[rows], ref["ds"][rows]) < 2e-3, rel(ds[rows], ref["ds"][rows])
    else:
        assert ds is None
    with pytest.raises(ValueError, match="multiple of 8"):
        gg.expert_tiled_situ_forward(x, w13[:, :20].contiguous(), tile_expert, s)


def test_routed_experts_grouped_gemm_names():
    """RoutedExperts.grouped_gemm: torch by default, CUTLASS configurations by index (forward and dgrad, then
    optionally the wgrad), expert-tiled ones with their row tile; a bad name fails in the forward, naming the
    forms."""
    from k3train.model.moe import GroupedGemm, grouped_gemm_configs, grouped_linear

    assert grouped_gemm_configs("torch") == GroupedGemm() and GroupedGemm().row_tile == 1
    assert grouped_gemm_configs("cutlass:2") == GroupedGemm(2, None)
    assert grouped_gemm_configs("cutlass:1:4") == GroupedGemm(1, 4)
    assert grouped_gemm_configs("tiles:1:3") == GroupedGemm(1, 3, tiled=True)
    assert grouped_gemm_configs("tiles:1").row_tile == gg.CONFIGS[1].tile[0] == 64
    assert grouped_gemm_configs("fused:1:3") == GroupedGemm(1, 3, tiled=True, situ_epilogue=True)
    assert grouped_gemm_configs("fused:1").row_tile == 64
    assert grouped_gemm_configs("fused:1:w") == GroupedGemm(1, None, tiled=True, situ_epilogue=True, tiled_wgrad=True)
    assert grouped_gemm_configs("tiles:1:w") == GroupedGemm(1, None, tiled=True, tiled_wgrad=True)
    for bad in ("cutlass", f"cutlass:{len(gg.CONFIGS)}", "cutlass:a", "cuda", "cutlass:1:2:3", "tiles:3", "fused:0",
                "cutlass:1:w", "fused:w"):
        with pytest.raises(ValueError, match="cutlass:<i>\\[:<j>\\]"):
            grouped_gemm_configs(bad)
    with pytest.raises(ValueError, match="grouped GEMM 'cutlass:9'"):
        grouped_linear(torch.randn(4, 8), torch.randn(2, 6, 8), torch.tensor([2, 4], dtype=torch.int32), "cutlass:9")


def test_expert_gemm_start_up_line(monkeypatch, tmp_path):
    """The trainer's line on the routed experts' GEMMs: a CUTLASS form's padded layout and where SiTU runs; for
    torch, on a Hopper GPU without expert parallelism only, the faster form and whether its library is built."""
    from k3train.model import moe

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    line = moe.expert_gemm_line("fused:1:w", cuda, False, 1)
    assert line.endswith("a multiple of 64; SiTU in the products' epilogues")
    assert "SiTU in a pass of its own" in moe.expert_gemm_line("fused:1", cpu, False, 1)
    assert moe.expert_gemm_line("tiles:1", cuda, True, 1).endswith("a multiple of 64")
    assert moe.expert_gemm_line("torch", cpu, False, 1) is None
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    library = tmp_path / "libk3gg.so"
    monkeypatch.setenv("K3_GROUPED_GEMM_LIB", str(library))
    hint = moe.expert_gemm_line("torch", cuda, False, 1)
    assert "precision.expert_gemm=fused:1:w is faster" in hint and "build its library first" in hint
    library.write_bytes(b"")
    assert moe.expert_gemm_line("torch", cuda, False, 1).endswith(f"its library is at {library}")
    assert moe.expert_gemm_line("torch", cuda, False, 2) is None  # the CUTLASS forms run without expert parallelism
    capability["value"] = (8, 0)
    assert moe.expert_gemm_line("torch", cuda, False, 1) is None
