// bf16 linear y = x W^T (+ b) on CPUs with AVX512-BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids), from a
// weight packed once at load for VDPBF16PS.
//
// Why: aten's bf16 GEMV reads an unpacked [N, K] weight at about half of this host's read bandwidth,
// and its small-batch GEMM leaves more on the table (docs/benchmarks.md). Decode steps are nothing but
// such calls.
//
// Layout: outputs in groups of 16, inputs in pairs. packed[g][kp] holds 16 outputs x 2 inputs
// (n0k0, n0k1, n1k0, n1k1, ...): one 64-byte load feeds one VDPBF16PS, which adds a broadcast input
// pair times 16 outputs' weights into 16 fp32 sums. A group's whole K is contiguous, so each group is
// one sequential stream. Zero padding to whole groups and pairs makes every load full.
//
// Tile: MR rows of x (1..6) by NV groups (1..4) of outputs, MR*NV fp32 accumulators in registers; the
// tile's weights (K x 16*NV) stay in L2 while further row blocks reuse them, and (from 12 rows) the second
// block prefetches the next tile's into L2. Threads (at::parallel_for,
// torch's intra-op pool) split the output groups. fp32 accumulation, one rounding to bf16 at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "packed_bf16.h"

#include <cstdint>
#include <cstring>
#include "ops.h"

namespace {

#define LLMSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kGroup = 16;  // outputs per group: one zmm of fp32 sums
constexpr int kMaxRows = 6;      // rows of x per tile
constexpr int kMaxGroups = 4;    // output groups per tile

bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
}

// [N, K] bf16 -> [ceil(N/16), ceil(K/2), 32] bf16 (zero padded).
at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack_weight: [N, K] bfloat16");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t groups = (n + kGroup - 1) / kGroup, pairs = (k + 1) / 2;
  at::Tensor packed = at::zeros({groups, pairs, 2 * kGroup}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j) {
        const uint16_t* row = src + (g * kGroup + j) * k;
        uint16_t* out = dst + g * pairs * 2 * kGroup + 2 * j;
        for (int64_t i = 0; i < k; ++i) out[(i / 2) * 2 * kGroup + (i % 2)] = row[i];
      }
    }
  });
  return packed;
}

// next: the following tile's weights, to prefetch into L2 alongside these (or null).
template <int MR, int NV>
LLMSERVE_AVX512_BF16 void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, const float* bias,
                               uint16_t* y, int64_t ldy, int64_t valid, const uint16_t* next) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t group_stride = pairs * 2 * kGroup;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + v * group_stride + kp * 2 * kGroup);
    if (next != nullptr)
      for (int v = 0; v < kMaxGroups; ++v) _mm_prefetch(reinterpret_cast<const char*>(next + v * group_stride + kp * 2 * kGroup), _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v)
        acc[m][v] = _mm512_dpbf16_ps(acc[m][v], reinterpret_cast<__m512bh&>(wv[v]), reinterpret_cast<const __m512bh&>(xv));
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = valid - v * kGroup;
    if (left <= 0) break;
    const __mmask16 mask = left >= kGroup ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + v * kGroup) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b));
      _mm256_mask_storeu_epi16(y + m * ldy + v * kGroup, mask, reinterpret_cast<const __m256i&>(out));
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t, int64_t,
                        const uint16_t*);

template <int MR>
constexpr TileFn tile_for(int nv) {
  return nv == 1 ? &tile<MR, 1> : nv == 2 ? &tile<MR, 2> : nv == 3 ? &tile<MR, 3> : &tile<MR, 4>;
}

TileFn pick(int mr, int nv) {
  switch (mr) {
    case 1: return tile_for<1>(nv);
    case 2: return tile_for<2>(nv);
    case 3: return tile_for<3>(nv);
    case 4: return tile_for<4>(nv);
    case 5: return tile_for<5>(nv);
    default: return tile_for<6>(nv);
  }
}

// x [..., K] bf16, packed from bf16_pack_weight of an [N, K] weight, bias [N] fp32 or empty -> [..., N] bf16.
at::Tensor bf16_linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "bf16_linear_packed: this CPU lacks AVX512-BF16");
  const llmserve::PackedBf16Call c = llmserve::begin_packed_bf16_call(x, packed, n, bias, "bf16_linear_packed");
  const int64_t rows = c.rows, k = c.k, pairs = c.pairs, used_groups = c.used_groups;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(c.x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(c.y.data_ptr());
  const float* bp = c.bias32.defined() ? c.bias32.data_ptr<float>() : nullptr;
  // Threads take runs of output groups; a run is cut into tiles of up to 4 groups.
  at::parallel_for(0, used_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += kMaxGroups) {
      const int nv = static_cast<int>(std::min<int64_t>(kMaxGroups, end - g));
      const int64_t valid = std::min<int64_t>(n - g * kGroup, nv * kGroup);
      // Two or more full row blocks: the second asks for the next tile's weights (into L2) as it goes, so their
      // stream from DRAM runs under this tile's arithmetic instead of stalling the next tile's first block
      // (measured on the Zen 4 host: 12-32 rows 8-26% faster, 64 and more within noise; with a shorter second
      // block, as at 8 rows, the requests outran it and cost 9-12%).
      const int64_t next_g = g + kMaxGroups;
      const uint16_t* next =
          rows >= 2 * kMaxRows && next_g + kMaxGroups <= end ? wp + next_g * pairs * 2 * kGroup : nullptr;
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
        pick(mr, nv)(xp + r * k, k, wp + g * pairs * 2 * kGroup, pairs, bp != nullptr ? bp + g * kGroup : nullptr,
                     yp + r * n + g * kGroup, n, valid, r == kMaxRows ? next : nullptr);
      }
    }
  });
  return c.y.view(c.shape);
}

bool bf16_linear_available() { return cpu_has_avx512_bf16(); }

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
at::Tensor bf16_linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              const c10::optional<at::Tensor>& bias) {
  return ::bf16_linear_packed(x, packed, n, bias);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.def("bf16_pack_weight(Tensor weight) -> Tensor", &bf16_pack_weight);
  m.def("bf16_linear_packed(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("bf16_linear_packed", &bf16_linear_packed); }
