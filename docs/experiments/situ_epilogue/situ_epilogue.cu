// Session 33 prototype (issue 10, docs/moe_notes.md §2): SiTU-GLU in the CUTLASS epilogues of the expert-tiled
// products, on kernels/grouped_gemm_sm90's configuration 1 (ping-pong 64x256x64) and its expert-tile scheduler.
// Not part of the library: built and timed by bench.py here (README.md). Variants of k3x_situ_fused:
//   0, 1, 2  W13 forward, W13's rows interleaved (gate_j, up_j): D[:, 2j] = SiTU(gate_j, up_j) (0: __expf form,
//            1: tanh.approx, 2: no math), D[:, 2j+1] = up_j; a cost proxy with the plain GEMM's bytes
//   3        as 1, plus the pre-activations to an aux output (CUTLASS's LinCombPerRowBiasEltActAux)
//   4        D = the pre-activations, h x row scale to a compact [M, I] by per-thread global stores (end of subtile)
//   6        the same, each h stored in visit() at the tile's static per-thread coordinates
//   7        the same, h through shared memory and a TMA store per subtile (built; not yet run on a GPU)
//   5        W2 dgrad with SiTU's backward: aux = the pre-activations as packed (gate_j, up_j) bf16 pairs (uint32),
//            D = packed (dgate_j, dup_j) pairs; no row scale
#include "../../../kernels/grouped_gemm_sm90/grouped_gemm.cu"

#include <cuda_bf16.h>

namespace {

#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

constexpr float kBeta = 4.0f, kLinBeta = 25.0f;

template <int Mode>
__device__ __forceinline__ float tanh_f(float x) {
  if constexpr (Mode == 1) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    float ax = fabsf(x);
    float e = __expf(-2.0f * ax);
    float t = __fdividef(1.0f - e, 1.0f + e);
    t = ax < 0.015625f ? ax : t;
    return copysignf(t, x);
  }
}

template <int Mode>
__device__ __forceinline__ float sigmoid_f(float x) {
  if constexpr (Mode == 1) {
    return fmaf(0.5f, tanh_f<1>(0.5f * x), 0.5f);
  } else {
    return __fdividef(1.0f, 1.0f + __expf(-x));
  }
}

template <int Mode>
struct SituPairOf {
  template <class T>
  struct Fn {};  // scalar: only looked at for an Arguments member
  template <int N>
  struct Fn<cutlass::Array<float, N>> {
    CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& acc) const {
      cutlass::Array<float, N> out;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < N; j += 2) {
        float a = acc[j], c = acc[j + 1];
        if constexpr (Mode == 2) {  // no math: the epilogue's own cost
          out[j] = a;
        } else {
          out[j] = kBeta * tanh_f<Mode>(a * (1.0f / kBeta)) * sigmoid_f<Mode>(a) * (kLinBeta * tanh_f<Mode>(c * (1.0f / kLinBeta)));
        }
        out[j + 1] = c;
      }
      return out;
    }
  };
};


template <class T> struct SituExp : SituPairOf<0>::Fn<T> {};
template <class T> struct SituApprox : SituPairOf<1>::Fn<T> {};
template <class T> struct SituNone : SituPairOf<2>::Fn<T> {};


// What an epilogue visitor that only stores needs besides its callbacks: no workspace, no loads.
struct StoreOnlyVisitor {
  template <class ProblemShape, class Arguments>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }
};

// Keeps fragment epi_v of a subtile's visited values, in bf16, in the thread's register tensor tC_r (compact, so
// its linear order is the fragments' order).
template <class RTensor, class ElementInput, int FragmentSize>
CUTLASS_DEVICE void keep_fragment(RTensor& tC_r, int epi_v, cutlass::Array<ElementInput, FragmentSize> const& frg) {
  cutlass::NumericArrayConverter<Bf16, ElementInput, FragmentSize> convert{};
  cute::recast<cutlass::Array<Bf16, FragmentSize>>(cute::coalesce(tC_r))(epi_v) = convert(frg);
}

// h[m, j] for the pair (2j, 2j+1) of the accumulator tile: a register-direct store (no smem, no TMA). Each
// thread keeps its subtile's values and, at the subtile's end, stores those of even columns at h[m, n / 2].
struct Sm90HalfStore : StoreOnlyVisitor {
  struct SharedStorage {};
  struct Arguments {
    Bf16* ptr = nullptr;
    int64_t ld = 0;
  };
  using Params = Arguments;
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  CUTLASS_HOST_DEVICE Sm90HalfStore() {}
  CUTLASS_HOST_DEVICE Sm90HalfStore(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr;

  template <class CTensor, class RTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor&& c, RTensor&& r, Params const* p)
        : tC_c(cute::forward<CTensor>(c)), tC_r(cute::forward<RTensor>(r)), params_ptr(p) {}
    CTensor tC_c;
    RTensor tC_r;
    Params const* params_ptr;
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      keep_fragment(tC_r, epi_v, frg_input);
      return frg_input;
    }
    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      auto c = tC_c(cute::_, cute::_, cute::_, epi_m, epi_n);
      Bf16* h = params_ptr->ptr;
      int64_t ld = params_ptr->ld;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(tC_r); ++i) {
        auto mn = c(i);
        int n = cute::get<1>(mn);
        if ((n & 1) == 0) h[static_cast<int64_t>(cute::get<0>(mn)) * ld + (n >> 1)] = tC_r(i);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    Tensor cH = make_identity_tensor(make_shape(M, N, L));
    Tensor tC_c = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        cH, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tC_r = make_tensor<Bf16>(take<0, 3>(shape(tC_c)));
    return ConsumerStoreCallbacks<decltype(tC_c), decltype(tC_r)>(cute::move(tC_c), cute::move(tC_r), params_ptr);
  }
};


// SiTU's backward on packed (gate_j, up_j) bf16 pairs (one uint32 each): D = packed (dgate_j, dup_j) from
// go_j = dh_j (the W2 dgrad's accumulator) and the saved pre-activations (the aux input, not converted).
template <class T> struct SituBwdPacked {};

}  // namespace

namespace cutlass::epilogue::fusion {
template <FloatRoundStyle RoundStyle>
struct Sm90Compute<SituBwdPacked, uint32_t, float, RoundStyle> : Sm90VisitorImpl<> {
  using Sm90VisitorImpl<>::Sm90VisitorImpl;
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    template <typename ElementAccumulator, typename ElementInput, typename ElementAux, int FragmentSize>
    CUTLASS_DEVICE Array<uint32_t, FragmentSize> visit(Array<ElementAccumulator, FragmentSize> const&, int, int, int,
                                                       Array<ElementInput, FragmentSize> const& frg_input,
                                                       Array<ElementAux, FragmentSize> const& frg_aux) {
      Array<uint32_t, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        float go = static_cast<float>(frg_input[i]);
        uint32_t p = static_cast<uint32_t>(frg_aux[i]);
        float a = __uint_as_float(p << 16), c = __uint_as_float(p & 0xffff0000u);
        float ta, tc, sa;
        asm("tanh.approx.f32 %0, %1;" : "=f"(ta) : "f"(a * 0.25f));
        asm("tanh.approx.f32 %0, %1;" : "=f"(tc) : "f"(c * 0.04f));
        float th;
        asm("tanh.approx.f32 %0, %1;" : "=f"(th) : "f"(0.5f * a));
        sa = fmaf(0.5f, th, 0.5f);
        float g = 4.0f * ta * sa, h = 25.0f * tc;
        float dg = sa * ((1.0f - ta * ta) + 4.0f * ta * (1.0f - sa));
        float dgate = go * h * dg, dup = go * g * (1.0f - tc * tc);
        uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(dgate));
        uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(dup));
        out[i] = lo | (hi << 16);
      }
      return out;
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const&) { return ConsumerStoreCallbacks(); }
};
}  // namespace cutlass::epilogue::fusion

namespace {
using SituBwdOp = cutlass::epilogue::fusion::LinCombDeEltAct<cutlass::layout::RowMajor, SituBwdPacked, uint32_t, float,
                                                             uint32_t>;

template <class T> struct TakeFirst {};
template <int N> struct TakeFirst<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& a, cutlass::Array<float, N> const&) const { return a; }
};

// (h_j·s, h_j·s) for the pair (gate_j, up_j), s the row's scale
template <class T> struct SituDupScaled {};
template <int N> struct SituDupScaled<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& acc, cutlass::Array<float, N> const& s) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < N; j += 2) {
      float a = acc[j], c = acc[j + 1];
      float h = kBeta * tanh_f<1>(a * (1.0f / kBeta)) * sigmoid_f<1>(a) * (kLinBeta * tanh_f<1>(c * (1.0f / kLinBeta))) * s[j];
      out[j] = h;
      out[j + 1] = h;
    }
    return out;
  }
};

template <class TileMNK>
using SituHalfEVT = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<TakeFirst, Bf16, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90EVT<
        Sm90HalfStore,
        cutlass::epilogue::fusion::Sm90EVT<
            cutlass::epilogue::fusion::Sm90Compute<SituDupScaled, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
            cutlass::epilogue::fusion::Sm90AccFetch,
            cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileMNK, float>>>>;


// As Sm90HalfStore, but each h goes out in visit() itself, its place from the epilogue's static per-thread
// coordinates (args.tCcD, relative to the tile) and the tile's origin: no register buffer, no identity tensor.
template <int TileM, int TileN>
struct Sm90HalfStoreDirect : Sm90HalfStore {
  using Sm90HalfStore::Sm90HalfStore;
  template <class CTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, Bf16* origin, int64_t ld) : tC_c(c), origin(origin), ld(ld) {}
    CTensor tC_c;
    Bf16* origin;  // h
    int64_t ld;
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      auto c = tC_c(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        auto mn = c(epi_v * FragmentSize + i);
        origin[cute::get<0>(mn) * ld + (cute::get<1>(mn) >> 1)] = Bf16(frg_input[i]);
      }
      return frg_input;
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    // coordinates relative to the tile (static but for the thread's offset), in the fragments' order
    Tensor tC_c = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(take<0, 2>(args.tile_shape_mnk)), args.epi_tile, args.tiled_copy, args.thread_idx);
    int64_t ld = params_ptr->ld;
    Bf16* origin = params_ptr->ptr + static_cast<int64_t>(m) * TileM * ld + static_cast<int64_t>(n) * (TileN / 2);
    return ConsumerStoreCallbacks<decltype(tC_c)>(tC_c, origin, ld);
  }
};

template <class TileMNK>
using SituHalfDirectEVT = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<TakeFirst, Bf16, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90EVT<
        Sm90HalfStoreDirect<64, 256>,
        cutlass::epilogue::fusion::Sm90EVT<
            cutlass::epilogue::fusion::Sm90Compute<SituDupScaled, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
            cutlass::epilogue::fusion::Sm90AccFetch,
            cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileMNK, float>>>>;


// h[m, j] for the pair (2j, 2j+1), through shared memory and a TMA store per epilogue subtile: the subtile's
// [EpiM, EpiN] accumulator columns give an [EpiM, EpiN/2] h tile. Each thread keeps its values in registers during
// visit(), writes the even-column ones to the stage's smem tile in postreduce() (the collective then fences and
// syncs), and the issuing thread stores the tile in tma_store(); stages follow the collective's store iteration.
template <int Stages, int EpiM, int EpiN>
struct Sm90HalfTmaStore : StoreOnlyVisitor {
  using StrideH = ExpertTileStrideAD;  // (ld, 1, 0): every group's tiles in one [M, N/2] tensor
  using SmemLayoutTma = cute::Layout<cute::Shape<cute::Int<EpiM>, cute::Int<EpiN / 2>>,
                                     cute::Stride<cute::Int<EpiN / 2>, cute::_1>>;
  using SmemLayout = cute::Layout<cute::Shape<cute::Int<EpiM>, cute::Int<EpiN / 2>, cute::Int<Stages>>,
                                  cute::Stride<cute::Int<EpiN / 2>, cute::_1, cute::Int<EpiM * EpiN / 2>>>;
  struct SharedStorage {
    alignas(128) cute::array_aligned<Bf16, cute::cosize_v<SmemLayout>> smem_h;
  };
  struct Arguments {
    Bf16* ptr = nullptr;
    int64_t ld = 0;
  };
  struct Params {
    using TMA_H = decltype(cute::make_tma_copy(
        cute::SM90_TMA_STORE{},
        cute::make_tensor(static_cast<Bf16*>(nullptr), cute::repeat_like(StrideH{}, int32_t(0)), StrideH{}),
        SmemLayoutTma{}));
    TMA_H tma_store_h;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    auto tensor_h = cute::make_tensor(args.ptr, cute::make_layout(cute::make_shape(M, N / 2, L),
                                                                  StrideH{args.ld, {}, {}}));
    return {cute::make_tma_copy(cute::SM90_TMA_STORE{}, tensor_h, SmemLayoutTma{})};
  }
  CUTLASS_HOST_DEVICE Sm90HalfTmaStore() {}
  CUTLASS_HOST_DEVICE Sm90HalfTmaStore(Params const& params, SharedStorage const& shared)
      : params_ptr(&params), smem_h(const_cast<Bf16*>(shared.smem_h.data())) {}
  Params const* params_ptr;
  Bf16* smem_h;

  template <class CTensor, class RTensor, class STensorS2G, class GTensorS2G>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, RTensor&& r, STensorS2G&& s, GTensorS2G&& g, Bf16* smem,
                                          Params const* p)
        : tC_c(c), tC_r(cute::forward<RTensor>(r)), bSG_s(cute::forward<STensorS2G>(s)),
          bSG_g(cute::forward<GTensorS2G>(g)), smem_h(smem), params_ptr(p) {}
    CTensor tC_c;       // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) coordinates in the CTA tile
    RTensor tC_r;       // (CPY,CPY_M,CPY_N) this subtile's values
    STensorS2G bSG_s;   // (TMA,TMA_M,TMA_N,PIPE)
    GTensorS2G bSG_g;   // (TMA,TMA_M,TMA_N,EPI_M,EPI_N)
    Bf16* smem_h;
    Params const* params_ptr;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      keep_fragment(tC_r, epi_v, frg_input);
      return frg_input;
    }

    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration, bool issue_smem_store) {
      if (!issue_smem_store) return;
      auto c = tC_c(cute::_, cute::_, cute::_, epi_m, epi_n);
      Bf16* stage = smem_h + (store_iteration % Stages) * (EpiM * EpiN / 2);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(tC_r); i += 2) {
        auto mn = c(i);
        int rm = cute::get<0>(mn) - epi_m * EpiM, rn = cute::get<1>(mn) - epi_n * EpiN;
        stage[rm * (EpiN / 2) + (rn >> 1)] = tC_r(i);
      }
    }

    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if (issue_tma_store) {
        cute::copy(params_ptr->tma_store_h, bSG_s(cute::_, cute::_, cute::_, store_iteration % Stages),
                   bSG_g(cute::_, cute::_, cute::_, epi_m, epi_n));
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    Tensor tC_c = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(take<0, 2>(args.tile_shape_mnk)), args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tC_r = make_tensor<Bf16>(take<0, 3>(shape(tC_c)));
    Tensor mH = params_ptr->tma_store_h.get_tma_tensor(make_shape(M, N / 2, L));
    auto half_tile = make_shape(size<0>(args.tile_shape_mnk), size<1>(args.tile_shape_mnk) / _2{});
    Tensor gH = local_tile(mH, half_tile, make_coord(m, n, l));                          // (CTA_M, CTA_N/2)
    Tensor gH_epi = flat_divide(gH, make_shape(Int<EpiM>{}, Int<EpiN / 2>{}));          // (EPI_M', EPI_N', EPI_M, EPI_N)
    Tensor sH = make_tensor(make_smem_ptr(smem_h), SmemLayout{});                         // (EPI_M', EPI_N', PIPE)
    ThrCopy thrblk_s2g = params_ptr->tma_store_h.get_slice(_0{});
    Tensor bSG_s = thrblk_s2g.partition_S(sH);
    Tensor bSG_g = thrblk_s2g.partition_D(gH_epi);
    return ConsumerStoreCallbacks<decltype(tC_c), decltype(tC_r), decltype(bSG_s), decltype(bSG_g)>(
        tC_c, cute::move(tC_r), cute::move(bSG_s), cute::move(bSG_g), smem_h, params_ptr);
  }
};

template <class TileMNK>
using SituHalfTmaEVT = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<TakeFirst, Bf16, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90EVT<
        Sm90HalfTmaStore<2, 64, 32>,
        cutlass::epilogue::fusion::Sm90EVT<
            cutlass::epilogue::fusion::Sm90Compute<SituDupScaled, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
            cutlass::epilogue::fusion::Sm90AccFetch,
            cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileMNK, float>>>>;

template <template <class> class Op>
using PairEVT = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<Op, Bf16, float, cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch>;

template <template <class> class Op>
using ActAux = cutlass::epilogue::fusion::LinCombPerRowBiasEltActAux<cutlass::layout::RowMajor, Op, Bf16, float, Bf16, Bf16, Bf16>;

// The expert-tiled kernel (ExpertTiledGemm's strides and scheduler) with the epilogue fusion given; C is not read.
template <bool PingPong, int TileM, int TileN, int TileK, class Fusion, int WithAux = 0, int Mode = 0, class ElementD = Bf16>
struct FusedGemm : PlainGemm<PingPong, TileM, TileN, TileK, 1, ExpertTileStrideAD, ExpertTileStrideB<Mode>,
                             ExpertTileStrideAD, ExpertTileSchedulerTag, Fusion, ElementD, void> {
  using Base = typename FusedGemm::PlainGemm;
  using Gemm = typename Base::Gemm;
  using StrideA = ExpertTileStrideAD;
  using StrideB = ExpertTileStrideB<Mode>;
  using StrideD = ExpertTileStrideAD;

  static typename Gemm::Arguments arguments(const void* a, const void* b, void* d, const int* tile_expert, int groups,
                                            int M, int N, int K, int sm_count, void* aux = nullptr, const float* scale = nullptr) {
    int64_t nk = static_cast<int64_t>(N) * K;
    StrideB sb;
    if constexpr (Mode == 0) {
      sb = {static_cast<int64_t>(K), {}, nk};
    } else {
      sb = {{}, static_cast<int64_t>(N), nk};
    }
    StrideD sd{static_cast<int64_t>(N), {}, {}};
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kBatched,
        {M, N, K, groups},
        {static_cast<const Bf16*>(a), StrideA{static_cast<int64_t>(K), {}, {}}, static_cast<const Bf16*>(b), sb},
        {{}, nullptr, sd, static_cast<ElementD*>(d), sd}};
    args.hw_info.sm_count = sm_count;
    args.scheduler.tile_expert = tile_expert;
    if constexpr (WithAux == 2) {
      args.epilogue.thread = {{}, {{{}, {scale, 0.0f, {}}, {}}, {static_cast<Bf16*>(aux), static_cast<int64_t>(N / 2)}}, {}};
    }
    if constexpr (WithAux == 3) {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
      args.epilogue.thread.aux_ptr = static_cast<const uint32_t*>(aux);
      args.epilogue.thread.dAux = {static_cast<int64_t>(N), cute::_1{}, int64_t(0)};
    }
    if constexpr (WithAux == 1) {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
      args.epilogue.thread.bias_ptr = nullptr;
      args.epilogue.thread.aux_ptr = static_cast<Bf16*>(aux);
      args.epilogue.thread.dAux = {static_cast<int64_t>(N), cute::_1{}, int64_t(0)};
    }
    return args;
  }
};

template <class G>
int64_t fused(const void* a, const void* b, void* d, const int* tile_expert, int groups, int M, int N, int K,
              void* workspace, size_t ws, int sm_count, cudaStream_t stream, void* aux = nullptr,
              const float* scale = nullptr) {
  if (workspace == nullptr)
    return G::Gemm::get_workspace_size(G::arguments(nullptr, nullptr, nullptr, nullptr, groups, M, N, K, sm_count));
  return launch<typename G::Gemm>(G::arguments(a, b, d, tile_expert, groups, M, N, K, sm_count, aux, scale), workspace, ws,
                                  stream);
}

}  // namespace

extern "C" int64_t k3x_situ_fused(int variant, const void* a, const void* b, void* d, const int* tile_expert,
                                  int groups, int M, int N, int K, void* workspace, size_t ws, int sm_count,
                                  void* stream, void* aux, const float* scale) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (variant) {
    case 0: return fused<FusedGemm<true, 64, 256, 64, PairEVT<SituExp>>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s);
    case 1: return fused<FusedGemm<true, 64, 256, 64, PairEVT<SituApprox>>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s);
    case 2: return fused<FusedGemm<true, 64, 256, 64, PairEVT<SituNone>>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s);
    case 3: return fused<FusedGemm<true, 64, 256, 64, ActAux<SituApprox>, 1>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s, aux);
    case 5: return fused<FusedGemm<true, 64, 256, 64, SituBwdOp, 3, 1, uint32_t>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s, aux, scale);
    case 6: return fused<FusedGemm<true, 64, 256, 64, SituHalfDirectEVT<cute::Shape<cute::_64, cute::_256, cute::_64>>, 2>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s, aux, scale);
    case 7: return fused<FusedGemm<true, 64, 256, 64, SituHalfTmaEVT<cute::Shape<cute::_64, cute::_256, cute::_64>>, 2>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s, aux, scale);
    case 4: return fused<FusedGemm<true, 64, 256, 64, SituHalfEVT<cute::Shape<cute::_64, cute::_256, cute::_64>>, 2>>(a, b, d, tile_expert, groups, M, N, K, workspace, ws, sm_count, s, aux, scale);
  }
  return -1;
}
