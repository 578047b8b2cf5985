// Decode attention over the paged KV pool, one query token per request, for AVX2 + FMA CPUs, with an
// AVX-512 path (below) where the CPU has it and the pool is bf16 / fp16, and an AVX512-BF16 one for bf16.
//
//   decode_attention(q [B, Hq, D], k_pool [S, Hkv, D], v_pool [S, Hkv, Dv], slots [B, L] int64,
//                    seq_lens [B] int64, scaling, isa = 0) -> [B, Hq, Dv] in q's dtype
//
// Request b attends over slots[b, :seq_lens[b]]; query head h reads KV head h / (Hq / Hkv). Scores,
// softmax and the weighted sum are fp32, as the torch path computes them. The torch path gathers
// every request's K/V into a padded fp32 copy first (several small ops per layer, each ~5-30 us on
// this class of host); here one task per (request, KV head) reads its slots in place (they stay in
// L1 for the query heads that share them), scores eight keys per transposing reduction, and keeps
// the value accumulators in registers for head sizes 32, 64 and 128.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "avx512.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "ops.h"

namespace {

using llmserve::hsum;

using llmserve::exp8;
using llmserve::load8;

// Lane u of the result: the sum of a[u]'s lanes.
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
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

// scores[t] = query . keys[t] for t < len; eight keys at a time share one transposing reduction.
template <typename cache_t>
void score_keys(const float* query, const cache_t* const* keys, int64_t len, int64_t D, float* scores) {
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(query + d);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, load8(keys[t + u] + d), acc[u]);
    }
    _mm256_storeu_ps(scores + t, hsum8(acc));
    for (; d < D; ++d)
      for (int u = 0; u < 8; ++u) scores[t + u] += query[d] * static_cast<float>(keys[t + u][d]);
  }
  for (; t < len; ++t) scores[t] = dot(query, keys[t], D);
}

// The peak is taken eight lanes at a time: a scalar std::max chain (which the compiler may not reorder) was
// most of the softmax's time (the AVX-512 paths: softmax16_in_place).
inline void softmax_in_place(float* row, int64_t len) {
  __m256 peak8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) peak8 = _mm256_max_ps(peak8, _mm256_loadu_ps(row + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, peak8);
  float peak = *std::max_element(lanes, lanes + 8);
  for (; i < len; ++i) peak = std::max(peak, row[i]);
  peak8 = _mm256_set1_ps(peak);
  __m256 total8 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), peak8));
    _mm256_storeu_ps(row + t, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = hsum(total8);
  for (; t < len; ++t) total += (row[t] = std::exp(row[t] - peak));
  const float inv = 1.f / total;
  for (t = 0; t < len; ++t) row[t] *= inv;
}

// out[0:8*NV] = sum_t probs[t] * values[t], the accumulators held in registers.
template <int NV, typename cache_t>
void weighted_sum(const float* probs, const cache_t* const* values, int64_t len, float* out) {
  __m256 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const __m256 p = _mm256_set1_ps(probs[t]);
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(p, load8(values[t] + 8 * c), acc[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

template <typename cache_t>
void weighted_sum_any(const float* probs, const cache_t* const* values, int64_t len, int64_t Dv, float* out) {
  switch (Dv) {
    case 32: return weighted_sum<4>(probs, values, len, out);
    case 64: return weighted_sum<8>(probs, values, len, out);
    case 128: return weighted_sum<16>(probs, values, len, out);
    default:
      std::fill(out, out + Dv, 0.f);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t d = 0; d < Dv; ++d) out[d] += probs[t] * static_cast<float>(values[t][d]);
  }
}

template <typename cache_t, typename q_t>
void attend(const q_t* q, const cache_t* k_pool, const cache_t* v_pool, const int64_t* slots,
            const int64_t* seq_lens, q_t* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
            int64_t L, float scaling) {
  const int64_t groups = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(D), scores(L), acc(Dv);
    std::vector<const cache_t*> keys(L), values(L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kv_head = task % Hkv, len = seq_lens[b];
      for (int64_t t = 0; t < len; ++t) {  // this KV head's rows, read in place from the pool
        keys[t] = k_pool + (slots[b * L + t] * Hkv + kv_head) * D;
        values[t] = v_pool + (slots[b * L + t] * Hkv + kv_head) * Dv;
      }
      for (int64_t g = 0; g < groups; ++g) {  // the query heads sharing this KV head
        const int64_t head = b * Hq + kv_head * groups + g;
        for (int64_t d = 0; d < D; ++d) query[d] = static_cast<float>(q[head * D + d]) * scaling;
        score_keys(query.data(), keys.data(), len, D, scores.data());
        softmax_in_place(scores.data(), len);
        weighted_sum_any(scores.data(), values.data(), len, Dv, acc.data());
        for (int64_t d = 0; d < Dv; ++d) out[head * Dv + d] = static_cast<q_t>(acc[d]);
      }
    }
  });
}

// ---- AVX-512 (bf16 / fp16 pools and queries, head sizes 32, 64, 128) -------------------------------
// The AVX2 path scores each query head on its own, re-reading and re-widening every key per head. Here
// the query heads sharing a KV head (up to 16 / (D / 16) of them at once) are held in registers, each
// key is widened once for all of them (one reduction per key and head instead of a transposing sum), and
// the value accumulators of all of them stay in registers for the weighted sum. Same fp32 arithmetic,
// another summation order.

using llmserve::cpu_has_avx512;
using llmserve::exp16;
using llmserve::load16;
using llmserve::store16;

constexpr int64_t kPrefetchRows = 8;

// softmax_in_place on 16 lanes, the tail under a mask (the scalar peak was ~38% of the AVX512-BF16 path at a
// 190-token context).
LLMSERVE_AVX512 inline void softmax16_in_place(float* row, int64_t len) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16)) - 1);
  const int64_t body = len - len % 16;
  __m512 peak16 = minus_inf;
  for (int64_t t = 0; t < body; t += 16) peak16 = _mm512_max_ps(peak16, _mm512_loadu_ps(row + t));
  peak16 = _mm512_max_ps(peak16, _mm512_mask_loadu_ps(minus_inf, tail, row + body));
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(peak16));
  __m512 total16 = _mm512_setzero_ps();
  for (int64_t t = 0; t < body; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), peak));
    _mm512_storeu_ps(row + t, e);
    total16 = _mm512_add_ps(total16, e);
  }
  const __m512 e_tail = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + body), peak)));
  _mm512_mask_storeu_ps(row + body, tail, e_tail);
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_add_ps(total16, e_tail)));
  for (int64_t t = 0; t < body; t += 16) _mm512_storeu_ps(row + t, _mm512_mul_ps(_mm512_loadu_ps(row + t), inv));
  _mm512_mask_storeu_ps(row + body, tail, _mm512_mul_ps(e_tail, inv));
}

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T0);
}

// The K pass's look-ahead: this head's key row, or (row_span > D: the first KV head of a request) the whole
// pool row of every KV head, keys and values, so the DRAM sees each scattered slot's K and V rows asked for
// at once and the request's other heads (next on this thread) find them in L2.
template <typename T>
inline void prefetch_key_value(const T* key, const T* value, int64_t D, int64_t row_span) {
  prefetch_row(key, row_span);
  if (row_span > D) prefetch_row(value, row_span);
}

// GC query heads (q, out: GC consecutive heads of D = 16 NV) over one KV head's keys and values.
template <typename T, int NV, int GC>
LLMSERVE_AVX512 void attend_heads(const T* q, float scaling, const T* const* keys, const T* const* values, int64_t len,
                                  float* scores, int64_t L, T* out, int64_t row_span) {
  constexpr int64_t D = 16 * NV;
  __m512 query[GC][NV];
  const __m512 scale = _mm512_set1_ps(scaling);
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) query[g][v] = _mm512_mul_ps(load16(q + g * D + 16 * v), scale);
  for (int64_t t = 0; t < len; ++t) {
    // The rows of a request are scattered over the pool (one per slot, Hkv heads apart): ask for a later
    // row's lines ahead, as the hardware prefetcher does not follow the slot list.
    if (t + kPrefetchRows < len) prefetch_key_value(keys[t + kPrefetchRows], values[t + kPrefetchRows], D, row_span);
    __m512 key[NV];
    for (int v = 0; v < NV; ++v) key[v] = load16(keys[t] + 16 * v);
    for (int g = 0; g < GC; ++g) {
      __m512 dot = _mm512_mul_ps(query[g][0], key[0]);
      for (int v = 1; v < NV; ++v) dot = _mm512_fmadd_ps(query[g][v], key[v], dot);
      scores[g * L + t] = _mm512_reduce_add_ps(dot);
    }
  }
  for (int g = 0; g < GC; ++g) softmax16_in_place(scores + g * L, len);
  __m512 acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchRows < len) prefetch_row(values[t + kPrefetchRows], D);
    __m512 value[NV];
    for (int v = 0; v < NV; ++v) value[v] = load16(values[t] + 16 * v);
    for (int g = 0; g < GC; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + t]);
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(p, value[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) store16(out + g * D + 16 * v, acc[g][v]);
}

using HeadsFn = void (*)(const void*, float, const void* const*, const void* const*, int64_t, float*, int64_t, void*,
                         int64_t);

template <typename T, int NV, int GC>
void heads_entry(const void* q, float scaling, const void* const* keys, const void* const* values, int64_t len,
                 float* scores, int64_t L, void* out, int64_t row_span) {
  attend_heads<T, NV, GC>(static_cast<const T*>(q), scaling, reinterpret_cast<const T* const*>(keys),
                          reinterpret_cast<const T* const*>(values), len, scores, L, static_cast<T*>(out), row_span);
}

// Head chunks of up to 16 / NV heads keep query (or accumulator) registers at 16 of the 32 zmm.
template <typename T, int NV>
HeadsFn heads_for(int gc) {
  if constexpr (NV == 2) {
    switch (gc) {
      case 1: return &heads_entry<T, 2, 1>; case 2: return &heads_entry<T, 2, 2>; case 3: return &heads_entry<T, 2, 3>;
      case 4: return &heads_entry<T, 2, 4>; case 5: return &heads_entry<T, 2, 5>; case 6: return &heads_entry<T, 2, 6>;
      case 7: return &heads_entry<T, 2, 7>; default: return &heads_entry<T, 2, 8>;
    }
  } else if constexpr (NV == 4) {
    switch (gc) {
      case 1: return &heads_entry<T, 4, 1>; case 2: return &heads_entry<T, 4, 2>; case 3: return &heads_entry<T, 4, 3>;
      default: return &heads_entry<T, 4, 4>;
    }
  } else {
    return gc == 1 ? &heads_entry<T, 8, 1> : &heads_entry<T, 8, 2>;
  }
}

template <typename T>
HeadsFn heads_fn(int64_t D, int gc) {
  return D == 32 ? heads_for<T, 2>(gc) : D == 64 ? heads_for<T, 4>(gc) : heads_for<T, 8>(gc);
}

// ---- AVX512-BF16 (bf16 pools and queries) ------------------------------------------------------------
// Above, a score costs its key's widening to fp32 (two instructions per 16 elements) and, per query head, a
// full horizontal reduction of its 16-lane dot. Here VDPBF16PS multiplies the raw bf16 query and key (bf16
// products are exact in fp32; the sums stay fp32, in another order) and scales the score after; four keys'
// dot vectors are reduced together by one transposing sum (13 instructions for 4 scores, against ~8 per
// score). The weighted sum stays fp32 FMAs, each 32 values widened as their even and odd lanes (one shift
// or mask per 16) and interleaved back when the result is rounded.

// [sum(a), sum(b), sum(c), sum(d)].
LLMSERVE_AVX512 inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128-bit lane: a, b, a, b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // per lane: a, b, c, d
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// query . key over 32 C bf16 elements -> 16 partial sums.
template <int C>
LLMSERVE_AVX512_BF16 inline __m512 dot_row(const __m512i (&query)[C], const __m512i (&key)[C]) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) acc = llmserve::dot_bf16(acc, query[c], key[c]);
  return acc;
}

// GC query heads (D = 32 C) over one KV head, as attend_heads computes them.
template <int C, int GC>
LLMSERVE_AVX512_BF16 void attend_heads_bf16(const c10::BFloat16* q, float scaling, const c10::BFloat16* const* keys,
                                            const c10::BFloat16* const* values, int64_t len, float* scores, int64_t L,
                                            c10::BFloat16* out, int64_t row_span) {
  constexpr int64_t D = 32 * C;
  __m512i query[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) query[g][c] = _mm512_loadu_si512(q + g * D + 32 * c);
  const __m128 scale4 = _mm_set1_ps(scaling);
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {
    __m512 dots[GC][4];
    for (int u = 0; u < 4; ++u) {
      if (t + u + kPrefetchRows < len)
        prefetch_key_value(keys[t + u + kPrefetchRows], values[t + u + kPrefetchRows], D, row_span);
      __m512i key[C];
      for (int c = 0; c < C; ++c) key[c] = _mm512_loadu_si512(keys[t + u] + 32 * c);
      for (int g = 0; g < GC; ++g) dots[g][u] = dot_row<C>(query[g], key);
    }
    for (int g = 0; g < GC; ++g)
      _mm_storeu_ps(scores + g * L + t, _mm_mul_ps(reduce4(dots[g][0], dots[g][1], dots[g][2], dots[g][3]), scale4));
  }
  for (; t < len; ++t) {
    __m512i key[C];
    for (int c = 0; c < C; ++c) key[c] = _mm512_loadu_si512(keys[t] + 32 * c);
    for (int g = 0; g < GC; ++g) scores[g * L + t] = _mm512_reduce_add_ps(dot_row<C>(query[g], key)) * scaling;
  }
  for (int g = 0; g < GC; ++g) softmax16_in_place(scores + g * L, len);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even[GC][C], odd[GC][C];  // elements 32 c + 2 i and 32 c + 2 i + 1 in lane i
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) even[g][c] = odd[g][c] = _mm512_setzero_ps();
  for (int64_t t2 = 0; t2 < len; ++t2) {
    if (t2 + kPrefetchRows < len) prefetch_row(values[t2 + kPrefetchRows], D);
    __m512 value_even[C], value_odd[C];
    for (int c = 0; c < C; ++c) {
      const __m512i pairs = _mm512_loadu_si512(values[t2] + 32 * c);
      value_even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      value_odd[c] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
    }
    for (int g = 0; g < GC; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + t2]);
      for (int c = 0; c < C; ++c) {
        even[g][c] = _mm512_fmadd_ps(p, value_even[c], even[g][c]);
        odd[g][c] = _mm512_fmadd_ps(p, value_odd[c], odd[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) {
      const __m512i pairs = _mm512_or_si512(llmserve::bf16_bits(even[g][c]),
                                            _mm512_slli_epi32(llmserve::bf16_bits(odd[g][c]), 16));
      _mm512_storeu_si512(out + g * D + 32 * c, pairs);
    }
}

template <int C, int GC>
void heads_entry_bf16(const void* q, float scaling, const void* const* keys, const void* const* values, int64_t len,
                      float* scores, int64_t L, void* out, int64_t row_span) {
  attend_heads_bf16<C, GC>(static_cast<const c10::BFloat16*>(q), scaling,
                           reinterpret_cast<const c10::BFloat16* const*>(keys),
                           reinterpret_cast<const c10::BFloat16* const*>(values), len, scores, L,
                           static_cast<c10::BFloat16*>(out), row_span);
}

// Query heads per call: 4 x 4 dot vectors (2 x 4 for D = 128) beside the query and key registers.
int64_t bf16_chunk(int64_t D) { return D == 128 ? 2 : 4; }

HeadsFn heads_fn_bf16(int64_t D, int gc) {
  switch (D) {
    case 32:
      return gc == 1 ? &heads_entry_bf16<1, 1> : gc == 2 ? &heads_entry_bf16<1, 2> : gc == 3 ? &heads_entry_bf16<1, 3>
                                                                                              : &heads_entry_bf16<1, 4>;
    case 64:
      return gc == 1 ? &heads_entry_bf16<2, 1> : gc == 2 ? &heads_entry_bf16<2, 2> : gc == 3 ? &heads_entry_bf16<2, 3>
                                                                                              : &heads_entry_bf16<2, 4>;
    default:
      return gc == 1 ? &heads_entry_bf16<4, 1> : &heads_entry_bf16<4, 2>;
  }
}

bool avx512_fits(at::ScalarType q, at::ScalarType cache, int64_t D, int64_t Dv) {
  return cpu_has_avx512() && (D == 32 || D == 64 || D == 128) && Dv == D && q == cache &&
         (q == at::kBFloat16 || q == at::kHalf);
}

bool avx512_bf16_fits(at::ScalarType q) { return llmserve::cpu_has_avx512_bf16() && q == at::kBFloat16; }

// The path isa 0 (auto) runs for these dtypes and head sizes: 1 = AVX2, 2 = AVX-512, 3 = AVX512-BF16. The kernel
// and the start-up kernel plan both ask this, so the plan names the code that runs.
int64_t auto_isa(at::ScalarType q, at::ScalarType cache, int64_t D, int64_t Dv) {
  if (!avx512_fits(q, cache, D, Dv)) return 1;
  return avx512_bf16_fits(q) ? 3 : 2;
}

// bf16_dot: the AVX512-BF16 variant (bf16 pools only).
template <typename T>
void attend_avx512(const T* q, const T* k_pool, const T* v_pool, const int64_t* slots, const int64_t* seq_lens, T* out,
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t L, float scaling, bool bf16_dot) {
  const int64_t groups = Hq / Hkv, chunk = std::min<int64_t>(groups, bf16_dot ? bf16_chunk(D) : 16 / (D / 16));
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(chunk * L);
    std::vector<const void*> keys(L), values(L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kv_head = task % Hkv, len = seq_lens[b];
      for (int64_t t = 0; t < len; ++t) {
        keys[t] = k_pool + (slots[b * L + t] * Hkv + kv_head) * D;
        values[t] = v_pool + (slots[b * L + t] * Hkv + kv_head) * D;
      }
      for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int gc = static_cast<int>(std::min<int64_t>(chunk, groups - g0));
        const int64_t head = b * Hq + kv_head * groups + g0;
        // A request's first KV head asks for its whole K and V pool rows (prefetch_key_value): 11-14% faster at
        // 64 requests x 192 tokens from DRAM, contiguous or scattered slots alike.
        const int64_t row_span = kv_head == 0 && g0 == 0 ? Hkv * D : D;
        (bf16_dot ? heads_fn_bf16(D, gc) : heads_fn<T>(D, gc))(q + head * D, scaling, keys.data(), values.data(), len,
                                                               scores.data(), L, out + head * D, row_span);
      }
    }
  });
}

// isa: 0 = the best that fits (AVX512-BF16 for bf16 on CPUs with it, else AVX-512 where CPU, dtypes and head size
// fit, else AVX2); 1 = AVX2; 2 = AVX-512 without VDPBF16PS; 3 = AVX512-BF16 (2 and 3: or an error).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& slots, const at::Tensor& seq_lens, double scaling, int64_t isa) {
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
  TORCH_CHECK(isa >= 0 && isa <= 3, "decode_attention: isa must be 0 (auto), 1 (avx2), 2 (avx512) or 3 (avx512_bf16)");
  auto out = at::empty({B, Hq, Dv}, q.options());
  const at::ScalarType q_type = q.scalar_type(), cache_type = k_pool.scalar_type();
  const int64_t path = isa == 0 ? auto_isa(q_type, cache_type, D, Dv) : isa;
  TORCH_CHECK(path == 1 || avx512_fits(q_type, cache_type, D, Dv), "decode_attention: the AVX-512 paths need AVX-512 "
              "F/BW/VL/DQ, bfloat16 or float16 q and pools alike, and head sizes 32, 64 or 128 for K and V alike");
  TORCH_CHECK(path != 3 || avx512_bf16_fits(q_type),
              "decode_attention: the AVX512-BF16 path needs AVX512-BF16 and bfloat16 q and pools");
  const bool avx512 = path != 1, bf16_dot = path == 3;
  if (avx512) {
    if (q.scalar_type() == at::kBFloat16)
      attend_avx512<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), k_pool.data_ptr<c10::BFloat16>(),
                                   v_pool.data_ptr<c10::BFloat16>(), slots.data_ptr<int64_t>(), lens,
                                   out.data_ptr<c10::BFloat16>(), B, Hq, Hkv, D, L, static_cast<float>(scaling),
                                   bf16_dot);
    else
      attend_avx512<c10::Half>(q.data_ptr<c10::Half>(), k_pool.data_ptr<c10::Half>(), v_pool.data_ptr<c10::Half>(),
                               slots.data_ptr<int64_t>(), lens, out.data_ptr<c10::Half>(), B, Hq, Hkv, D, L,
                               static_cast<float>(scaling), false);
    return out;
  }
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

bool decode_attention_avx512_available() { return cpu_has_avx512(); }
bool decode_attention_avx512_bf16_available() { return llmserve::cpu_has_avx512_bf16(); }
int64_t decode_attention_auto_isa(at::ScalarType dtype, int64_t head_dim, int64_t v_head_dim) {
  return auto_isa(dtype, dtype, head_dim, v_head_dim);
}

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& slots, const at::Tensor& seq_lens, double scaling, int64_t isa) {
  return ::decode_attention(q, k_pool, v_pool, slots, seq_lens, scaling, isa);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("decode_attention_avx512_available() -> bool", &decode_attention_avx512_available);
  m.def("decode_attention_avx512_bf16_available() -> bool", &decode_attention_avx512_bf16_available);
  m.def("decode_attention_auto_isa(ScalarType dtype, int head_dim, int v_head_dim) -> int", &decode_attention_auto_isa);
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor seq_lens, float scaling, "
        "int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
