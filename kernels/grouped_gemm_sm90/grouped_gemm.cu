// Grouped bf16 GEMM for Hopper (sm_90a) on CUTLASS 3's pointer-array kernels, with the schedule chosen by the
// caller (torch 2.11's torch._grouped_mm fixes it: cooperative 128x256x64 unless groups are tiny).
//
//   D[rows of e] = A[rows of e] @ B_e      A [M, K] row-major, D [M, N] row-major, rows of group e are
//                                          offsets[e-1]:offsets[e] (offsets [G] int32, cumulative, on the GPU)
//   B_e = B + e * b_group_stride, [K, N]: "k-major" (element (k, n) at n*K + k: a [N, K] row-major weight)
//                                         or "n-major" (element (k, n) at k*N + n: a [K, N] row-major weight)
//
// Built as a plain shared library (kernels/grouped_gemm_sm90/build.py) and called through ctypes on the
// caller's stream: one small kernel writes the per-group pointers, strides and shapes into a caller-owned
// buffer from the device offsets (no host read), then the CUTLASS kernel runs. Nothing allocates or
// synchronises, so the call can be captured in a CUDA graph.

#include <cstdint>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace {

using Bf16 = cutlass::bfloat16_t;
using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group

// One kernel configuration: schedule, CTA tile (M, N, K) and cluster rows.
template <bool PingPong, int TileM, int TileN, int TileK, int ClusterM, bool BKMajor>
struct GroupedGemm {
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
  using MainloopSchedule = cute::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  // CUTLASS's B is [N, K]: ColumnMajor = K contiguous ("k-major"), RowMajor = N contiguous.
  using LayoutB = cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlign = 16 / sizeof(Bf16);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      Bf16, cutlass::layout::RowMajor*, kAlign,  // C (read only when beta != 0; it is 0 here)
      Bf16, cutlass::layout::RowMajor*, kAlign,  // D
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Bf16, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Bf16, cutlass::layout::RowMajor*, kAlign,
      Bf16, LayoutB*, kAlign,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename Problem::UnderlyingProblemShape;

  // The per-group arrays, laid out one after another in the caller's buffer, each starting on 16 bytes (the
  // TMA descriptors CUTLASS builds from the pointer arrays want that alignment).
  struct Arrays {
    const Bf16** a;
    const Bf16** b;
    Bf16** d;
    StrideA* sa;
    StrideB* sb;
    StrideD* sd;
    Shape* shape;
  };

  static constexpr size_t up16(size_t n) { return (n + 15) / 16 * 16; }

  static size_t array_bytes(int groups) {
    return 3 * up16(groups * sizeof(void*)) + up16(groups * sizeof(StrideA)) + up16(groups * sizeof(StrideB)) +
           up16(groups * sizeof(StrideD)) + up16(groups * sizeof(Shape));
  }

  static Arrays carve(void* buf, int groups) {
    char* p = static_cast<char*>(buf);
    auto take = [&](size_t bytes) {
      char* here = p;
      p += up16(bytes);
      return here;
    };
    Arrays r;
    r.a = reinterpret_cast<const Bf16**>(take(groups * sizeof(void*)));
    r.b = reinterpret_cast<const Bf16**>(take(groups * sizeof(void*)));
    r.d = reinterpret_cast<Bf16**>(take(groups * sizeof(void*)));
    r.sa = reinterpret_cast<StrideA*>(take(groups * sizeof(StrideA)));
    r.sb = reinterpret_cast<StrideB*>(take(groups * sizeof(StrideB)));
    r.sd = reinterpret_cast<StrideD*>(take(groups * sizeof(StrideD)));
    r.shape = reinterpret_cast<Shape*>(take(groups * sizeof(Shape)));
    return r;
  }

  static typename Gemm::Arguments arguments(Arrays r, int groups, int sm_count) {
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, r.shape, nullptr},
        {r.a, r.sa, r.b, r.sb},
        {{}, const_cast<const Bf16**>(r.d), r.sd, r.d, r.sd}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info.sm_count = sm_count;
    return args;
  }
};

// Group e's pointers, strides and (rows, N, K) from the cumulative row counts; one thread a group.
template <class G>
__global__ void describe_groups(typename G::Arrays r, const int* offsets, int groups, int N, int K, const Bf16* a,
                                const Bf16* b, int64_t b_group_stride, Bf16* d, typename G::StrideA sa,
                                typename G::StrideB sb, typename G::StrideD sd) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  int start = e == 0 ? 0 : offsets[e - 1];
  int rows = offsets[e] - start;
  r.a[e] = a + static_cast<int64_t>(start) * K;
  r.b[e] = b + e * b_group_stride;
  r.d[e] = d + static_cast<int64_t>(start) * N;
  r.sa[e] = sa;
  r.sb[e] = sb;
  r.sd[e] = sd;
  r.shape[e] = typename G::Shape(rows, N, K);
}

template <class G>
size_t workspace_bytes(int groups, int sm_count) {
  typename G::Arrays none{};
  return G::Gemm::get_workspace_size(G::arguments(none, groups, sm_count));
}

template <class G>
int run(const void* a, const void* b, void* d, const int* offsets, int groups, int N, int K, int64_t b_group_stride,
        void* arrays, void* workspace, size_t workspace_size, int sm_count, cudaStream_t stream) {
  auto r = G::carve(arrays, groups);
  // Every group's matrices are packed: A rows of K, D rows of N, B_e of [N, K] or [K, N].
  auto sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(1, K, 1));
  auto sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(N, K, 1));
  auto sd = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(1, N, 1));
  describe_groups<G><<<(groups + 127) / 128, 128, 0, stream>>>(
      r, offsets, groups, N, K, static_cast<const Bf16*>(a), static_cast<const Bf16*>(b), b_group_stride,
      static_cast<Bf16*>(d), sa, sb, sd);
  if (cudaGetLastError() != cudaSuccess) return 1;
  auto args = G::arguments(r, groups, sm_count);
  if (G::Gemm::get_workspace_size(args) > workspace_size) return 2;
  typename G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 4;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

// The configurations this library holds, by index (grouped_gemm_sm90.CONFIGS lists the same, in order).
#define K3_CONFIGS(X)                  \
  X(0, true, 128, 128, 64, 1)          \
  X(1, true, 64, 256, 64, 1)           \
  X(2, true, 64, 128, 128, 2)          \
  X(3, false, 128, 256, 64, 2)         \
  X(4, false, 128, 128, 64, 1)

}  // namespace

extern "C" {

int k3gg_num_configs() {
#define K3_COUNT(i, ...) +1
  return 0 K3_CONFIGS(K3_COUNT);
#undef K3_COUNT
}

// Bytes of the per-group array buffer the caller provides.
size_t k3gg_array_bytes(int config, int b_k_major, int groups) {
#define K3_ARRAY_BYTES(i, pp, tm, tn, tk, cm)                                              \
  if (config == i)                                                                        \
    return b_k_major ? GroupedGemm<pp, tm, tn, tk, cm, true>::array_bytes(groups)          \
                     : GroupedGemm<pp, tm, tn, tk, cm, false>::array_bytes(groups);
  K3_CONFIGS(K3_ARRAY_BYTES)
#undef K3_ARRAY_BYTES
  return 0;
}

// Bytes of CUTLASS's workspace for this configuration.
size_t k3gg_workspace_bytes(int config, int b_k_major, int groups, int sm_count) {
#define K3_WS_BYTES(i, pp, tm, tn, tk, cm)                                                        \
  if (config == i)                                                                               \
    return b_k_major ? workspace_bytes<GroupedGemm<pp, tm, tn, tk, cm, true>>(groups, sm_count)    \
                     : workspace_bytes<GroupedGemm<pp, tm, tn, tk, cm, false>>(groups, sm_count);
  K3_CONFIGS(K3_WS_BYTES)
#undef K3_WS_BYTES
  return 0;
}

// 0 on success; 1-6: which step failed (describe_groups launch, workspace size, can_implement, initialize,
// run, launch error); -1: unknown configuration.
int k3gg_run(int config, int b_k_major, const void* a, const void* b, void* d, const int* offsets, int groups, int N,
             int K, int64_t b_group_stride, void* arrays, void* workspace, size_t workspace_size, int sm_count,
             void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
#define K3_RUN(i, pp, tm, tn, tk, cm)                                                                          \
  if (config == i)                                                                                            \
    return b_k_major ? run<GroupedGemm<pp, tm, tn, tk, cm, true>>(a, b, d, offsets, groups, N, K, b_group_stride, \
                                                                  arrays, workspace, workspace_size, sm_count, s) \
                     : run<GroupedGemm<pp, tm, tn, tk, cm, false>>(a, b, d, offsets, groups, N, K,               \
                                                                   b_group_stride, arrays, workspace,            \
                                                                   workspace_size, sm_count, s);
  K3_CONFIGS(K3_RUN)
#undef K3_RUN
  return -1;
}

}  // extern "C"
