// Shared by the AVX-512 kernels (quant_linear_avx512.cpp, the AVX-512 paths of decode_attention_avx2.cpp, amx.h):
// the CPU checks and bf16 rounding without AVX512-BF16. Functions carry their own target attribute, so the
// library still builds with the AVX2 base flags.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <type_traits>

namespace llmserve {

#define LLMSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// AVX-512 F/BW/VL/DQ.
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

#define LLMSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// AVX-512 F/BW/VL/DQ and AVX512-BF16 (VDPBF16PS).
inline bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

// VDPBF16PS: acc + the pairwise products of a and b's 32 bf16 (pairs summed into 16 fp32 lanes).
LLMSERVE_AVX512_BF16 inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// 16 fp32 -> their bf16 bits in the low half of each 32-bit lane, rounded to nearest even as c10::BFloat16
// rounds (NaN -> 0x7FC0).
LLMSERVE_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// e^x on 16 lanes (Cephes' expf: 2^n e^r, degree-6 polynomial, within ~2 ulp of std::exp): exactly 0 below
// -87 (so masked softmax scores, -inf, give probabilities of exactly 0), +inf above ~88.7.
LLMSERVE_AVX512 inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(live, y, n);  // y 2^n: saturates to +inf for n = 128
}

// 2^x for x < 128 (or -inf, which gives exactly 0), within 2 ulp: x = n + f, |f| <= 1/2, 2^f by a degree-5
// polynomial (least squares on [-1/2, 1/2]), scaled by 2^n. Below 2^-126 it is 0. The softmaxes call it on
// scores at most their running max (x <= 0) or, with a lazily moved max, up to a few units above it.
LLMSERVE_AVX512 inline __m512 exp2_below128(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.32187e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67170e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550893e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022238e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314686e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// The first n of 16 lanes (none for n <= 0, all for n >= 16): masks of a row's tail.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// 16 fp32 -> 16 bf16, rounded as bf16_bits.
LLMSERVE_AVX512 inline __m256i to_bf16(__m512 v) { return _mm512_cvtepi32_epi16(bf16_bits(v)); }

// 16 bf16 / fp16 -> fp32 lanes, and back rounded as static_cast<c10::BFloat16> / <c10::Half> round (to nearest even).
LLMSERVE_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
LLMSERVE_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
LLMSERVE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LLMSERVE_AVX512 inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
LLMSERVE_AVX512 inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}


// v rounded to T (bf16 / fp16) and back: where the torch path rounds an intermediate result (round_through's 16 lanes).
template <typename T>
LLMSERVE_AVX512 inline __m512 round_through16(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

}  // namespace llmserve
