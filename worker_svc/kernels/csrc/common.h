// Shared by the AVX2 kernels: dtype dispatch and horizontal sums.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>

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
