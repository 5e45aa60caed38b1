"""GPU kernel time of profiled steps (``k3train.training.kernel_time``): kinds by kernel name, and the
per-step busy time, span and counts from profiler events (fake events here; the GPU runs read real ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3train.training.kernel_time import format_summary, kernel_kind, kernel_summary


def test_profile_kernel_kinds():
    """The grouping (``benchmarks/train_step.py --profile``, ``train.profile_steps``): our Triton kernels by name, inductor's fused kernels apart from them, the rest by
    library (names as the H200 profiler reports them)."""
    kinds = {"_attn_res_bwd_rows_kernel": "attn_res", "_situ_fwd_kernel": "situ", "_ce_grad_kernel": "cross-entropy",
             "_rms_norm_bwd_kernel": "rms_norm", "_short_conv_fwd_kernel": "short conv",
             "_combine_bwd_kernel": "moe glue", "_histogram_kernel": "moe glue", "kda_bwd_kernel": "kda",
             "triton_poi_fused__to_copy_add_attn_res_backward_view_4": "inductor fused",
             "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm", "_grouped_wgrad_kernel": "gemm",
             "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3": "gemm",
             "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
             # the trainer's packed documents (H200, 2026-12-02): these were counted as GEMMs once
             "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<192, 64, 64, "
             "8, 4, 2, 2, false, false, cutlass::bfloat16_t>>": "attention",
             "_ns_gemm_kernel": "optimizer", "_max_logit_kernel": "qk-clip max logit",
             # CUTLASS's grouped GEMM, mangled: "_NS_" in it is not Newton–Schulz
             "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalI"
             "NS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS_6half_tEEEEvNT_": "gemm",
             "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": "elementwise/other"}
    assert {name: kernel_kind(name) for name in kinds} == kinds


def _event(name, start_us, end_us, device=torch.autograd.DeviceType.CUDA, annotation=False):
    span = SimpleNamespace(start=start_us, end=end_us, elapsed_us=lambda: end_us - start_us)
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation, time_range=span)


def test_summary_per_step_busy_span_and_kinds():
    """Two steps: busy sums the kernels (not the host ops, not the ranges mirrored on the GPU), span runs
    from the first kernel's start to the last one's end, all per step."""
    events = [_event("_situ_fwd_kernel", 0, 100), _event("nvjet_sm90_gemm", 150, 450),
              _event("_situ_fwd_kernel", 1000, 1100), _event("nvjet_sm90_gemm", 1300, 1600),
              _event("aten::mm", 140, 460, device=torch.autograd.DeviceType.CPU),
              _event("fwd_bwd", 0, 1600, annotation=True)]
    s = kernel_summary(events, steps=2)
    assert s["gpu_busy_ms"] == pytest.approx(0.4) and s["gpu_span_ms"] == pytest.approx(0.8)
    assert s["kernels_per_step"] == 2
    assert s["by_kind_ms"] == pytest.approx({"gemm": 0.3, "situ": 0.1})
    assert list(s["by_kind_ms"]) == ["gemm", "situ"]  # largest first
    assert s["kernels_ms_launches"]["nvjet_sm90_gemm"] == pytest.approx([0.3, 1.0])
    assert "GPU busy 0.4 ms a step of a 0.8 ms span (50%)" in format_summary(s)


def test_summary_without_kernels():
    s = kernel_summary([_event("aten::mm", 0, 5, device=torch.autograd.DeviceType.CPU)], steps=1)
    assert s["gpu_busy_ms"] == 0.0 and s["kernels_per_step"] == 0
