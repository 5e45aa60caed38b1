// SiTU-GLU inside the expert-tiled products' epilogues (included by grouped_gemm.cu, inside its anonymous
// namespace but for the Sm90Compute specialization at the end). Both kernels run configuration 1 (ping-pong
// 64x256x64) on the expert-tile scheduler, with W13's rows interleaved (row 2j = gate_j, row 2j+1 = up_j), so
// each thread holds a (gate_j, up_j) pair in two adjacent accumulator registers.
//
//   forward   P = x @ W13_e^T            [M, 2I] bf16, the pre-activations (D, stored as usual)
//             h[m, j] = s_m · SiTU(P32[m, 2j], P32[m, 2j+1])   [M, I] bf16 from the fp32 accumulators, through
//                                                              shared memory and one TMA store per subtile
//   backward  dh = dy @ W2_e             (the W2 dgrad's accumulator, [M, I])
//             (dP[m, 2j], dP[m, 2j+1]) = s_m · dh[m, j] · ∇SiTU(P[m, 2j], P[m, 2j+1])   D, bf16 pairs as uint32
//             ds[m] = Σ_j dh[m, j] · SiTU(P[m, 2j], P[m, 2j+1])                      a per-row sum, fp32
//
// SiTU(a, c) = β·tanh(a/β)·σ(a) · β_lin·tanh(c/β_lin) (kernels/situ/reference.py), with tanh from the SFU's
// tanh.approx.f32 and σ(a) = ½ + ½·tanh(a/2): the epilogue hides under the other warp group's mainloop only with
// few instructions per element (docs/moe_notes.md §2, session 33; accuracy in docs/decisions.md). The row scale s
// (the gate weights; none: 1) is read per row from global memory.
//
// A ping-pong 64-row tile gives each thread two rows, r and r + 8 (the wgmma accumulator layout: rows lane/4 and
// lane/4 + 8 of the warp's 16), the same in every epilogue subtile (a subtile spans the tile's rows); the row scale
// and ds use that (ThreadRows), and the four lanes of a quad hold the same rows.

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The two factors of SiTU and their derivatives at one (a, c) pair.
struct SituTerms {
  float ta, sa, tc;  // tanh(a/β), σ(a), tanh(c/β_lin)
  __device__ __forceinline__ SituTerms(float a, float c, float inv_beta, float inv_linear_beta)
      : ta(tanh_approx(a * inv_beta)), sa(fmaf(0.5f, tanh_approx(0.5f * a), 0.5f)),
        tc(tanh_approx(c * inv_linear_beta)) {}
  __device__ __forceinline__ float gate(float beta) const { return beta * ta * sa; }
  __device__ __forceinline__ float up(float linear_beta) const { return linear_beta * tc; }
  // ∂g/∂a = σ(a)·[sech²(a/β) + β·tanh(a/β)·(1 − σ(a))];  ∂h/∂c = sech²(c/β_lin)
  __device__ __forceinline__ float dgate(float beta) const {
    return sa * (fmaf(-ta, ta, 1.0f) + beta * ta * (1.0f - sa));
  }
  __device__ __forceinline__ float dup() const { return fmaf(-tc, tc, 1.0f); }
};

struct SituBetas {
  float beta = 4.0f, linear_beta = 25.0f;
  float inv_beta = 0.25f, inv_linear_beta = 0.04f;
  SituBetas() = default;
  SituBetas(float beta, float linear_beta)
      : beta(beta), linear_beta(linear_beta), inv_beta(1.0f / beta), inv_linear_beta(1.0f / linear_beta) {}
};

// What an epilogue visitor that loads nothing through the collective needs besides its callbacks: no workspace.
struct NoWorkspaceVisitor {
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

// A thread's two rows of the tile, r0 and r0 + 8, as seen from the kN positions of a subtile's fragments (the same
// in every subtile): which positions lie on the second row, and each position's row scale. From the coordinates of
// the epilogue's fragments relative to the tile (CTensor: (CPY, CPY_M, CPY_N, EPI_M, EPI_N) -> (m, n)).
template <class CTensor>
struct ThreadRows {
  using SubtileShape = decltype(cute::take<0, 3>(cute::shape(std::declval<CTensor>())));
  static constexpr int kN = decltype(cute::size(SubtileShape{}))::value;
  static_assert(decltype(cute::size<3>(cute::shape(std::declval<CTensor>())))::value == 1,
                "one epilogue subtile along M: every subtile holds the thread's same two rows");
  static_assert(kN <= 32, "positions of a subtile in one 32-bit mask");
  int64_t m0;            // the tile's first row
  int r0;                // the thread's first row in the tile
  uint32_t second = 0;   // bit k: position k lies on row r0 + 8
  cutlass::Array<float, kN> scale;

  CUTLASS_DEVICE ThreadRows(CTensor const& tC_c, int64_t m0, float const* row_scale) : m0(m0) {
    auto sub = tC_c(cute::_, cute::_, cute::_, 0, 0);
    r0 = cute::get<0>(sub(0));
    float s0 = row_scale == nullptr ? 1.0f : row_scale[m0 + r0];
    float s1 = row_scale == nullptr ? 1.0f : row_scale[m0 + r0 + 8];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kN; ++k) {
      bool on_second = cute::get<0>(sub(k)) != r0;
      second |= static_cast<uint32_t>(on_second) << k;
      scale[k] = on_second ? s1 : s0;
    }
  }
};

// The thread's fragment coordinates in the tile, in the order visit() sees the fragments (the partition of the
// collective's register-to-smem copy, or of its source copy where ReferenceSrc).
template <bool ReferenceSrc, class TileShapeMNK, class Args>
CUTLASS_DEVICE auto tile_coordinates(Args const& args) {
  using namespace cute;
  static_assert(size<0>(TileShapeMNK{}) == 64, "the SiTU epilogues assume 64-row ping-pong tiles (two rows a thread)");
  return cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
      make_identity_tensor(take<0, 2>(args.tile_shape_mnk)), args.epi_tile, args.tiled_copy, args.thread_idx);
}

// Forward leaf: (h·s, h·s) for each (gate_j, up_j) accumulator pair, h = SiTU(gate_j, up_j) and s the row's scale.
template <class TileShapeMNK>
struct Sm90SituForward : NoWorkspaceVisitor {
  struct SharedStorage {};
  struct Arguments {
    SituBetas betas;
    float const* row_scale = nullptr;  // [M] fp32, or none (1)
  };
  using Params = Arguments;
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  CUTLASS_HOST_DEVICE Sm90SituForward() {}
  CUTLASS_HOST_DEVICE Sm90SituForward(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr;

  template <class CTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ThreadRows<CTensor> rows, SituBetas betas) : rows(rows), betas(betas) {}
    ThreadRows<CTensor> rows;
    SituBetas betas;

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const& acc,
                                                             int epi_v, int, int) {
      static_assert(FragmentSize % 2 == 0, "accumulator pairs");
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        SituTerms t(acc[i], acc[i + 1], betas.inv_beta, betas.inv_linear_beta);
        out[i] = out[i + 1] = t.gate(betas.beta) * t.up(betas.linear_beta) * rows.scale[epi_v * FragmentSize + i];
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto tC_c = tile_coordinates<ReferenceSrc, TileShapeMNK>(args);
    int64_t m0 = static_cast<int64_t>(cute::get<0>(args.tile_coord_mnkl)) * cute::size<0>(TileShapeMNK{});
    return ConsumerStoreCallbacks<decltype(tC_c)>(ThreadRows<decltype(tC_c)>(tC_c, m0, params_ptr->row_scale),
                                                  params_ptr->betas);
  }
};

// Keeps fragment epi_v of a subtile's visited values, in bf16, in the thread's register tensor tC_r (compact, so
// its linear order is the fragments' order).
template <class RTensor, class ElementInput, int FragmentSize>
CUTLASS_DEVICE void keep_fragment(RTensor& tC_r, int epi_v, cutlass::Array<ElementInput, FragmentSize> const& frg) {
  cutlass::NumericArrayConverter<Bf16, ElementInput, FragmentSize> convert{};
  cute::recast<cutlass::Array<Bf16, FragmentSize>>(cute::coalesce(tC_r))(epi_v) = convert(frg);
}

// Stores the even columns of its input (one value per accumulator pair) as a compact [M, N/2] bf16 tensor, through
// shared memory and a TMA store per epilogue subtile: each thread keeps its values in registers during visit(),
// writes them to the stage's [EpiM, EpiN/2] smem tile in postreduce() (the collective then fences and syncs before
// its own TMA store), and the issuing thread stores the tile in tma_store(). The stages follow the collective's
// store iterations, so with Stages = its StagesD a stage is reused only after the stores that read it completed.
template <int Stages, int EpiM, int EpiN>
struct Sm90PairHalfTmaStore : NoWorkspaceVisitor {
  using StrideH = ExpertTileStrideAD;  // (ld, 1, 0): every group's tiles in one [M, N/2] tensor
  using SmemLayoutTma = cute::Layout<cute::Shape<cute::Int<EpiM>, cute::Int<EpiN / 2>>,
                                     cute::Stride<cute::Int<EpiN / 2>, cute::_1>>;
  using SmemLayout = cute::Layout<cute::Shape<cute::Int<EpiM>, cute::Int<EpiN / 2>, cute::Int<Stages>>,
                                  cute::Stride<cute::Int<EpiN / 2>, cute::_1, cute::Int<EpiM * EpiN / 2>>>;
  static constexpr int kStages = Stages;
  struct SharedStorage {
    alignas(128) cute::array_aligned<Bf16, cute::cosize_v<SmemLayout>> smem_h;
  };
  struct Arguments {
    Bf16* ptr = nullptr;  // [M, N/2], row stride N/2
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
                                                                  StrideH{static_cast<int64_t>(N / 2), {}, {}}));
    return {cute::make_tma_copy(cute::SM90_TMA_STORE{}, tensor_h, SmemLayoutTma{})};
  }
  CUTLASS_HOST_DEVICE Sm90PairHalfTmaStore() {}
  CUTLASS_HOST_DEVICE Sm90PairHalfTmaStore(Params const& params, SharedStorage const& shared)
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

// The first of two inputs.
template <class T>
struct TakeFirst {};
template <int N>
struct TakeFirst<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& a,
                                                     cutlass::Array<float, N> const&) const {
    return a;
  }
};

// D = the accumulators in bf16 (the pre-activations); h through Sm90PairHalfTmaStore. Epilogue subtiles 64x32.
using SituForwardTile = cute::Shape<cute::_64, cute::_256, cute::_64>;
constexpr int kSituEpiN = 32;
using SituForwardFusion = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<TakeFirst, Bf16, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90EVT<Sm90PairHalfTmaStore<2, 64, kSituEpiN>, Sm90SituForward<SituForwardTile>>>;

// The backward's node: an activation tag for CUTLASS's LinCombDeEltAct (D = act(acc, aux)), specialised below on
// packed pairs (the aux input and D are uint32, one (gate_j, up_j) bf16 pair each).
template <class T>
struct SituBackwardPairs {};

}  // namespace

namespace cutlass::epilogue::fusion {
template <FloatRoundStyle RoundStyle>
struct Sm90Compute<SituBackwardPairs, uint32_t, float, RoundStyle> : NoWorkspaceVisitor {
  struct SharedStorage {};
  struct Arguments {
    SituBetas betas;
    float const* row_scale = nullptr;  // [M] fp32, or none (1)
    float* ds = nullptr;               // [M] fp32: Σ_j dh·SiTU, or none; added to (atomically) when N > the tile's
    bool accumulate_ds = false;
  };
  using Params = Arguments;
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  CUTLASS_HOST_DEVICE Sm90Compute() {}
  CUTLASS_HOST_DEVICE Sm90Compute(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr;

  template <class CTensor>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ThreadRows<CTensor> rows, Params const* p) : rows(rows), params(p) {
      ds_part.fill(0.0f);
    }
    ThreadRows<CTensor> rows;
    Params const* params;
    Array<float, ThreadRows<CTensor>::kN> ds_part;  // Σ over the subtiles of dh·SiTU at each position

    template <typename ElementAccumulator, typename ElementInput, typename ElementAux, int FragmentSize>
    CUTLASS_DEVICE Array<uint32_t, FragmentSize> visit(Array<ElementAccumulator, FragmentSize> const&, int epi_v,
                                                       int, int,
                                                       Array<ElementInput, FragmentSize> const& frg_dh,
                                                       Array<ElementAux, FragmentSize> const& frg_pre) {
      Array<uint32_t, FragmentSize> out;
      SituBetas const& betas = params->betas;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int k = epi_v * FragmentSize + i;
        float dh = static_cast<float>(frg_dh[i]);
        uint32_t pair = static_cast<uint32_t>(frg_pre[i]);
        float a = __uint_as_float(pair << 16), c = __uint_as_float(pair & 0xffff0000u);  // bf16 -> fp32
        SituTerms t(a, c, betas.inv_beta, betas.inv_linear_beta);
        float beta = betas.beta;
        float g = t.gate(beta), h = t.up(betas.linear_beta);
        ds_part[k] = fmaf(dh, g * h, ds_part[k]);
        float dsh = dh * rows.scale[k];
        uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(dsh * h * t.dgate(beta)));
        uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(dsh * g * t.dup()));
        out[i] = lo | (hi << 16);
      }
      return out;
    }

    // The quad's four lanes hold the same two rows: sum over them, and lane 0 of the quad writes.
    CUTLASS_DEVICE void end() {
      if (params->ds == nullptr) return;
      float ds0 = 0.0f, ds1 = 0.0f;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < ThreadRows<CTensor>::kN; ++k) {
        bool on_second = (rows.second >> k) & 1u;
        ds0 += on_second ? 0.0f : ds_part[k];
        ds1 += on_second ? ds_part[k] : 0.0f;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
        ds0 += __shfl_xor_sync(0xffffffffu, ds0, lane_mask);
        ds1 += __shfl_xor_sync(0xffffffffu, ds1, lane_mask);
      }
      if (threadIdx.x % 4 != 0) return;
      float* out = params->ds + rows.m0 + rows.r0;
      if (params->accumulate_ds) {
        atomicAdd(out, ds0);
        atomicAdd(out + 8, ds1);
      } else {
        out[0] = ds0;
        out[8] = ds1;
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    using TileShapeMNK = decltype(args.tile_shape_mnk);
    auto tC_c = tile_coordinates<ReferenceSrc, TileShapeMNK>(args);
    int64_t m0 = static_cast<int64_t>(cute::get<0>(args.tile_coord_mnkl)) * cute::size<0>(TileShapeMNK{});
    return ConsumerStoreCallbacks<decltype(tC_c)>(ThreadRows<decltype(tC_c)>(tC_c, m0, params_ptr->row_scale),
                                                  params_ptr);
  }
};
}  // namespace cutlass::epilogue::fusion

namespace {

using SituBackwardFusion = cutlass::epilogue::fusion::LinCombDeEltAct<cutlass::layout::RowMajor, SituBackwardPairs,
                                                                      uint32_t, float, uint32_t>;

// The expert-tiled configuration 1 with a fusion of its own (C is never read).
template <class Fusion, int Mode, class ElementD>
struct SituGemm : PlainGemm<true, 64, 256, 64, 1, ExpertTileStrideAD, ExpertTileStrideB<Mode>, ExpertTileStrideAD,
                            ExpertTileSchedulerTag, Fusion, ElementD, void> {
  using Base = typename SituGemm::PlainGemm;
  using Gemm = typename Base::Gemm;

  static typename Gemm::Arguments arguments(const void* a, const void* b, void* d, const int* tile_expert, int groups,
                                            int M, int N, int K, int sm_count) {
    ExpertTileStrides<Mode> s(N, K);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kBatched,
                                  {M, N, K, groups},
                                  {static_cast<const Bf16*>(a), s.a, static_cast<const Bf16*>(b), s.b},
                                  {{}, nullptr, s.d, static_cast<ElementD*>(d), s.d}};
    args.hw_info.sm_count = sm_count;
    args.scheduler.tile_expert = tile_expert;
    return args;
  }
};

// P = x @ W13_e^T and h (module comment): x [M, K], w13 [G, N, K] (k-major), P [M, N], h [M, N/2].
struct SituForwardGemm : SituGemm<SituForwardFusion, 0, Bf16> {
  static_assert(Base::Epilogue::DispatchPolicy::StagesD == Sm90PairHalfTmaStore<2, 64, kSituEpiN>::kStages,
                "h's smem stages follow D's");
  static typename Gemm::Arguments arguments(const void* x, const void* w13, void* pre, void* h, const int* tile_expert,
                                            int groups, int M, int N, int K, int sm_count, const float* row_scale,
                                            SituBetas betas) {
    auto args = SituGemm::arguments(x, w13, pre, tile_expert, groups, M, N, K, sm_count);
    args.epilogue.thread = {{}, {{betas, row_scale}, {static_cast<Bf16*>(h)}}, {}};
    return args;
  }
};

// dP and ds (module comment): dy [M, K], w2 [G, K, N] (n-major: a [K, N] weight per group), pre [M, 2N] bf16 read as
// [M, N] pairs, dP [M, 2N] written as [M, N] pairs.
struct SituBackwardGemm : SituGemm<SituBackwardFusion, 1, uint32_t> {
  static typename Gemm::Arguments arguments(const void* dy, const void* w2, const void* pre, void* d_pre,
                                            const int* tile_expert, int groups, int M, int N, int K, int sm_count,
                                            const float* row_scale, float* ds, SituBetas betas) {
    auto args = SituGemm::arguments(dy, w2, d_pre, tile_expert, groups, M, N, K, sm_count);
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.aux_ptr = static_cast<const uint32_t*>(pre);
    args.epilogue.thread.dAux = {static_cast<int64_t>(N), cute::_1{}, int64_t(0)};
    args.epilogue.thread.activation = {betas, row_scale, ds, N > 256};
    return args;
  }
};
