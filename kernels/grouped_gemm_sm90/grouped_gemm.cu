// Grouped bf16 GEMM for Hopper (sm_90a) on CUTLASS 3's pointer-array kernels, with the schedule chosen by the
// caller (torch 2.11's torch._grouped_mm fixes it: cooperative 128x256x64 unless groups are tiny).
//
// Rows of group e are offsets[e-1]:offsets[e] (offsets [G] int32, cumulative, on the GPU). Three modes:
//   0 forward  D[rows of e] = A[rows of e] @ B_e   A [M, K], D [M, N] row-major; B_e = B + e*b_group_stride,
//                                                  k-major: element (k, n) at n*K + k (a [N, K] weight)
//   1 dgrad    the same with B_e n-major: element (k, n) at k*N + n (a [K, N] weight)
//   2 wgrad    D_e = A[rows of e]^T @ B[rows of e]  A [M, O], B [M, N] row-major, D [G, O, N]: K = the group's
//                                                  rows (ragged; a group without rows gets D_e = 0). One or two
//                                                  such products over the same rows run in one launch, their
//                                                  groups ordered by row count (describe_wgrad)
//
// The expert-tiled products (rows padded per group to the tile, ExpertTileScheduler below) also come with SiTU-GLU in
// the epilogues of configuration 1's W13 forward and W2 dgrad (situ_epilogue.cuh).
//
// Built as a plain shared library (kernels/grouped_gemm_sm90/build.py) and called through ctypes on the
// caller's stream: one small kernel writes the per-group pointers, strides and shapes into a caller-owned
// buffer from the device offsets (no host read), then the CUTLASS kernel runs. Nothing allocates or
// synchronises, so the call can be captured in a CUDA graph.

#include <algorithm>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace {

using Bf16 = cutlass::bfloat16_t;
using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group

// One kernel configuration (schedule, CTA tile (M, N, K), cluster rows) in one mode (0, 1, 2 above).
template <bool PingPong, int TileM, int TileN, int TileK, int ClusterM, int Mode>
struct GroupedGemm {
  static constexpr int kMode = Mode;
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
  using MainloopSchedule = cute::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  // CUTLASS's A is [M, K]: RowMajor = K contiguous, ColumnMajor = M contiguous (wgrad's A^T);
  // its B is [N, K]: ColumnMajor = K contiguous ("k-major", forward), RowMajor = N contiguous.
  using LayoutA = cute::conditional_t<Mode == 2, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutB = cute::conditional_t<Mode == 0, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlign = 16 / sizeof(Bf16);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      Bf16, cutlass::layout::RowMajor*, kAlign,  // C (read only when beta != 0; it is 0 here)
      Bf16, cutlass::layout::RowMajor*, kAlign,  // D
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Bf16, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Bf16, LayoutA*, kAlign,
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

// Group e's pointers, strides and (M, N, K) from the cumulative row counts; one thread a group (modes 0 and 1:
// the group's rows are its M).
template <class G>
__global__ void describe_groups(typename G::Arrays r, const int* offsets, int groups, int N, int K, const Bf16* a,
                                const Bf16* b, int64_t b_group_stride, Bf16* d, typename G::StrideA sa,
                                typename G::StrideB sb, typename G::StrideD sd) {
  static_assert(G::kMode != 2, "the weight gradients are described by describe_wgrad");
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  int start = e == 0 ? 0 : offsets[e - 1];
  int rows = offsets[e] - start;
  r.a[e] = a + static_cast<int64_t>(start) * K;
  r.b[e] = b + e * b_group_stride;
  r.d[e] = d + static_cast<int64_t>(start) * N;
  r.shape[e] = typename G::Shape(rows, N, K);
  r.sa[e] = sa;
  r.sb[e] = sb;
  r.sd[e] = sd;
}

// Up to two weight gradients over the same row groups (mode 2): product p is D_p[e] = G_p[rows of e]^T X_p[rows of e],
// G_p [M, O_p], X_p [M, C_p], D_p [E, O_p, C_p], all packed.
template <class G>
struct WgradProducts {
  static constexpr int kMax = 2;
  const Bf16* g[kMax];
  const Bf16* x[kMax];
  Bf16* d[kMax];
  int O[kMax];
  int C[kMax];
  typename G::StrideA sa[kMax];
  typename G::StrideB sb[kMax];
  typename G::StrideD sd[kMax];
};

// Block (e, p) describes product p's group of expert e. The groups are placed by the experts' row counts, largest
// first (ties by index), products innermost: group rank(e) * P + p. CUTLASS's persistent scheduler hands CTA c the
// tiles c, c + grid, ... in group order, so the longest K loops start first and the short ones fill the tail (what
// an expert order would leave to one CTA under skewed routing). An expert without rows gets no tiles (M = 0, so no
// TMA descriptor of a zero extent is used) and this block zeroes its D_p[e] instead (the mainloop never runs there).
// Expert e's place when the experts are ordered by row count, largest first (ties by index): the count of experts
// before it, by the whole block (the result in every thread).
__device__ int rank_by_rows(const int* offsets, int experts, int e, int rows) {
  __shared__ int ahead;
  if (threadIdx.x == 0) ahead = 0;
  __syncthreads();
  int mine = 0;
  for (int j = threadIdx.x; j < experts; j += blockDim.x) {
    int n = offsets[j] - (j == 0 ? 0 : offsets[j - 1]);
    mine += n > rows || (n == rows && j < e);
  }
  if (mine) atomicAdd(&ahead, mine);
  __syncthreads();
  return ahead;
}

// Zeroes D[e] (elems values) by the whole block: the weight gradient of an expert without rows, which the GEMMs
// give no tiles.
__device__ void zero_expert(Bf16* d, int64_t elems) {
  for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) d[i] = Bf16(0.0f);
}

template <class G>
__global__ void describe_wgrad(typename G::Arrays r, const int* offsets, int experts, WgradProducts<G> w) {
  int e = blockIdx.x, p = blockIdx.y, P = gridDim.y;
  int start = e == 0 ? 0 : offsets[e - 1];
  int rows = offsets[e] - start;
  int64_t elems = static_cast<int64_t>(w.O[p]) * w.C[p];
  Bf16* d = w.d[p] + e * elems;
  if (rows == 0) zero_expert(d, elems);
  int ahead = rank_by_rows(offsets, experts, e, rows);
  if (threadIdx.x != 0) return;
  int slot = ahead * P + p;
  r.a[slot] = w.g[p] + static_cast<int64_t>(start) * w.O[p];
  r.b[slot] = w.x[p] + static_cast<int64_t>(start) * w.C[p];
  r.d[slot] = d;
  r.shape[slot] = typename G::Shape(rows == 0 ? 0 : w.O[p], w.C[p], rows);
  r.sa[slot] = w.sa[p];
  r.sb[slot] = w.sb[p];
  r.sd[slot] = w.sd[p];
}

// Runs a CUTLASS device GEMM on its arguments: 0, or the step that failed (2 workspace too small, 3
// can_implement, 4 initialize, 5 run, 6 a launch error).
template <class Gemm>
int launch(typename Gemm::Arguments const& args, void* workspace, size_t workspace_size, cudaStream_t stream) {
  if (Gemm::get_workspace_size(args) > workspace_size) return 2;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 4;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

// Workspace bytes of G (workspace == nullptr), or G run on make_args() with the usual status codes.
template <class G, class MakeArgs>
int64_t workspace_or_run(MakeArgs make_args, void* workspace, size_t workspace_size, cudaStream_t stream) {
  if (workspace == nullptr) return G::Gemm::get_workspace_size(make_args());
  return launch<typename G::Gemm>(make_args(), workspace, workspace_size, stream);
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
  // Every group's matrices are packed: the strides are the same for all groups.
  auto sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(K, K, 1));
  auto sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(N, K, 1));
  auto sd = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(1, N, 1));
  describe_groups<G><<<(groups + 127) / 128, 128, 0, stream>>>(
      r, offsets, groups, N, K, static_cast<const Bf16*>(a), static_cast<const Bf16*>(b), b_group_stride,
      static_cast<Bf16*>(d), sa, sb, sd);
  if (cudaGetLastError() != cudaSuccess) return 1;
  return launch<typename G::Gemm>(G::arguments(r, groups, sm_count), workspace, workspace_size, stream);
}

// The weight gradients of `products` (1 or 2) products over `experts` row groups in one launch of experts * products
// CUTLASS groups (describe_wgrad).
template <class G>
int run_wgrad(int products, const void* const* g, const void* const* x, void* const* d, const int* O, const int* C,
              const int* offsets, int experts, void* arrays, void* workspace, size_t workspace_size, int sm_count,
              cudaStream_t stream) {
  static_assert(G::kMode == 2, "run_wgrad runs the wgrad mode");
  if (products < 1 || products > WgradProducts<G>::kMax) return 1;
  WgradProducts<G> w{};
  for (int p = 0; p < products; ++p) {
    w.g[p] = static_cast<const Bf16*>(g[p]);
    w.x[p] = static_cast<const Bf16*>(x[p]);
    w.d[p] = static_cast<Bf16*>(d[p]);
    w.O[p] = O[p];
    w.C[p] = C[p];
    // A^T (column-major [O, K]) leads by O; B by C; D is a packed row-major [O, C]
    w.sa[p] = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(O[p], O[p], 1));
    w.sb[p] = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(C[p], C[p], 1));
    w.sd[p] = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(1, C[p], 1));
  }
  int groups = experts * products;
  auto r = G::carve(arrays, groups);
  describe_wgrad<G><<<dim3(experts, products), 256, 0, stream>>>(r, offsets, experts, w);
  if (cudaGetLastError() != cudaSuccess) return 1;
  return launch<typename G::Gemm>(G::arguments(r, groups, sm_count), workspace, workspace_size, stream);
}

// A configuration on CUTLASS's plain (not pointer-array) persistent kernel, problem (M, N, K, L), with the
// operands' strides (A and D [M, ., L], B (N, K, L)) and the tile scheduler as parameters; the epilogue's fusion
// and its D and C types too (D = A @ B in bf16 by default; ``arguments`` sets that default's alpha and beta).
template <bool PingPong, int TileM, int TileN, int TileK, int ClusterM, class StrideA, class StrideB, class StrideD,
          class SchedulerTag = void, class Fusion = cutlass::epilogue::fusion::LinearCombination<Bf16, float>,
          class ElementD = Bf16, class ElementC = ElementD>
struct PlainGemm {
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
  using MainloopSchedule = cute::conditional_t<PingPong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<PingPong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
  static constexpr int kAlign = 16 / sizeof(Bf16);
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, StrideD, kAlignD,  // C (not read: beta = 0)
      ElementD, StrideD, kAlignD,  // D
      EpilogueSchedule, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Bf16, StrideA, kAlign,
      Bf16, StrideB, kAlign,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      SchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // D = A @ B per batch, beta = 0 (D stands in for C, never read).
  static typename Gemm::Arguments arguments(const void* a, StrideA sa, const void* b, StrideB sb, void* d, StrideD sd,
                                            int M, int N, int K, int L, int sm_count) {
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kBatched,
        {M, N, K, L},
        {static_cast<const Bf16*>(a), sa, static_cast<const Bf16*>(b), sb},
        {{}, static_cast<const Bf16*>(d), sd, static_cast<Bf16*>(d), sd}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info.sm_count = sm_count;
    return args;
  }
};

// The configurations batched: D[l] = A[l] @ B_l with A [L, M, K], B k-major [L, N, K] (a [N, K] weight per
// batch), D [L, M, N], all packed. Not used by the model: it measures what the pointer-array kernels'
// per-group machinery costs against the plain kernel on the same tiles, with L = 1 (one dense GEMM) and L = E
// (equal groups, the batch switching every few tiles).
template <bool PingPong, int TileM, int TileN, int TileK, int ClusterM>
struct BatchedGemm
    : PlainGemm<PingPong, TileM, TileN, TileK, ClusterM, cutlass::detail::TagToStrideA_t<cutlass::layout::RowMajor>,
                cutlass::detail::TagToStrideB_t<cutlass::layout::ColumnMajor>,
                cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>> {
  using Base = typename BatchedGemm::PlainGemm;

  static typename Base::Gemm::Arguments arguments(const void* a, const void* b, void* d, int L, int M, int N, int K,
                                                  int sm_count) {
    using namespace cute;
    auto sa = cutlass::make_cute_packed_stride(typename Base::Kernel::StrideA{}, make_shape(M, K, L));
    auto sb = cutlass::make_cute_packed_stride(typename Base::Kernel::StrideB{}, make_shape(N, K, L));
    auto sd = cutlass::make_cute_packed_stride(typename Base::Kernel::StrideD{}, make_shape(M, N, L));
    return Base::arguments(a, sa, b, sb, d, sd, M, N, K, L, sm_count);
  }
};

// Expert-tiled grouped GEMM: the grouped product on the plain persistent kernel. Each group's rows are padded to a
// multiple of TileM (``tile_expert`` says which group M tile m holds; -1 past the last), so every M tile lies in
// one group. The kernel sees the problem (M_pad, N, K, L = G); A and D have a static zero L stride (every batch is
// the same matrix), and the tile scheduler below hands out the tiles of one batch, naming tile m's batch
// L = tile_expert[m], so only B's batch coordinate moves: D[tile m] = A[tile m] @ B_{tile_expert[m]}.
// Rows of a tile past its group's count are padding: computed, never meant to be read.

// PersistentTileSchedulerSm90 over one batch's tiles in row order (raster along N, no swizzle: tile m's N tiles
// are consecutive, so the M index only grows along a CTA's walk), with the batch index read from tile_expert. A
// tile whose entry is negative ends the CTA's walk, as all tiles after it are past the last group too.
// PersistentTileSchedulerSm90 for a Derived that names its work tiles itself (get_current_work): the base's
// initial_work_tile_info and fetch_next_work call its own get_current_work (no virtual dispatch), so they are restated
// here with Derived's (the ping-pong kernel calls initial_work_tile_info and get_current_work, the cooperative one
// fetch_next_work). A tile is never split along K, so no work continues (the base's continue_current_work is false).
// The walk runs along N without swizzle, in clusters of one CTA (walk_params).
template <class Derived>
struct RestatedWalk : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using Base::Base;

  // The base's parameters for this walk over `problem`, as Derived::to_underlying_arguments starts them.
  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Base::Params walk_params(ProblemShapeMNKL problem, TileShape tile, ClusterShape cluster,
                                  cutlass::KernelHardwareInfo const& hw_info, Base::Arguments args, void* workspace,
                                  uint32_t epilogue_subtile, uint32_t ktile_start_alignment_count) {
    static_assert(cute::size(ClusterShape{}) == 1, "expert-tiled walks: clusters of one CTA only");
    args.max_swizzle_size = 1;
    args.raster_order = Base::RasterOrderOptions::AlongN;
    return Base::to_underlying_arguments(problem, tile, cluster, hw_info, args, workspace, epilogue_subtile,
                                         ktile_start_alignment_count);
  }

  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape) {
    return self().get_current_work();
  }

  template <class Work>
  CUTLASS_DEVICE auto fetch_next_work(Work) {
    advance_to_next_work();
    return cute::make_tuple(self().get_current_work(), true);
  }

  template <class Work, class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(Work work, Pipeline&, PipelineState) {
    return fetch_next_work(work);
  }

 private:
  CUTLASS_DEVICE Derived const& self() const { return static_cast<Derived const&>(*this); }
};

struct ExpertTileScheduler : RestatedWalk<ExpertTileScheduler> {
  struct Arguments : Base::Arguments {
    const int* tile_expert = nullptr;
  };
  struct Params : Base::Params {
    const int* tile_expert = nullptr;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    auto one_batch = cute::make_shape(cute::get<0>(problem), cute::get<1>(problem), cute::get<2>(problem), 1);
    Params params;
    static_cast<Base::Params&>(params) = walk_params(one_batch, tile, cluster, hw_info, args, workspace,
                                                     epilogue_subtile, ktile_start_alignment_count);
    params.tile_expert = args.tile_expert;
    return params;
  }

  CUTLASS_HOST_DEVICE ExpertTileScheduler() {}
  CUTLASS_DEVICE explicit ExpertTileScheduler(Params const& params)
      : RestatedWalk(params), tile_expert_(params.tile_expert) {}

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    WorkTileInfo work = Base::get_current_work();
    if (!work.is_valid()) return work;
    int group = tile_expert_[work.M_idx];
    if (group < 0) return WorkTileInfo::invalid_work_tile();
    work.L_idx = group;
    return work;
  }


 private:
  const int* tile_expert_ = nullptr;
};

struct ExpertTileSchedulerTag {};

// Expert-tiled weight gradients: dW[e] = G[rows of e]^T X[rows of e] on the plain persistent cooperative kernel, each
// expert's rows padded to a multiple of the K tile. The kernel sees the problem (O, C, R, E): A = G [R, O] read as an
// M-major (O, R) matrix and B = X [R, C] as an N-major (C, R) one, both with a zero batch stride (so their TMA
// descriptors are built once), and D [E, O, C]. This scheduler walks the (O, C) tiles batch by batch, batch b being
// the b-th largest expert (order), names that expert as the tile's batch and gives the tile only its expert's K
// tiles, [start_e, end_e) / TileK (the cooperative kernel asks the scheduler for each work tile's K range; the
// ping-pong kernel does not). Experts without rows sort last and end a CTA's walk.
struct ExpertWgradScheduler : RestatedWalk<ExpertWgradScheduler> {
  struct WorkTileInfo : Base::WorkTileInfo {
    int32_t k_start = 0;
    int32_t k_count = 0;
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return {}; }
  };
  struct Arguments : Base::Arguments {
    const int* offsets = nullptr;  // [E] cumulative padded rows
    const int* order = nullptr;    // [E] the experts, largest first
  };
  struct Params : Base::Params {
    const int* offsets = nullptr;
    const int* order = nullptr;
    int tile_k = 1;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) = walk_params(problem, tile, cluster, hw_info, args, workspace,
                                                     epilogue_subtile, ktile_start_alignment_count);
    params.offsets = args.offsets;
    params.order = args.order;
    params.tile_k = cute::get<2>(tile);
    return params;
  }

  CUTLASS_HOST_DEVICE ExpertWgradScheduler() {}
  CUTLASS_DEVICE explicit ExpertWgradScheduler(Params const& params)
      : RestatedWalk(params), offsets_(params.offsets), order_(params.order), tile_k_(params.tile_k) {}

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    Base::WorkTileInfo base = Base::get_current_work();
    if (!base.is_valid()) return WorkTileInfo::invalid_work_tile();
    int e = order_[base.L_idx];
    int start = e == 0 ? 0 : offsets_[e - 1];
    int end = offsets_[e];
    if (end == start) return WorkTileInfo::invalid_work_tile();
    WorkTileInfo work;
    static_cast<Base::WorkTileInfo&>(work) = base;
    work.L_idx = e;
    work.k_start = start / tile_k_;
    work.k_count = (end - start) / tile_k_;
    return work;
  }

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& work, ProblemShape, TileShape) {
    return work.k_count;
  }

  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const& work) { return work.k_start; }

 private:
  const int* offsets_ = nullptr;
  const int* order_ = nullptr;
  int tile_k_ = 1;
};

struct ExpertWgradSchedulerTag {};

}  // namespace

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<ExpertTileSchedulerTag, ArchTag, TileShape, ClusterShape, Stages> {
  using Scheduler = ExpertTileScheduler;
};
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<ExpertWgradSchedulerTag, ArchTag, TileShape, ClusterShape, Stages> {
  using Scheduler = ExpertWgradScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

namespace {

// The expert tiles' strides: A [M_pad, K] and D [M_pad, N] the same for every batch (a static zero batch
// stride); B (n, k, g) at g·NK + n·K + k (k-major, Mode 0: the forward) or g·NK + k·N + n (n-major, Mode 1: dgrad).
using ExpertTileStrideAD = cute::Stride<int64_t, cute::_1, cute::_0>;
template <int Mode>
using ExpertTileStrideB = cute::conditional_t<Mode == 0, cute::Stride<int64_t, cute::_1, int64_t>,
                                              cute::Stride<cute::_1, int64_t, int64_t>>;

// Those strides for A [M, K], B (N, K, g) in Mode's layout and D [M, N].
template <int Mode>
struct ExpertTileStrides {
  ExpertTileStrideAD a, d;
  ExpertTileStrideB<Mode> b;
  ExpertTileStrides(int N, int K) : a{static_cast<int64_t>(K), {}, {}}, d{static_cast<int64_t>(N), {}, {}} {
    int64_t nk = static_cast<int64_t>(N) * K;
    if constexpr (Mode == 0) {
      b = {static_cast<int64_t>(K), {}, nk};
    } else {
      b = {{}, static_cast<int64_t>(N), nk};
    }
  }
};

// One configuration (cluster of one CTA) in one mode on the expert-tile scheduler.
template <bool PingPong, int TileM, int TileN, int TileK, int Mode>
struct ExpertTiledGemm : PlainGemm<PingPong, TileM, TileN, TileK, 1, ExpertTileStrideAD, ExpertTileStrideB<Mode>,
                                   ExpertTileStrideAD, ExpertTileSchedulerTag> {
  using Base = typename ExpertTiledGemm::PlainGemm;

  static typename Base::Gemm::Arguments arguments(const void* a, const void* b, void* d, const int* tile_expert,
                                                  int groups, int M, int N, int K, int sm_count) {
    ExpertTileStrides<Mode> s(N, K);
    auto args = Base::arguments(a, s.a, b, s.b, d, s.d, M, N, K, groups, sm_count);
    args.scheduler.tile_expert = tile_expert;
    return args;
  }
};

// A configuration's expert-tiled workspace size (workspace == nullptr) or run; -1 where its cluster is not one CTA.
template <bool PingPong, int TileM, int TileN, int TileK, int ClusterM>
int64_t expert_tiled(int mode, const void* a, const void* b, void* d, const int* tile_expert, int groups, int M, int N,
                     int K, void* workspace, size_t workspace_size, int sm_count, cudaStream_t stream) {
  if constexpr (ClusterM != 1) {
    return -1;
  } else {
    auto call = [&](auto g) -> int64_t {
      using G = decltype(g);
      return workspace_or_run<G>([&] { return G::arguments(a, b, d, tile_expert, groups, M, N, K, sm_count); },
                                 workspace, workspace_size, stream);
    };
    if (mode == 0) return call(ExpertTiledGemm<PingPong, TileM, TileN, TileK, 0>{});
    if (mode == 1) return call(ExpertTiledGemm<PingPong, TileM, TileN, TileK, 1>{});
    return -1;
  }
}

// The expert-tiled weight gradient (ExpertWgradScheduler): cooperative 128x256x64 tiles, one-CTA clusters. A and B
// (O or C, R) M- or N-major with a zero batch stride; D (O, C, E) row-major per expert.
using ExpertWgradStrideAB = cute::Stride<cute::_1, int64_t, cute::_0>;
using ExpertWgradStrideD = cute::Stride<int64_t, cute::_1, int64_t>;
constexpr int kExpertWgradTileK = 64;  // the rows a K tile reads: each expert's rows are padded to a multiple

struct ExpertWgradGemm : PlainGemm<false, 128, 256, kExpertWgradTileK, 1, ExpertWgradStrideAB, ExpertWgradStrideAB,
                                   ExpertWgradStrideD, ExpertWgradSchedulerTag> {
  using Base = ExpertWgradGemm::PlainGemm;

  static Base::Gemm::Arguments arguments(const void* g, const void* x, void* d, const int* offsets, const int* order,
                                         int experts, int R, int O, int C, int sm_count) {
    ExpertWgradStrideAB sa{{}, static_cast<int64_t>(O), {}};
    ExpertWgradStrideAB sb{{}, static_cast<int64_t>(C), {}};
    ExpertWgradStrideD sd{static_cast<int64_t>(C), {}, static_cast<int64_t>(O) * C};
    auto args = Base::arguments(g, sa, x, sb, d, sd, O, C, R, experts, sm_count);
    args.scheduler.offsets = offsets;
    args.scheduler.order = order;
    return args;
  }
};

// Up to two products' weight gradients D_p [E, elems_p]: what order_experts zeroes.
struct ExpertGradients {
  Bf16* d[2];
  int64_t elems[2];
};

// Block (e, p): order[rank(e)] = e (experts by row count, largest first), and D_p[e] zeroed where expert e has no rows.
__global__ void order_experts(const int* offsets, int experts, int* order, ExpertGradients w) {
  int e = blockIdx.x, p = blockIdx.y;
  int start = e == 0 ? 0 : offsets[e - 1];
  int rows = offsets[e] - start;
  if (rows == 0) zero_expert(w.d[p] + e * w.elems[p], w.elems[p]);
  int ahead = rank_by_rows(offsets, experts, e, rows);
  if (threadIdx.x == 0 && p == 0) order[ahead] = e;
}

// SiTU-GLU in the epilogues of configuration 1's expert-tiled products (SituForwardGemm, SituBackwardGemm).
#include "situ_epilogue.cuh"

// The configurations this library holds, by index (grouped_gemm_sm90.CONFIGS lists the same, in order).
#define K3_CONFIGS(X)                  \
  X(0, true, 128, 128, 64, 1)          \
  X(1, true, 64, 256, 64, 1)           \
  X(2, true, 64, 128, 128, 2)          \
  X(3, false, 128, 256, 64, 2)         \
  X(4, false, 128, 128, 64, 1)

}  // namespace

extern "C" {

// Bumped when an entry point's arguments change, so that a stale build is refused (grouped_gemm_sm90.ABI_VERSION).
int k3gg_abi_version() { return 5; }

int k3gg_num_configs() {
#define K3_COUNT(i, ...) +1
  return 0 K3_CONFIGS(K3_COUNT);
#undef K3_COUNT
}

// Dispatch on (config, mode) to G = GroupedGemm<...> and return EXPR (the callers return 0 or -1 after it):
// K3_MODE for one mode m, K3_PRODUCT_MODES for the products (0, 1), K3_MODES for all three.
#define K3_MODE(i, pp, tm, tn, tk, cm, m, EXPR) \
  if (config == i && mode == m) { using G = GroupedGemm<pp, tm, tn, tk, cm, m>; return EXPR; }
#define K3_PRODUCT_MODES(i, pp, tm, tn, tk, cm, EXPR) \
  K3_MODE(i, pp, tm, tn, tk, cm, 0, EXPR) K3_MODE(i, pp, tm, tn, tk, cm, 1, EXPR)
#define K3_MODES(i, pp, tm, tn, tk, cm, EXPR) \
  K3_PRODUCT_MODES(i, pp, tm, tn, tk, cm, EXPR) K3_MODE(i, pp, tm, tn, tk, cm, 2, EXPR)

// Bytes of the per-group array buffer the caller provides.
size_t k3gg_array_bytes(int config, int mode, int groups) {
#define K3_CASE(i, pp, tm, tn, tk, cm) K3_MODES(i, pp, tm, tn, tk, cm, G::array_bytes(groups))
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return 0;
}

// Bytes of CUTLASS's workspace for this configuration and mode.
size_t k3gg_workspace_bytes(int config, int mode, int groups, int sm_count) {
#define K3_CASE(i, pp, tm, tn, tk, cm) K3_MODES(i, pp, tm, tn, tk, cm, workspace_bytes<G>(groups, sm_count))
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return 0;
}

// 0 on success; 1-6: which step failed (a launch before the GEMM, workspace size, can_implement, initialize,
// run, launch error); -1: unknown configuration or mode (0 or 1: the products; the weight gradients run through
// k3gg_wgrad_run).
int k3gg_run(int config, int mode, const void* a, const void* b, void* d, const int* offsets, int groups, int N,
             int K, int64_t b_group_stride, void* arrays, void* workspace, size_t workspace_size, int sm_count,
             void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
#define K3_CASE(i, pp, tm, tn, tk, cm)                                                                              \
  K3_PRODUCT_MODES(i, pp, tm, tn, tk, cm,                                                                           \
                   run<G>(a, b, d, offsets, groups, N, K, b_group_stride, arrays, workspace, workspace_size, sm_count, \
                          s))
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return -1;
}

// Mode 2: D_p[e] = G_p[rows of e]^T X_p[rows of e] for p < products (1 or 2; arrays of that length), G_p [M, O_p],
// X_p [M, C_p], D_p [experts, O_p, C_p] bf16 packed; one launch, experts * products CUTLASS groups (the array and
// workspace sizes of mode 2 at that many groups). Status codes as k3gg_run's.
int k3gg_wgrad_run(int config, int products, const void* const* g, const void* const* x, void* const* d, const int* O,
                   const int* C, const int* offsets, int experts, void* arrays, void* workspace, size_t workspace_size,
                   int sm_count, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  int mode = 2;
#define K3_CASE(i, pp, tm, tn, tk, cm) \
  K3_MODE(i, pp, tm, tn, tk, cm, 2,     \
          run_wgrad<G>(products, g, x, d, O, C, offsets, experts, arrays, workspace, workspace_size, sm_count, s))
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return -1;
}

// The batched plain kernels (BatchedGemm above), same configuration indices and status codes.
size_t k3gg_batched_workspace_bytes(int config, int L, int M, int N, int K, int sm_count) {
#define K3_CASE(i, pp, tm, tn, tk, cm) \
  if (config == i) return BatchedGemm<pp, tm, tn, tk, cm>::Gemm::get_workspace_size( \
      BatchedGemm<pp, tm, tn, tk, cm>::arguments(nullptr, nullptr, nullptr, L, M, N, K, sm_count));
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return 0;
}

int k3gg_batched_run(int config, const void* a, const void* b, void* d, int L, int M, int N, int K, void* workspace,
                     size_t workspace_size, int sm_count, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
#define K3_CASE(i, pp, tm, tn, tk, cm) \
  if (config == i) return launch<BatchedGemm<pp, tm, tn, tk, cm>::Gemm>(                                        \
      BatchedGemm<pp, tm, tn, tk, cm>::arguments(a, b, d, L, M, N, K, sm_count), workspace, workspace_size, s);
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return -1;
}

// The expert-tiled kernels (ExpertTiledGemm above) of the configurations whose clusters are one CTA; mode 0
// (B k-major) or 1 (B n-major). Workspace bytes (-1: no such kernel), and the run with the usual status codes.
int64_t k3gg_expert_tiled_workspace_bytes(int config, int mode, int groups, int M, int N, int K, int sm_count) {
#define K3_CASE(i, pp, tm, tn, tk, cm) \
  if (config == i) return expert_tiled<pp, tm, tn, tk, cm>(mode, nullptr, nullptr, nullptr, nullptr, groups, M, N, K, \
                                                           nullptr, 0, sm_count, nullptr);
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return -1;
}

int k3gg_expert_tiled_run(int config, int mode, const void* a, const void* b, void* d, const int* tile_expert,
                          int groups, int M, int N, int K, void* workspace, size_t workspace_size, int sm_count,
                          void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (workspace == nullptr) return 2;  // the caller passes at least one byte
#define K3_CASE(i, pp, tm, tn, tk, cm) \
  if (config == i) return static_cast<int>(expert_tiled<pp, tm, tn, tk, cm>(mode, a, b, d, tile_expert, groups, M, \
                                                                            N, K, workspace, workspace_size, sm_count, s));
  K3_CONFIGS(K3_CASE)
#undef K3_CASE
  return -1;
}

// Mode 2 on the expert-tiled kernel (ExpertWgradGemm): D_p[e] = G_p[rows of e]^T X_p[rows of e] for p < products (1 or
// 2), as k3gg_wgrad_run, over R rows whose experts each start and end on a multiple of 64 (offsets: the cumulative
// padded rows). One small launch orders the experts into order [experts] (a caller buffer) and zeroes the empty
// ones' gradients, then one GEMM launch a product. Workspace bytes (one product's) when workspace is null, else the
// status codes of k3gg_run.
int64_t k3gg_expert_wgrad(int products, const void* const* g, const void* const* x, void* const* d, const int* O,
                          const int* C, const int* offsets, int experts, int R, int* order, void* workspace,
                          size_t workspace_size, int sm_count, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (products < 1 || products > 2) return workspace == nullptr ? -1 : 1;
  auto make_args = [&](int p) {
    return ExpertWgradGemm::arguments(g[p], x[p], d[p], offsets, order, experts, R, O[p], C[p], sm_count);
  };
  if (workspace == nullptr) {
    int64_t bytes = 0;
    for (int p = 0; p < products; ++p) {
      bytes = std::max<int64_t>(bytes, ExpertWgradGemm::Gemm::get_workspace_size(make_args(p)));
    }
    return bytes;
  }
  ExpertGradients w{};
  for (int p = 0; p < products; ++p) {
    w.d[p] = static_cast<Bf16*>(d[p]);
    w.elems[p] = static_cast<int64_t>(O[p]) * C[p];
  }
  order_experts<<<dim3(experts, products), 256, 0, s>>>(offsets, experts, order, w);
  if (cudaGetLastError() != cudaSuccess) return 1;
  for (int p = 0; p < products; ++p) {
    int status = launch<ExpertWgradGemm::Gemm>(make_args(p), workspace, workspace_size, s);
    if (status) return status;
  }
  return 0;
}

// SiTU in configuration 1's expert-tiled products (situ_epilogue.cuh): workspace bytes when workspace is null, else
// the run's status. Forward: x [M, K] @ w13 [G, N, K]^T (rows interleaved gate/up) -> pre [M, N] and h [M, N/2].
// Backward: dy [M, K] @ w2 [G, K, N] -> d_pre [M, 2N] from pre [M, 2N] (both bf16 pairs) and ds [M] (or null).
// row_scale [M] fp32 or null (1).
int64_t k3gg_situ_forward(const void* x, const void* w13, void* pre, void* h, const int* tile_expert, int groups,
                          int M, int N, int K, const float* row_scale, float beta, float linear_beta, void* workspace,
                          size_t workspace_size, int sm_count, void* stream) {
  auto make_args = [&] {
    return SituForwardGemm::arguments(x, w13, pre, h, tile_expert, groups, M, N, K, sm_count, row_scale,
                                      {beta, linear_beta});
  };
  return workspace_or_run<SituForwardGemm>(make_args, workspace, workspace_size, static_cast<cudaStream_t>(stream));
}

int64_t k3gg_situ_backward(const void* dy, const void* w2, const void* pre, void* d_pre, const int* tile_expert,
                           int groups, int M, int N, int K, const float* row_scale, float* ds, float beta,
                           float linear_beta, void* workspace, size_t workspace_size, int sm_count, void* stream) {
  auto make_args = [&] {
    return SituBackwardGemm::arguments(dy, w2, pre, d_pre, tile_expert, groups, M, N, K, sm_count, row_scale, ds,
                                       {beta, linear_beta});
  };
  return workspace_or_run<SituBackwardGemm>(make_args, workspace, workspace_size, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
