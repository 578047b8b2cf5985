// Decode attention over the paged KV pool, one query token per request, for AVX2 + FMA CPUs.
//
//   decode_attention(q [B, Hq, D], k_pool [S, Hkv, D], v_pool [S, Hkv, Dv], slots [B, L] int64,
//                    seq_lens [B] int64, scaling) -> [B, Hq, Dv] in q's dtype
//
// Request b attends over slots[b, :seq_lens[b]]; query head h reads KV head h / (Hq / Hkv). Scores,
// softmax and the weighted sum are fp32, as the torch path computes them. The torch path gathers
// every request's K/V into a padded fp32 copy first (several small ops per layer, each ~5-30 us on
// this class of host); here each (request, KV head) reads its slots in place, and the query heads
// that share a KV head share each K/V row load.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "dispatch.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

template <typename T>
void axpy(float alpha, const T* x, float* y, int64_t n) {  // y += alpha * x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

template <typename cache_t, typename q_t>
void attend(const q_t* q, const cache_t* k_pool, const cache_t* v_pool, const int64_t* slots,
            const int64_t* seq_lens, q_t* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
            int64_t L, float scaling) {
  const int64_t groups = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(groups * D), scores, acc(groups * Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kv_head = task % Hkv, len = seq_lens[b];
      scores.assign(groups * len, 0.f);
      for (int64_t g = 0; g < groups; ++g)  // [groups, D] fp32 query rows of this KV head
        for (int64_t d = 0; d < D; ++d)
          query[g * D + d] = static_cast<float>(q[(b * Hq + kv_head * groups + g) * D + d]) * scaling;
      for (int64_t t = 0; t < len; ++t) {
        const cache_t* key = k_pool + (slots[b * L + t] * Hkv + kv_head) * D;
        for (int64_t g = 0; g < groups; ++g) scores[g * len + t] = dot(query.data() + g * D, key, D);
      }
      for (int64_t g = 0; g < groups; ++g) {  // softmax per query head, in place
        float* row = scores.data() + g * len;
        float peak = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, row[t]);
        for (int64_t t = 0; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));
        for (int64_t t = 0; t < len; ++t) row[t] /= total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const cache_t* value = v_pool + (slots[b * L + t] * Hkv + kv_head) * Dv;
        for (int64_t g = 0; g < groups; ++g) axpy(scores[g * len + t], value, acc.data() + g * Dv, Dv);
      }
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t d = 0; d < Dv; ++d)
          out[(b * Hq + kv_head * groups + g) * Dv + d] = static_cast<q_t>(acc[g * Dv + d]);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& slots, const at::Tensor& seq_lens, double scaling) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "decode_attention: q, k_pool, v_pool must be 3-D");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && slots.is_contiguous() &&
                  seq_lens.is_contiguous(), "decode_attention: tensors must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "decode_attention: slots and seq_lens must be int64");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(1), Dv = v_pool.size(2);
  TORCH_CHECK(k_pool.size(2) == D && v_pool.size(1) == Hkv && Hq % Hkv == 0, "decode_attention: head shapes disagree");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "decode_attention: k and v pools differ in dtype");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && seq_lens.numel() == B, "decode_attention: one slot row per request");
  const int64_t L = slots.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] > 0 && lens[b] <= L, "decode_attention: seq_lens[", b, "] = ", lens[b], " outside 1..", L);
  auto out = at::empty({B, Hq, Dv}, q.options());
  llmserve::dispatch_float(k_pool.scalar_type(), "decode_attention", [&](auto cache_zero) {
    using cache_t = decltype(cache_zero);
    llmserve::dispatch_float(q.scalar_type(), "decode_attention", [&](auto q_zero) {
      using q_t = decltype(q_zero);
      attend<cache_t, q_t>(q.data_ptr<q_t>(), k_pool.data_ptr<cache_t>(), v_pool.data_ptr<cache_t>(),
                           slots.data_ptr<int64_t>(), lens, out.data_ptr<q_t>(), B, Hq, Hkv, D, Dv, L,
                           static_cast<float>(scaling));
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor seq_lens, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
