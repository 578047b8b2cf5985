// Rotate-half rotary embedding (Llama's layout) for q and k in one call, for AVX2 CPUs.
//
//   rotary_rotate_half(q [T, Hq, D], k [T, Hk, D], cos [T, 1, D], sin [T, 1, D]) -> (q_out, k_out)
//
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]), for bfloat16 / float16
// activations and tables in the same dtype, rounded exactly where the torch path (layers/rotary.py)
// rounds: each product to the activation dtype, then their sum. So its outputs are bit for bit the
// torch path's, which is 10 small ops per layer (~15-25 us at one token on this class of host).
// Inputs may be strided views (q and k are slices of the fused qkv output): rows of D contiguous values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <tuple>

#include "avx512.h"
#include "common.h"
#include "ops.h"

namespace {

using llmserve::load8;
using llmserve::round_through;
using llmserve::store8;

template <typename T>
void rotate_row(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  int64_t d = 0;
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = load8(x + d), x2 = load8(x + half + d);
    const __m256 c1 = load8(cos + d), c2 = load8(cos + half + d);
    const __m256 s1 = load8(sin + d), s2 = load8(sin + half + d);
    const __m256 neg_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.f));
    const __m256 lo = _mm256_add_ps(round_through<T>(_mm256_mul_ps(x1, c1)), round_through<T>(_mm256_mul_ps(neg_x2, s1)));
    const __m256 hi = _mm256_add_ps(round_through<T>(_mm256_mul_ps(x2, c2)), round_through<T>(_mm256_mul_ps(x1, s2)));
    store8(out + d, lo);
    store8(out + half + d, hi);
  }
  for (; d < half; ++d) {  // head sizes that are not a multiple of 16
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[half + d]);
    const T a = static_cast<T>(x1 * static_cast<float>(cos[d])), b = static_cast<T>(-x2 * static_cast<float>(sin[d]));
    const T e = static_cast<T>(x2 * static_cast<float>(cos[half + d])), f = static_cast<T>(x1 * static_cast<float>(sin[half + d]));
    out[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
    out[half + d] = static_cast<T>(static_cast<float>(e) + static_cast<float>(f));
  }
}

// rotate_row on AVX-512, for half head sizes that are whole 16-lane vectors (bf16 / fp16): the same roundings, 16
// lanes a step (the AVX2 loop emulates bf16 rounding on 8; a 512-token prefill of SmolLM2 spent ~5% in it).
template <typename T>
LLMSERVE_AVX512 void rotate_row_avx512(const T* x, const T* cos, const T* sin, int64_t half, T* out) {
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 x1 = llmserve::load16(x + d), x2 = llmserve::load16(x + half + d);
    const __m512 c1 = llmserve::load16(cos + d), c2 = llmserve::load16(cos + half + d);
    const __m512 s1 = llmserve::load16(sin + d), s2 = llmserve::load16(sin + half + d);
    const __m512 neg_x2 = _mm512_xor_ps(x2, _mm512_set1_ps(-0.f));
    const __m512 lo = _mm512_add_ps(llmserve::round_through16<T>(_mm512_mul_ps(x1, c1)),
                                    llmserve::round_through16<T>(_mm512_mul_ps(neg_x2, s1)));
    const __m512 hi = _mm512_add_ps(llmserve::round_through16<T>(_mm512_mul_ps(x2, c2)),
                                    llmserve::round_through16<T>(_mm512_mul_ps(x1, s2)));
    llmserve::store16(out + d, lo);
    llmserve::store16(out + half + d, hi);
  }
}

void check(const at::Tensor& x, const char* name, const at::Tensor& cos) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_rotate_half: ", name, " must be [tokens, heads, head_dim] with "
              "contiguous rows");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == cos.size(2), "rotary_rotate_half: ", name, " and cos disagree");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type(), "rotary_rotate_half: ", name, " and cos must share a dtype");
}

std::tuple<at::Tensor, at::Tensor> rotary_rotate_half(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                      const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 3 && cos.size(1) == 1 && cos.stride(2) == 1 && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides() && sin.scalar_type() == cos.scalar_type(),
              "rotary_rotate_half: cos and sin must be [tokens, 1, head_dim] views alike");
  check(q, "q", cos);
  check(k, "k", cos);
  const int64_t D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(2) == D, "rotary_rotate_half: head_dim must be even and shared by q and k");
  auto q_out = at::empty(q.sizes(), q.options());
  auto k_out = at::empty(k.sizes(), k.options());
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "rotary_rotate_half: bfloat16 or float16 activations (the torch path keeps float32)");
  AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "rotary_rotate_half", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* qo = q_out.data_ptr<scalar_t>();
    scalar_t* ko = k_out.data_ptr<scalar_t>();
    const bool avx512 = llmserve::cpu_has_avx512() && (D / 2) % 16 == 0;
    const auto rotate = [&](const scalar_t* x, const scalar_t* c, const scalar_t* s, scalar_t* out) {
      if (avx512)
        rotate_row_avx512(x, c, s, D / 2, out);
      else
        rotate_row(x, c, s, D, out);
    };
    // One task per token: a decode step is a few tokens, so the grain keeps small steps on one thread.
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * cos.stride(0);
        const scalar_t* s = sp + t * sin.stride(0);
        for (int64_t h = 0; h < Hq; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s, qo + (t * Hq + h) * D);
        for (int64_t h = 0; h < Hk; ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s, ko + (t * Hk + h) * D);
      }
    });
  });
  return {q_out, k_out};
}

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
std::tuple<at::Tensor, at::Tensor> rotary_rotate_half(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                      const at::Tensor& sin) {
  return ::rotary_rotate_half(q, k, cos, sin);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("rotary_rotate_half(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("rotary_rotate_half", &rotary_rotate_half); }
