// RMSNorm and residual-add + RMSNorm in one pass per token, for AVX2 CPUs.
//
//   rms_norm(x [T, H], weight [H], eps) -> out
//   fused_add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (out, residual + x in float32)
//
// Rounded exactly where the torch path (layers/norm.py) rounds: the residual stream stays float32
// (residual may come in as the activation dtype or float32; the sum is never rounded), the
// normalized row in fp32 is cast to the activation dtype, then the product with the weight cast again. The torch path is 6-8 small ops per call (~40 us on this host
// for one token); a decode step runs 2 per layer + 1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "avx512.h"
#include "common.h"
#include "ops.h"

namespace {

using llmserve::hsum;
using llmserve::load8;
using llmserve::round_through;
using llmserve::store8;

// row_out = weight * cast(row * rsqrt(mean(row^2) + eps)), row in fp32 (already rounded to T).
template <typename T>
void normalize_row(const float* row, const T* weight, int64_t H, float eps, T* out) {
  __m256 squares = _mm256_setzero_ps();
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) {
    const __m256 v = _mm256_loadu_ps(row + h);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  float sum = hsum(squares);
  for (; h < H; ++h) sum += row[h] * row[h];
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m256 inv_rms8 = _mm256_set1_ps(inv_rms);
  for (h = 0; h + 8 <= H; h += 8) {
    const __m256 normed = round_through<T>(_mm256_mul_ps(_mm256_loadu_ps(row + h), inv_rms8));
    store8(out + h, _mm256_mul_ps(load8(weight + h), normed));
  }
  for (; h < H; ++h) {
    const T normed = static_cast<T>(row[h] * inv_rms);
    out[h] = static_cast<T>(static_cast<float>(weight[h]) * static_cast<float>(normed));
  }
}

// One row on AVX-512 (H a multiple of 16, bf16 / fp16): the same roundings as the AVX2 loop below, 16 lanes at a
// time with the residual sum read back from residual_out (or x re-read) instead of a row buffer. The sum of squares
// adds in another order (16 partial sums), so the fp32 row can differ in its last bit (the tests allow it). A
// 512-token prefill of SmolLM2 spent ~9% in the AVX2 loop, its bf16 roundings emulated on 8 lanes.
template <typename T, typename R>
LLMSERVE_AVX512 void norm_row_avx512(const T* x, const R* residual, float* residual_out, const T* weight, int64_t H,
                                     float eps, T* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t h = 0; h < H; h += 16) {
    __m512 v = llmserve::load16(x + h);
    if (residual) {  // residual + x, kept in float32
      v = _mm512_add_ps(v, llmserve::load16(residual + h));
      _mm512_storeu_ps(residual_out + h, v);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inv_rms = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps);
  const __m512 inv_rms16 = _mm512_set1_ps(inv_rms);
  for (int64_t h = 0; h < H; h += 16) {
    const __m512 v = residual ? _mm512_loadu_ps(residual_out + h) : llmserve::load16(x + h);
    const __m512 normed = llmserve::round_through16<T>(_mm512_mul_ps(v, inv_rms16));
    llmserve::store16(out + h, _mm512_mul_ps(llmserve::load16(weight + h), normed));
  }
}

template <typename T, typename R>
void norm_rows(const T* x, const R* residual, float* residual_out, const T* weight, int64_t rows, int64_t H, float eps,
               T* out) {
  if constexpr (!std::is_same_v<T, float>) {
    if (llmserve::cpu_has_avx512() && H % 16 == 0) {
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          norm_row_avx512(x + r * H, residual ? residual + r * H : nullptr, residual ? residual_out + r * H : nullptr,
                          weight, H, eps, out + r * H);
      });
      return;
    }
  }
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) {
      int64_t h = 0;
      for (; h + 8 <= H; h += 8) {
        __m256 v = load8(x + r * H + h);
        if (residual) {  // residual + x, kept in float32
          v = _mm256_add_ps(v, load8(residual + r * H + h));
          _mm256_storeu_ps(residual_out + r * H + h, v);
        }
        _mm256_storeu_ps(row.data() + h, v);
      }
      for (; h < H; ++h) {
        float v = static_cast<float>(x[r * H + h]);
        if (residual) {  // residual + x, kept in float32
          v += static_cast<float>(residual[r * H + h]);
          residual_out[r * H + h] = v;
        }
        row[h] = v;
      }
      normalize_row(row.data(), weight, H, eps, out + r * H);
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1, "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [hidden] matching x's last dimension");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  auto out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  llmserve::dispatch_float(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    norm_rows<T, T>(x.data_ptr<T>(), nullptr, nullptr, weight.data_ptr<T>(), rows, H, static_cast<float>(eps),
                    out.data_ptr<T>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check(x, weight);
  const bool float_residual = residual.scalar_type() == at::kFloat;
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  (float_residual || residual.scalar_type() == x.scalar_type()),
              "fused_add_rms_norm: residual must match x's shape, in x's dtype or float32");
  auto out = at::empty_like(x);
  auto summed = at::empty_like(x, x.options().dtype(at::kFloat));
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  llmserve::dispatch_float(x.scalar_type(), "fused_add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    if (float_residual) {
      norm_rows<T, float>(x.data_ptr<T>(), residual.data_ptr<float>(), summed.data_ptr<float>(),
                          weight.data_ptr<T>(), rows, H, static_cast<float>(eps), out.data_ptr<T>());
    } else {
      norm_rows<T, T>(x.data_ptr<T>(), residual.data_ptr<T>(), summed.data_ptr<float>(), weight.data_ptr<T>(),
                      rows, H, static_cast<float>(eps), out.data_ptr<T>());
    }
  });
  return {out, summed};
}

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  return ::fused_add_rms_norm(x, residual, weight, eps);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
