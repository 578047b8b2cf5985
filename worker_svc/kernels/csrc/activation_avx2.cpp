// SwiGLU's activation, silu(gate) * up, in one pass over a [rows, 2 d] (gate | up) tensor, for bf16 / fp16
// activations on AVX2 CPUs, 16 lanes at a time where the CPU has AVX-512 (layers/mlp.py; fused_layers.cpp).
//
//   silu_and_mul(gate_up [..., 2 d]) -> [..., d]
//
// Rounded where the torch path (F.silu(gate) * up) rounds: silu(g) = g / (1 + e^-g) in fp32, rounded to the
// activation dtype, then its product with up in fp32, rounded again. e^x is a Cephes polynomial within ~2 ulp
// of the libm one torch's vector code calls, so a result can differ from torch's by one unit of the last place
// of the rounded silu now and then. Why: torch makes three passes and two temporaries ([rows, d] each) where
// this reads gate and up once and writes the output once: a 512-token prefill of SmolLM2 spent ~5% in them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "avx512.h"
#include "common.h"
#include "ops.h"

namespace {

using llmserve::exp8;
using llmserve::load16;
using llmserve::load8;
using llmserve::round_through;
using llmserve::store16;
using llmserve::store8;

// silu(g) * u for 16 lanes in fp32 (g, u already widened), silu rounded to T first as torch rounds it.
template <typename T>
LLMSERVE_AVX512 inline __m512 silu_mul16(__m512 g, __m512 u) {
  // g / (1 + e^-g): e^-g = +inf below g = -88.7 makes it -0, as in torch.
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), llmserve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(llmserve::round_through16<T>(silu), u);
}

// One row's [0, d16) on AVX-512 (d16: d rounded down to 16); -> where the AVX2 loop continues.
template <typename T>
LLMSERVE_AVX512 int64_t silu_mul_row_avx512(const T* gate, const T* up, int64_t d, T* dst) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    store16(dst + i, silu_mul16<T>(load16(gate + i), load16(up + i)));
  return i;
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t d, T* out) {
  // ~16k elements a task, so one token's MLP (d = 1536 on SmolLM2) does not pay for a thread hand-off.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    const bool avx512 = llmserve::cpu_has_avx512();
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * d;
      const T* up = gate + d;
      T* dst = out + r * d;
      int64_t i = avx512 ? silu_mul_row_avx512(gate, up, d, dst) : 0;
      for (; i + 8 <= d; i += 8) {
        const __m256 g = load8(gate + i);
        // g / (1 + e^-g): e^-g = +inf below g = -88.72 makes it -0, as in torch.
        const __m256 silu = round_through<T>(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)))));
        store8(dst + i, _mm256_mul_ps(silu, load8(up + i)));
      }
      for (; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
        dst[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: gate_up must be a contiguous CPU tensor [..., 2 d]");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 || gate_up.scalar_type() == at::kHalf,
              "silu_and_mul: bfloat16 or float16 (float32 keeps the torch path)");
  const int64_t d = gate_up.size(-1) / 2, rows = d == 0 ? 0 : gate_up.numel() / (2 * d);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, gate_up.options());
  if (rows == 0) return out;
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_rows(gate_up.data_ptr<c10::BFloat16>(), rows, d, out.data_ptr<c10::BFloat16>());
  else
    silu_mul_rows(gate_up.data_ptr<c10::Half>(), rows, d, out.data_ptr<c10::Half>());
  return out;
}

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return ::silu_and_mul(gate_up); }
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
