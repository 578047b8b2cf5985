// Shared by the AVX2 kernels: dtype dispatch and horizontal sums.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace llmserve {

// Dispatch over the three activation / cache dtypes the engine runs (float32, bfloat16, float16):
// fewer template instantiations than AT_DISPATCH_FLOATING_TYPES_AND2 (which adds double), so the
// library builds faster.
template <typename F>
void dispatch_float(at::ScalarType type, const char* what, F&& body) {
  switch (type) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", type, " (float32, bfloat16 or float16)");
  }
}

// 8 values of the activation / cache dtypes <-> fp32 lanes. bf16 -> fp32 is a 16-bit shift; fp32 -> bf16
// rounds to nearest even (NaN -> quiet NaN) and fp32 -> fp16 to nearest, as c10::BFloat16 / c10::Half round,
// so a vector loop rounds exactly where the scalar static_casts (and the torch ops) do.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m128i to16(__m256 v, c10::BFloat16) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
inline __m128i to16(__m256 v, c10::Half) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <typename T>
inline void store8(T* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to16(v, T{}));
}

// v rounded to T and back: where the torch path rounds an intermediate result (identity for float).
template <typename T>
inline __m256 round_through(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m128i h = to16(v, T{});
    return load8(reinterpret_cast<const T*>(&h));
  }
}

// Cephes' expf on 8 lanes: e^x = 2^n e^r, n = round(x / ln 2), r by a two-part ln 2, degree-6
// polynomial; within ~2 ulp of std::exp; ~0 below -88.376 and +inf past ln(FLT_MAX) = 88.7228, as exp16 (and
// std::exp) saturate. n reaches 128 at the top, past the exponent field: that scale is applied as 2^127 x 2.
inline __m256 exp8(__m256 x) {
  const __m256 top = _mm256_set1_ps(88.7228394f);
  const __m256 overflow = _mm256_cmp_ps(x, top, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), top);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256 doubled = _mm256_cmp_ps(n, _mm256_set1_ps(127.f), _CMP_GT_OQ);  // n = 128
  n = _mm256_min_ps(n, _mm256_set1_ps(127.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(exponent)),
                    _mm256_blendv_ps(_mm256_set1_ps(1.f), _mm256_set1_ps(2.f), doubled));
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), overflow);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

}  // namespace llmserve
