// Quantized linear kernels for x86 CPUs with AVX2 + FMA (and no AVX-512).
//
// aten's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu vectorize only under AVX-512; on an
// AVX2-only host they run a scalar loop, compute-bound well above the memory-bandwidth floor that a
// quantized decode step should reach. These kernels widen the quantized weights to fp32 in registers
// and accumulate in fp32 (weight-only int8 / int4), or multiply int8 x int8 into int32 with
// vpmaddubsw (int8 dynamic), so a step's weights stream from memory about once.
//
//   int8_weight_linear(x [M, K], qweight int8 [N, K], scale f32 [N])          -> [M, N] in x's dtype
//   int4_weight_linear(x [M, K], packed u8 [N, Kp/2], scale [N, K/group], zero [N, K/group], group)
//                                                                               -> [M, N]
//       tinygemm's asymmetric grouping: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], q in
//       0..15, scale and zero in the model dtype; Kp = K rounded up to 64 (layout below).
//   int8_dynamic_linear(x [M, K], qweight int8 [N, K], scale f32 [N])          -> [M, N]
//       x quantized per row, symmetric: s = max(|x|) / 127 (>= 1e-9), q = round_half_even(x / s).
//
// Blocks of NB weight rows x MB activation rows keep their accumulators in registers; the weight
// rows of a block are widened once and reused for every activation row. Threads split the output
// features (at::parallel_for, i.e. torch's intra-op pool and its thread count).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "common.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using llmserve::hsum;

inline __m256 widen_i8(const int8_t* p) {  // 8 x int8 -> 8 x f32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Activation rows per register block, and weight rows: M=1 (decode at batch 1) is bound by widening
// the weights, so it takes more weight rows; larger M reuses each widened weight vector MB times.
constexpr int kMaxMB = 4;
constexpr int kNB = 4;
constexpr int kNBMulti = 2;
// Weight streams are prefetched this many register blocks ahead: the hardware prefetcher alone left
// the int8 kernel at ~6 GB/s here (a step's 122 MB of int8 weights in 20 ms; 12 ms with this).
constexpr int kPrefetchBlocks = 2;

// ---- int8 weight-only ---------------------------------------------------------------------------

inline __m256 load_weights8(const int8_t* p) { return widen_i8(p); }
inline __m256 load_weights8(const float* p) { return _mm256_loadu_ps(p); }

// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k], for int8 weights or an fp32 panel (scale null).
template <int MB, int NB, typename weight_t, typename out_t>
void gemm_block(const float* x, int64_t K, const weight_t* w, const float* scale, out_t* out, int64_t ldo) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (k % 64 == 0)  // one cache line per row: fetch the same line of the next block's rows
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchBlocks * NB + j) * K + k), _MM_HINT_T0);
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_weights8(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) sum += x[i * K + t] * static_cast<float>(w[j * K + t]);
      out[i * ldo + j] = static_cast<out_t>(scale ? sum * scale[j] : sum);
    }
}

// ---- int4 weight-only (grouped, asymmetric) -----------------------------------------------------
//
// Packed layout: each row's in_features are zero-padded to a multiple of 64; per 64-wide block b,
// eight little-endian 32-bit words, word i holding weight 64b + 8t + i in bits 4t..4t+3 (t = 0..7).
// ANDing word i with 0xF << 4t and converting to float gives q * 16^t exactly (t = 7 shifts down
// instead, keeping the value positive), so the activations are pre-scaled by 16^-t (exact powers of
// two) once per call and one AND + one convert widen 8 weights: the same cost per weight as int8.
// For one activation row (decode at batch 1, bound by widening the weights) the kernel accumulates
// x . q per group and folds in (q - 8) * s + z as s * (x . q) + (z - 8 s) * sum(x over the group).

constexpr int64_t kInt4Block = 64;

template <int T>
inline __m256 nibble_plane(__m256i words) {  // lane i: weight 8T + i of the block, times 16^T (T < 7)
  if constexpr (T == 7) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(words, 28));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xF << (4 * T))));
  }
}

// x_planes [M, Kp]: x pre-scaled per plane; x_sum [M, groups]. SPLIT: group 32, so the two halves
// of a 64-block (planes 0-3, 4-7) belong to different groups.
template <int MB, int NB, bool SPLIT, typename out_t, typename scale_t>
void int4_block(const float* x_planes, int64_t Kp, const float* x_sum, int64_t K, const uint8_t* w,
                const scale_t* scale, const scale_t* zero, int64_t group, out_t* out, int64_t ldo) {
  const int64_t groups = K / group, blocks = Kp / kInt4Block, row_bytes = Kp / 2;
  const int64_t blocks_per_group = SPLIT ? 1 : group / kInt4Block;
  __m256 total[MB][NB], acc[MB][NB], acc_hi[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) total[i][j] = acc[i][j] = acc_hi[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int j = 0; j < NB; ++j) {
      const uint8_t* row = w + j * row_bytes + b * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchBlocks * NB * row_bytes), _MM_HINT_T0);
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      const float* xb = x_planes + b * kInt4Block;
      auto plane = [&](auto t_const, __m256 (&dst)[MB][NB]) {
        constexpr int T = decltype(t_const)::value;
        const __m256 q = nibble_plane<T>(words);
        for (int i = 0; i < MB; ++i) dst[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * Kp + 8 * T), q, dst[i][j]);
      };
      plane(std::integral_constant<int, 0>{}, acc);
      plane(std::integral_constant<int, 1>{}, acc);
      plane(std::integral_constant<int, 2>{}, acc);
      plane(std::integral_constant<int, 3>{}, acc);
      plane(std::integral_constant<int, 4>{}, SPLIT ? acc_hi : acc);
      plane(std::integral_constant<int, 5>{}, SPLIT ? acc_hi : acc);
      plane(std::integral_constant<int, 6>{}, SPLIT ? acc_hi : acc);
      plane(std::integral_constant<int, 7>{}, SPLIT ? acc_hi : acc);
    }
    if (SPLIT || (b + 1) % blocks_per_group == 0 || b + 1 == blocks) {  // fold the finished group(s)
      const int64_t g = SPLIT ? 2 * b : b / blocks_per_group;
      for (int j = 0; j < NB; ++j) {
        const __m256 s_lo = _mm256_set1_ps(static_cast<float>(scale[j * groups + g]));
        const __m256 s_hi = SPLIT && g + 1 < groups ? _mm256_set1_ps(static_cast<float>(scale[j * groups + g + 1]))
                                                    : _mm256_setzero_ps();  // beyond K: zero padding
        for (int i = 0; i < MB; ++i) {
          total[i][j] = _mm256_fmadd_ps(acc[i][j], s_lo, total[i][j]);
          acc[i][j] = _mm256_setzero_ps();
          if (SPLIT) {
            total[i][j] = _mm256_fmadd_ps(acc_hi[i][j], s_hi, total[i][j]);
            acc_hi[i][j] = _mm256_setzero_ps();
          }
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float sum = hsum(total[i][j]);
      for (int64_t g = 0; g < groups; ++g) {
        const float s = static_cast<float>(scale[j * groups + g]);
        sum += (static_cast<float>(zero[j * groups + g]) - 8.f * s) * x_sum[i * groups + g];
      }
      out[i * ldo + j] = static_cast<out_t>(sum);
    }
}

// Several activation rows: dequantize a panel of weight rows to fp32 once, (q - 8) * s + z with the
// plane's 16^t folded into the scale, then run the fp32 register-block kernel over every activation
// row, so each weight is widened once per call rather than once per block of activation rows.
constexpr int64_t kPanelRows = 8;
// Up to this many activation rows, the one-row nibble-plane kernel runs once per row instead: it
// widens 8 weights in ~3 ops against ~4 + 2 per row for a panel (MoE experts at batch 16 see 1-3 rows).
constexpr int64_t kInt4PlanesMaxRows = 2;

template <typename scale_t>
void dequantize_int4_rows(const uint8_t* w, int64_t rows, int64_t Kp, int64_t K, const scale_t* scale,
                          const scale_t* zero, int64_t group, float* panel) {
  const int64_t groups = K / group, blocks = Kp / kInt4Block, row_bytes = Kp / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + b * 32));
      __m256 s[2], o[2];
      for (int half = 0; half < 2; ++half) {
        const int64_t g = std::min((b * kInt4Block + 32 * half) / group, groups - 1);  // padding meets x = 0
        const float sv = static_cast<float>(scale[r * groups + g]);
        s[half] = _mm256_set1_ps(sv);
        o[half] = _mm256_set1_ps(static_cast<float>(zero[r * groups + g]) - 8.f * sv);
      }
      float* dst = panel + r * Kp + b * kInt4Block;
      auto plane = [&](auto t_const) {
        constexpr int T = decltype(t_const)::value;
        const __m256 unit = _mm256_set1_ps(T == 7 ? 1.f : 1.f / float(1 << (4 * T)));  // undo the plane's 16^T
        const int half = T < 4 ? 0 : 1;
        _mm256_storeu_ps(dst + 8 * T, _mm256_fmadd_ps(nibble_plane<T>(words), _mm256_mul_ps(s[half], unit), o[half]));
      };
      plane(std::integral_constant<int, 0>{});
      plane(std::integral_constant<int, 1>{});
      plane(std::integral_constant<int, 2>{});
      plane(std::integral_constant<int, 3>{});
      plane(std::integral_constant<int, 4>{});
      plane(std::integral_constant<int, 5>{});
      plane(std::integral_constant<int, 6>{});
      plane(std::integral_constant<int, 7>{});
    }
}

// ---- int8 dynamic (int8 activations x int8 weights -> int32) ------------------------------------

template <int MB, int NB, typename out_t>
void int8dq_block(const int8_t* xq, int64_t K, const float* x_scale, const int8_t* w, const float* scale,
                  out_t* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (k % 64 == 0)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchBlocks * NB + j) * K + k), _MM_HINT_T0);
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
    for (int i = 0; i < MB; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + k));
      const __m256i x_abs = _mm256_sign_epi8(xv, xv);  // |x| as u8 (x >= -127)
      for (int j = 0; j < NB; ++j) {
        // u8 x s8 pairs summed to s16: at most 2 * 127 * 127 = 32258, no saturation.
        const __m256i pairs = _mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(wv[j], xv));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      int32_t sum = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) sum += int32_t(xq[i * K + t]) * int32_t(w[j * K + t]);
      out[i * ldo + j] = static_cast<out_t>(static_cast<float>(sum) * x_scale[i] * scale[j]);
    }
}

// ---- blocking and threading ---------------------------------------------------------------------

// Calls block<MB, NB>(m, n) over an [M, N] output: full register blocks, then the edges.
template <int NB, typename Block>
void tile(int64_t M, int64_t n_begin, int64_t n_end, Block&& block) {
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) {
    int64_t m = 0;
    for (; m + kMaxMB <= M; m += kMaxMB) block.template run<kMaxMB, NB>(m, n);
    switch (M - m) {
      case 3: block.template run<3, NB>(m, n); break;
      case 2: block.template run<2, NB>(m, n); break;
      case 1: block.template run<1, NB>(m, n); break;
      default: break;
    }
  }
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < M; ++m) block.template run<1, 1>(m, n);
  }
}

// NB_ONE weight rows per block for one activation row, NB_MULTI for several.
template <int NB_ONE = kNB, int NB_MULTI = kNBMulti, typename Block>
void parallel_tiles(int64_t M, int64_t N, int64_t K, Block&& block) {
  // Each task gets at least ~64k weights, so small layers do not pay for a thread hand-off.
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    if (M == 1)
      tile<NB_ONE>(M, begin, end, block);
    else
      tile<NB_MULTI>(M, begin, end, block);
  });
}

template <typename out_t>
struct Int8Block {
  const float* x; const int8_t* w; const float* scale; out_t* out; int64_t N, K;
  template <int MB, int NB>
  void run(int64_t m, int64_t n) const {
    gemm_block<MB, NB>(x + m * K, K, w + n * K, scale + n, out + m * N + n, N);
  }
};

template <typename out_t, typename scale_t, bool SPLIT>
struct Int4PlanesBlock {
  const float* x_planes; const float* x_sum; const uint8_t* w; const scale_t* scale; const scale_t* zero;
  out_t* out; int64_t N, K, Kp, group;
  template <int MB, int NB>
  void run(int64_t m, int64_t n) const {
    const int64_t groups = K / group;
    int4_block<MB, NB, SPLIT>(x_planes + m * Kp, Kp, x_sum + m * groups, K, w + n * Kp / 2, scale + n * groups,
                              zero + n * groups, group, out + m * N + n, N);
  }
};

template <typename Block>
struct OneRow {  // a block kernel restricted to activation row `row`
  const Block& block; int64_t row;
  template <int MB, int NB>
  void run(int64_t, int64_t n) const { block.template run<MB, NB>(row, n); }
};

template <typename out_t>
struct Fp32PanelBlock {  // activation rows x a dequantized panel; n is relative to the panel
  const float* x; const float* panel; out_t* out; int64_t N, Kp;
  template <int MB, int NB>
  void run(int64_t m, int64_t n) const {
    gemm_block<MB, NB>(x + m * Kp, Kp, panel + n * Kp, static_cast<const float*>(nullptr), out + m * N + n, N);
  }
};

template <typename out_t>
struct Int8DynamicBlock {
  const int8_t* xq; const float* x_scale; const int8_t* w; const float* scale; out_t* out; int64_t N, K;
  template <int MB, int NB>
  void run(int64_t m, int64_t n) const {
    int8dq_block<MB, NB>(xq + m * K, K, x_scale + m, w + n * K, scale + n, out + m * N + n, N);
  }
};

// Both int8 ops: x [rows, K], contiguous int8 qweight [N, K], float32 scale [N].
void check_int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in_features]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar, op,
              ": qweight must be a contiguous int8 matrix");
  TORCH_CHECK(w.size(1) == x.size(1), op, ": x has ", x.size(1), " features, the weight ", w.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == w.size(0), op,
              ": scale must be contiguous float32 with one value per output feature");
}

at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  check_int8_linear(x, qweight, scale, "int8_weight_linear");
  const auto x32 = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1);
  auto out = at::empty({M, N}, x.options());
  llmserve::dispatch_float(out.scalar_type(), "int8_weight_linear", [&](auto out_zero) {
    using out_t = decltype(out_zero);
    Int8Block<out_t> block{x32.data_ptr<float>(), qweight.data_ptr<int8_t>(), scale.data_ptr<float>(),
                           out.data_ptr<out_t>(), N, K};
    parallel_tiles(M, N, K, block);
  });
  return out;
}

at::Tensor int4_weight_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "int4_weight_linear: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2, "int4_weight_linear: x must be [rows, in_features]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4_weight_linear: packed must be a contiguous uint8 matrix");
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1);
  const int64_t Kp = (K + kInt4Block - 1) / kInt4Block * kInt4Block;
  TORCH_CHECK(packed.size(1) * 2 == Kp, "int4_weight_linear: x has ", K, " features, the packed weight ",
              packed.size(1) * 2, " (padded to a multiple of 64)");
  TORCH_CHECK(group % 32 == 0 && K % group == 0 && (group == 32 || group % kInt4Block == 0), "int4_weight_linear: group ",
              group, " must be 32 or a multiple of 64, dividing in_features ", K);
  const int64_t groups = K / group;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == groups && scale.is_contiguous() &&
                  zero.sizes() == scale.sizes() && zero.scalar_type() == scale.scalar_type() && zero.is_contiguous(),
              "int4_weight_linear: scale and zero must be contiguous [out_features, in_features / group] "
              "tensors of one dtype");
  const auto x32 = x.to(at::kFloat).contiguous();
  const float* xp = x32.data_ptr<float>();
  auto out = at::empty({M, N}, x.options());
  if (M > kInt4PlanesMaxRows) {
    auto x_padded = Kp == K ? x32 : at::constant_pad_nd(x32, {0, Kp - K});
    const float* xpad = x_padded.data_ptr<float>();
    const uint8_t* w = packed.data_ptr<uint8_t>();
    llmserve::dispatch_float(out.scalar_type(), "int4_weight_linear", [&](auto out_zero) {
      using out_t = decltype(out_zero);
      llmserve::dispatch_float(scale.scalar_type(), "int4_weight_linear", [&](auto scale_zero) {
        using scale_t = decltype(scale_zero);
        const scale_t* scales = scale.data_ptr<scale_t>();
        const scale_t* zeros = zero.data_ptr<scale_t>();
        out_t* outp = out.data_ptr<out_t>();
        at::parallel_for(0, (N + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> panel(kPanelRows * Kp);
          for (int64_t p = begin; p < end; ++p) {
            const int64_t n0 = p * kPanelRows, rows = std::min(kPanelRows, N - n0);
            dequantize_int4_rows(w + n0 * Kp / 2, rows, Kp, K, scales + n0 * groups, zeros + n0 * groups, group,
                                 panel.data());
            tile<kNBMulti>(M, 0, rows, Fp32PanelBlock<out_t>{xpad, panel.data(), outp + n0, N, Kp});
          }
        });
      });
    });
    return out;
  }
  // Few rows: each row's activation per nibble plane (x * 16^-t, zero beyond K) and per-group sums.
  auto x_planes = at::zeros({M, Kp}, x32.options());
  auto x_sum = at::zeros({M, groups}, x32.options());
  float* planes = x_planes.data_ptr<float>();
  float* sums = x_sum.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const int t = (k % kInt4Block) / 8;
      planes[m * Kp + k] = t == 7 ? xp[m * K + k] : std::ldexp(xp[m * K + k], -4 * t);
      sums[m * groups + k / group] += xp[m * K + k];
    }
  llmserve::dispatch_float(out.scalar_type(), "int4_weight_linear", [&](auto out_zero) {
    using out_t = decltype(out_zero);
    llmserve::dispatch_float(scale.scalar_type(), "int4_weight_linear", [&](auto scale_zero) {
      using scale_t = decltype(scale_zero);
      auto run = [&](auto split) {
        Int4PlanesBlock<out_t, scale_t, decltype(split)::value> block{
            planes, sums, packed.data_ptr<uint8_t>(), scale.data_ptr<scale_t>(), zero.data_ptr<scale_t>(),
            out.data_ptr<out_t>(), N, K, Kp, group};
        constexpr int NB = decltype(split)::value ? 2 : 4;
        const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / K);
        at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
          for (int64_t m = 0; m < M; ++m) tile<NB>(1, begin, end, OneRow<decltype(block)>{block, m});
        });
      };
      if (group == 32)
        run(std::true_type{});
      else
        run(std::false_type{});
    });
  });
  return out;
}

at::Tensor int8_dynamic_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  check_int8_linear(x, qweight, scale, "int8_dynamic_linear");
  const auto x32 = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1);
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto x_scale = at::empty({M}, x.options().dtype(at::kFloat));
  const float* xp = x32.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xsp = x_scale.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {  // per-row symmetric quantization, as the fp32 reference does it
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[m * K + k]));
    const float s = std::max(amax / 127.f, 1e-9f);
    xsp[m] = s;
    for (int64_t k = 0; k < K; ++k)
      xqp[m * K + k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xp[m * K + k] / s))));
  }
  auto out = at::empty({M, N}, x.options());
  llmserve::dispatch_float(out.scalar_type(), "int8_dynamic_linear", [&](auto out_zero) {
    using out_t = decltype(out_zero);
    Int8DynamicBlock<out_t> block{xqp, xsp, qweight.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                  out.data_ptr<out_t>(), N, K};
    parallel_tiles(M, N, K, block);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(llmserve_cpu, m) {
  m.def("int8_weight_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
  m.def("int4_weight_linear(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group) -> Tensor");
  m.def("int8_dynamic_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
  m.impl("int4_weight_linear", &int4_weight_linear);
  m.impl("int8_dynamic_linear", &int8_dynamic_linear);
}
