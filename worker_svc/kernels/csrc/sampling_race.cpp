// Sampling's random race in one pass (worker_svc/sampling/noise.py defines the noise; sampler.py calls this):
//
//   gumbel_race(x [R, >= V] f32 / bf16 / f16, inv_temperature [R] f32, threshold [R] f32, keys [R] i64,
//               steps [R] i64, V, isa, sampled [R] bool or None) -> [R] i64
//     token = the first v < V maximizing s_v + g_v among the columns with s_v = x_v * inv_temperature >= threshold;
//     a row with sampled false takes no noise (g = 0: the greedy argmax), so a batch mixing greedy and sampled
//     rows is one call;
//   gumbel_noise(keys [R] i64, steps [R] i64, V) -> [R, V] f32: the g_v themselves (tests, the torch path's check).
//   Both take isa: 0 (auto), 1 (AVX2), 2 (AVX-512).
//
// g_v = -log(-log(u_v)) is Gumbel noise, so the race samples softmax(s) over the kept columns (Gumbel-max). u_v is
// the Philox4x32-10 uniform of (key, step, v): column v of a 64-column block b is word v % 64 / 16 of the Philox
// block with counter (16 b + v % 16, step low 32 bits, step high 32 bits, 0) under the key's two halves, as
// ((word >> 9) + 0.5) / 2^23, in (0, 1) exactly. That layout gives a 16-lane register a Philox block per lane
// and four consecutive 16-column runs from its four words. A counter-based generator has no state to carry:
// a request's step number is its position, so a retracted and resumed request draws what it would have drawn.
//
// Why: per-request torch generators (mt19937, one thread, V uniforms per row), then float copies, exp, log,
// divide and argmax over [R, V] took 16 ms of a 64-request SmolLM2 step (V = 49,152) whose forward takes ~45.
// log() is Cephes' logf (~1 ulp), so noise can differ from torch.log's in the last place and a token only where
// two columns' scores tie to that precision.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "avx512.h"
#include "common.h"

namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // Philox4x32 round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
constexpr int64_t kBlock = 64;                                   // columns per 16 Philox blocks
constexpr int64_t kChunk = 128 * kBlock;                         // columns per parallel task
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Best {
  float score;
  int64_t index;
};

constexpr int64_t kNoColumn = std::numeric_limits<int64_t>::max();  // a Best that kept nothing
constexpr int32_t kNoLane = std::numeric_limits<int32_t>::max();     // a register lane that kept nothing

// Folds a candidate into b: higher score wins; on equal scores the lower column (torch.argmax's first
// occurrence). A candidate with kNoColumn is skipped.
inline void fold(Best& b, float score, int64_t index) {
  if (index != kNoColumn && (score > b.score || (score == b.score && index < b.index))) b = {score, index};
}

// The best of a register's lanes, stored to memory.
inline Best best_of_lanes(const float* scores, const int32_t* at, int lanes) {
  Best out{kNegInf, kNoColumn};
  for (int i = 0; i < lanes; ++i)
    if (at[i] != kNoLane) fold(out, scores[i], at[i]);
  return out;
}

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

// ---- AVX-512: 16 Philox blocks at a time ------------------------------------------------------------------

// (hi, lo) of the 16 products a * m (32 x 32 -> 64 bits each).
LLMSERVE_AVX512 inline void mulhilo16(__m512i a, uint32_t m, __m512i& hi, __m512i& lo) {
  const __m512i mv = _mm512_set1_epi32(static_cast<int>(m));
  const __m512i even = _mm512_mul_epu32(a, mv);                         // dwords 0, 2, ...: 64-bit products
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), mv);  // dwords 1, 3, ...
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// Cephes' logf on 16 positive normal lanes: x = f 2^e with f in [sqrt(1/2), sqrt(2)), log f by a degree-8 polynomial.
LLMSERVE_AVX512 inline __m512 log16(__m512 x) {
  __m512 f = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  __m512 e = _mm512_getexp_ps(x);
  const __mmask16 big = _mm512_cmp_ps_mask(f, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  f = _mm512_mask_mul_ps(f, big, f, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  const __m512 t = _mm512_sub_ps(f, _mm512_set1_ps(1.f));
  const __m512 z = _mm512_mul_ps(t, t);
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.1514610310e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.1676998740e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.2420140846e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.4249322787e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.6668057665e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(2.0000714765e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-2.4999993993e-1f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(3.3333331174e-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, t), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(t, y));
}

// The Gumbel noise of the 64 columns of block b: g[k] holds columns 64 b + 16 k + lane.
LLMSERVE_AVX512 inline void noise_block16(int64_t b, uint32_t key0, uint32_t key1, uint32_t step0, uint32_t step1,
                                          __m512 g[4]) {
  __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(16 * b)),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i c1 = _mm512_set1_epi32(static_cast<int>(step0)), c2 = _mm512_set1_epi32(static_cast<int>(step1));
  __m512i c3 = _mm512_setzero_si512();
  uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    if (round) k0 += kWeyl0, k1 += kWeyl1;
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(c0, kMul0, hi0, lo0);
    mulhilo16(c2, kMul1, hi1, lo1);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
    c1 = lo1;
    c3 = lo0;
  }
  const __m512i words[4] = {c0, c1, c2, c3};
  for (int k = 0; k < 4; ++k) {
    // ((w >> 9) * 2 + 1) / 2^24: exact in fp32, in (0, 1).
    const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(words[k], 9), 1), _mm512_set1_epi32(1));
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(5.9604644775390625e-8f));
    const __m512 minus_log_u = _mm512_sub_ps(_mm512_setzero_ps(), log16(u));
    g[k] = _mm512_sub_ps(_mm512_setzero_ps(), log16(minus_log_u));
  }
}

LLMSERVE_AVX512 inline __m512 load_scores16(const float* p) { return _mm512_loadu_ps(p); }
template <typename T>
LLMSERVE_AVX512 inline __m512 load_scores16(const T* p) { return llmserve::load16(p); }

// The best (score, column) of x's columns [begin, end) (begin a multiple of 64).
template <typename T>
LLMSERVE_AVX512 Best race_avx512(const T* x, int64_t begin, int64_t end, float inv_t, float threshold, bool noisy,
                                 uint32_t key0, uint32_t key1, uint32_t step0, uint32_t step1) {
  __m512 best = _mm512_set1_ps(kNegInf);
  __m512i best_at = _mm512_set1_epi32(kNoLane);
  const __m512 scale = _mm512_set1_ps(inv_t), floor = _mm512_set1_ps(threshold);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float tail[kBlock];
  for (int64_t col = begin; col < end; col += kBlock) {
    const float* xf = nullptr;
    const T* xt = x + col;
    if (col + kBlock > end) {  // the row's last, partial block: -inf past its end
      for (int64_t i = 0; i < kBlock; ++i) tail[i] = col + i < end ? widen(x[col + i]) : kNegInf;
      xf = tail;
    }
    __m512 g[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if (noisy) noise_block16(col / kBlock, key0, key1, step0, step1, g);
    for (int k = 0; k < 4; ++k) {
      const __m512 s = _mm512_mul_ps(xf ? load_scores16(xf + 16 * k) : load_scores16(xt + 16 * k), scale);
      const __mmask16 kept = _mm512_cmp_ps_mask(s, floor, _CMP_GE_OQ);
      const __m512 score = _mm512_add_ps(s, g[k]);
      // Strictly greater: a lane's earlier column keeps a tie (its columns only increase).
      const __mmask16 win = _mm512_mask_cmp_ps_mask(kept, score, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, win, score);
      best_at = _mm512_mask_mov_epi32(best_at, win,
                                      _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(col + 16 * k))));
    }
  }
  alignas(64) float scores[16];
  alignas(64) int32_t at[16];
  _mm512_store_ps(scores, best);
  _mm512_store_si512(reinterpret_cast<__m512i*>(at), best_at);
  return best_of_lanes(scores, at, 16);
}

LLMSERVE_AVX512 void noise_row_avx512(float* out, int64_t V, uint32_t key0, uint32_t key1, uint32_t step0,
                                      uint32_t step1) {
  for (int64_t col = 0; col < V; col += kBlock) {
    __m512 g[4];
    noise_block16(col / kBlock, key0, key1, step0, step1, g);
    alignas(64) float block[kBlock];
    for (int k = 0; k < 4; ++k) _mm512_store_ps(block + 16 * k, g[k]);
    std::copy(block, block + std::min(kBlock, V - col), out + col);
  }
}

// ---- AVX2: each block's 16 Philox lanes as two halves of 8 ------------------------------------------------

inline void mulhilo8(__m256i a, uint32_t m, __m256i& hi, __m256i& lo) {
  const __m256i mv = _mm256_set1_epi32(static_cast<int>(m));
  const __m256i even = _mm256_mul_epu32(a, mv);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), mv);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Cephes' logf on 8 positive normal lanes (as log16).
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  __m256 f = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F800000)));
  const __m256 big = _mm256_cmp_ps(f, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  f = _mm256_blendv_ps(f, _mm256_mul_ps(f, _mm256_set1_ps(0.5f)), big);
  e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.f)));
  const __m256 t = _mm256_sub_ps(f, _mm256_set1_ps(1.f));
  const __m256 z = _mm256_mul_ps(t, t);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, t), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(t, y));
}

// Half h (lanes 8 h .. 8 h + 7) of block b: g[k] holds columns 64 b + 16 k + 8 h + lane.
inline void noise_half8(int64_t b, int h, uint32_t key0, uint32_t key1, uint32_t step0, uint32_t step1, __m256 g[4]) {
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(16 * b + 8 * h)),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(static_cast<int>(step0)), c2 = _mm256_set1_epi32(static_cast<int>(step1));
  __m256i c3 = _mm256_setzero_si256();
  uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    if (round) k0 += kWeyl0, k1 += kWeyl1;
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, kMul0, hi0, lo0);
    mulhilo8(c2, kMul1, hi1, lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lo1;
    c3 = lo0;
  }
  const __m256i words[4] = {c0, c1, c2, c3};
  for (int k = 0; k < 4; ++k) {
    const __m256 u = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(words[k], 9), 1), _mm256_set1_epi32(1))),
        _mm256_set1_ps(5.9604644775390625e-8f));
    const __m256 minus_log_u = _mm256_sub_ps(_mm256_setzero_ps(), log8(u));
    g[k] = _mm256_sub_ps(_mm256_setzero_ps(), log8(minus_log_u));
  }
}

template <typename T>
Best race_avx2(const T* x, int64_t begin, int64_t end, float inv_t, float threshold, bool noisy, uint32_t key0,
               uint32_t key1, uint32_t step0, uint32_t step1) {
  __m256 best = _mm256_set1_ps(kNegInf);
  __m256i best_at = _mm256_set1_epi32(kNoLane);
  const __m256 scale = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(threshold);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float tail[kBlock];
  for (int64_t col = begin; col < end; col += kBlock) {
    const bool partial = col + kBlock > end;
    if (partial)
      for (int64_t i = 0; i < kBlock; ++i) tail[i] = col + i < end ? widen(x[col + i]) : kNegInf;
    for (int h = 0; h < 2; ++h) {
      __m256 g[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      if (noisy) noise_half8(col / kBlock, h, key0, key1, step0, step1, g);
      for (int k = 0; k < 4; ++k) {
        const int64_t at = 16 * k + 8 * h;
        const __m256 s = _mm256_mul_ps(partial ? _mm256_load_ps(tail + at) : llmserve::load8(x + col + at), scale);
        const __m256 kept = _mm256_cmp_ps(s, floor, _CMP_GE_OQ);
        const __m256 score = _mm256_add_ps(s, g[k]);
        // Strictly greater within a lane; lanes meet at the end, lower column first on equal scores.
        const __m256 win = _mm256_and_ps(kept, _mm256_cmp_ps(score, best, _CMP_GT_OQ));
        best = _mm256_blendv_ps(best, score, win);
        best_at = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(best_at),
            _mm256_castsi256_ps(_mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(col + at)))), win));
      }
    }
  }
  alignas(32) float scores[8];
  alignas(32) int32_t at[8];
  _mm256_store_ps(scores, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(at), best_at);
  return best_of_lanes(scores, at, 8);
}

void noise_row_avx2(float* out, int64_t V, uint32_t key0, uint32_t key1, uint32_t step0, uint32_t step1) {
  for (int64_t col = 0; col < V; col += kBlock) {
    alignas(32) float block[kBlock];
    for (int h = 0; h < 2; ++h) {
      __m256 g[4];
      noise_half8(col / kBlock, h, key0, key1, step0, step1, g);
      for (int k = 0; k < 4; ++k) _mm256_store_ps(block + 16 * k + 8 * h, g[k]);
    }
    std::copy(block, block + std::min(kBlock, V - col), out + col);
  }
}

// ---- ops ---------------------------------------------------------------------------------------------------

struct RowKey {
  uint32_t key0, key1, step0, step1;
};

RowKey row_key(const int64_t* keys, const int64_t* steps, int64_t r) {
  const auto key = static_cast<uint64_t>(keys[r]), step = static_cast<uint64_t>(steps[r]);
  return {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), static_cast<uint32_t>(step),
          static_cast<uint32_t>(step >> 32)};
}

// isa: 0 the best this CPU runs, 1 AVX2, 2 AVX-512 (tests run each path the host can).
bool use_avx512(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "isa must be 0 (auto), 1 (AVX2) or 2 (AVX-512)");
  TORCH_CHECK(isa != 2 || llmserve::cpu_has_avx512(), "isa 2: this CPU lacks AVX-512 F/BW/VL/DQ");
  return isa == 2 || (isa == 0 && llmserve::cpu_has_avx512());
}

void check_rows(const at::Tensor& keys, const at::Tensor& steps, int64_t rows) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && steps.scalar_type() == at::kLong, "keys and steps must be int64");
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == rows && steps.dim() == 1 && steps.size(0) == rows,
              "keys and steps must be [", rows, "]");
}

at::Tensor gumbel_race(const at::Tensor& x, const at::Tensor& inv_temperature, const at::Tensor& threshold,
                       const at::Tensor& keys, const at::Tensor& steps, int64_t V, int64_t isa,
                       const std::optional<at::Tensor>& sampled) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gumbel_race: x must be [R, V'] with contiguous rows");
  const int64_t R = x.size(0);
  TORCH_CHECK(V >= 1 && V <= x.size(1) && V < (int64_t(1) << 31), "gumbel_race: V must lie in [1, x.size(1)]");
  check_rows(keys, steps, R);
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && threshold.scalar_type() == at::kFloat &&
                  inv_temperature.numel() == R && threshold.numel() == R,
              "gumbel_race: inv_temperature and threshold must be float32 [R]");
  const at::Tensor keys_c = keys.contiguous(), steps_c = steps.contiguous();
  const at::Tensor inv_t = inv_temperature.contiguous(), floor = threshold.contiguous();
  TORCH_CHECK(!sampled || (sampled->scalar_type() == at::kBool && sampled->numel() == R),
              "gumbel_race: sampled must be bool [R]");
  const at::Tensor noisy = sampled ? sampled->contiguous() : at::ones({R}, x.options().dtype(at::kBool));
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  std::vector<Best> best(R * chunks);
  const bool avx512 = use_avx512(isa);
  llmserve::dispatch_float(x.scalar_type(), "gumbel_race", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const int64_t* kp = keys_c.data_ptr<int64_t>();
    const int64_t* sp = steps_c.data_ptr<int64_t>();
    const float* tp = inv_t.data_ptr<float>();
    const float* fp = floor.data_ptr<float>();
    const bool* np = noisy.data_ptr<bool>();
    at::parallel_for(0, R * chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t r = task / chunks, begin = (task % chunks) * kChunk, end = std::min(V, begin + kChunk);
        const RowKey k = row_key(kp, sp, r);
        const T* row = xp + r * x.stride(0);
        best[task] = avx512 ? race_avx512(row, begin, end, tp[r], fp[r], np[r], k.key0, k.key1, k.step0, k.step1)
                            : race_avx2(row, begin, end, tp[r], fp[r], np[r], k.key0, k.key1, k.step0, k.step1);
      }
    });
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    Best b{kNegInf, kNoColumn};
    for (int64_t c = 0; c < chunks; ++c) fold(b, best[r * chunks + c].score, best[r * chunks + c].index);
    op[r] = b.index == kNoColumn ? 0 : b.index;  // nothing kept: 0, as torch.argmax
  }
  return out;
}

at::Tensor gumbel_noise(const at::Tensor& keys, const at::Tensor& steps, int64_t V, int64_t isa) {
  const int64_t R = keys.numel();
  check_rows(keys, steps, R);
  TORCH_CHECK(V >= 1 && V < (int64_t(1) << 31), "gumbel_noise: V must be positive");
  const at::Tensor keys_c = keys.contiguous(), steps_c = steps.contiguous();
  at::Tensor out = at::empty({R, V}, keys.options().dtype(at::kFloat));
  const bool avx512 = use_avx512(isa);
  at::parallel_for(0, R, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const RowKey k = row_key(keys_c.data_ptr<int64_t>(), steps_c.data_ptr<int64_t>(), r);
      float* row = out.data_ptr<float>() + r * V;
      if (avx512)
        noise_row_avx512(row, V, k.key0, k.key1, k.step0, k.step1);
      else
        noise_row_avx2(row, V, k.key0, k.key1, k.step0, k.step1);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("gumbel_race(Tensor x, Tensor inv_temperature, Tensor threshold, Tensor keys, Tensor steps, int V, "
        "int isa=0, Tensor? sampled=None) -> Tensor");
  m.def("gumbel_noise(Tensor keys, Tensor steps, int V, int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("gumbel_race", &gumbel_race);
  m.impl("gumbel_noise", &gumbel_noise);
}
