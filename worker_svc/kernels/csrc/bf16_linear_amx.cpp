// bf16 linear y = x W^T (+ b) on CPUs with AMX-BF16 (Sapphire Rapids and later), on the weight that
// bf16_linear_avx512.cpp packs: no second copy of the weights.
//
// Why: VDPBF16PS (bf16_linear_avx512.cpp) broadcasts one input pair per instruction, so its cost grows
// with the rows of x: at 16 rows it is already compute-bound, at prefill sizes 5x slower than oneDNN.
// One TDPBF16PS multiplies a 16 x 32 tile of x by a 32 x 16 tile of W (8192 products).
//
// Layout: packed[g][kp] holds 16 outputs x 2 inputs (n0k0, n0k1, n1k0, n1k1, ...), which is exactly
// AMX's "VNNI" B operand: 16 consecutive pairs kp..kp+15 of one group are one B tile (16 rows of 64
// bytes, contiguous). An A tile is 16 rows of x by 32 inputs, read in place with x's row stride.
//
// Tiles: tmm0-3 accumulate C for up to 2 row blocks x 2 output groups, tmm4-5 hold A, tmm6-7 hold B.
// A tile is always 16 rows, so one tile configuration serves every call: when rows % 16 != 0 the last
// (partial) row block is read from a zero-padded copy of those rows alone (16 x K). A zeroed copy of all of
// x, as before, made a layer's four linears 15% slower at 386 rows than at 384 (2% now): a mixed step's
// riders are rarely a multiple of 16. Accumulators go through a per-thread fp32 buffer to add the bias and
// round once to bf16. Threads split the output groups, as in the AVX512-BF16 kernel.
// in_features must be a multiple of 32 (whole A/B tiles); the caller keeps the VDPBF16PS kernel otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "packed_bf16.h"

#include <algorithm>
#include <cstdint>
#include "ops.h"

namespace {

using llmserve::cpu_has_amx_bf16;
using llmserve::load_amx_tile_config;

constexpr int64_t kGroup = 16;  // outputs per group (one B tile's columns)
constexpr int64_t kTileRows = llmserve::kAmxTileRows;
constexpr int64_t kTileK = llmserve::kAmxTileK;

// C tiles -> bf16 y (+ bias): rows [0, valid_rows) of the block, columns [0, valid_cols) of the group.
LLMSERVE_AMX void store_block(const float* c, const float* bias, uint16_t* y, int64_t ldy, int64_t valid_rows,
                              int64_t valid_cols) {
  if (valid_cols <= 0) return;
  const __mmask16 mask =
      valid_cols >= kGroup ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid_cols) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int64_t m = 0; m < valid_rows; ++m) {
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + m * kGroup), b));
    _mm256_mask_storeu_epi16(y + m * ldy, mask, reinterpret_cast<const __m256i&>(out));
  }
}

// One tile step: MB row blocks (1..2, their 16 rows at x0 / x1, K apart) x NB output groups (1..2) over the
// whole K.
template <int MB, int NB>
LLMSERVE_AMX void block(const uint16_t* x0, const uint16_t* x1, int64_t k, const uint16_t* w, int64_t group_stride,
                        float* c) {
  llmserve::amx_zero<MB, NB>();
  for (int64_t kc = 0; kc < k; kc += kTileK)  // B: pairs kc/2 .. kc/2+15 of the group, 16 rows of 64 bytes
    llmserve::amx_step<MB, NB>(x0 + kc, x1 + kc, k * 2, w + kc * kGroup, w + group_stride + kc * kGroup);
  llmserve::amx_store<MB, NB>(c);
}

using BlockFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, float*);

BlockFn pick(int mb, int nb) {
  if (mb == 2) return nb == 2 ? &block<2, 2> : &block<2, 1>;
  return nb == 2 ? &block<1, 2> : &block<1, 1>;
}

// Rows of x one pass over a thread's output groups reads: its A tiles come from L2 once per output-group
// pair, so the block must stay there (L2 is 1-2 MiB a core). Without the blocking, 2048 rows x 576 inputs
// (2.3 MiB) streamed from L3 for every pair, and 2048-row prefills ran at 60% of oneDNN's rate. Blocks are
// balanced whole 32-row steps, so a 256-row call is not split 224 + 32.
constexpr int64_t kRowBlockBytes = 512 * 1024;

int64_t balanced_row_block(int64_t rows, int64_t k) {
  const int64_t step = 2 * kTileRows;
  const int64_t max_rows = std::max<int64_t>(step, kRowBlockBytes / (2 * k) / step * step);
  const int64_t blocks = (rows + max_rows - 1) / max_rows;
  return ((rows + blocks - 1) / blocks + step - 1) / step * step;
}

// Output groups [begin, end) for every row: one thread's share. Row blocks outside, output-group pairs
// inside: a pair's B tiles (64 x K bytes) stay in L1 across the block's rows. tail: x's last rows % 16 rows
// followed by zero rows, 16 x K (null when rows % 16 == 0).
LLMSERVE_AMX void run_groups(int64_t begin, int64_t end, const uint16_t* xp, const uint16_t* tail, int64_t rows,
                             int64_t k, const uint16_t* wp, int64_t group_stride, const float* bp, uint16_t* yp,
                             int64_t n) {
  const int64_t whole_rows = rows / kTileRows * kTileRows;  // rows past this are read from tail
  const auto a_rows = [&](int64_t r0) { return r0 < whole_rows ? xp + r0 * k : tail; };
  load_amx_tile_config();  // tile state is per thread
  alignas(64) float c[4 * llmserve::kAmxTileFloats];
  const int64_t block_rows = balanced_row_block(rows, k);
  for (int64_t block_begin = 0; block_begin < rows; block_begin += block_rows) {
    const int64_t block_end = std::min(rows, block_begin + block_rows);
    for (int64_t g = begin; g < end; g += 2) {
      const int nb = static_cast<int>(std::min<int64_t>(2, end - g));
      for (int64_t r = block_begin; r < block_end; r += 2 * kTileRows) {
        const int mb = block_end - r > kTileRows ? 2 : 1;
        pick(mb, nb)(a_rows(r), a_rows(r + kTileRows), k, wp + g * group_stride, group_stride, c);
        for (int i = 0; i < mb; ++i) {
          const int64_t r0 = r + i * kTileRows, valid_rows = std::min<int64_t>(kTileRows, rows - r0);
          for (int j = 0; j < nb; ++j) {
            const int64_t col = (g + j) * kGroup;
            const float* tile = c + (i * 2 + j) * llmserve::kAmxTileFloats;  // as amx_store puts them
            store_block(tile, bp != nullptr ? bp + col : nullptr, yp + r0 * n + col, n, valid_rows, n - col);
          }
        }
      }
    }
  }
  _tile_release();
}

// x [..., K] bf16, packed from bf16_pack_weight of an [N, K] weight, bias [N] fp32 or empty -> [..., N] bf16.
at::Tensor bf16_linear_packed_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_has_amx_bf16(), "bf16_linear_packed_amx: this CPU (or the OS) does not grant AMX-BF16");
  TORCH_CHECK(x.size(-1) % kTileK == 0, "bf16_linear_packed_amx: in_features must be a multiple of 32");
  const llmserve::PackedBf16Call c = llmserve::begin_packed_bf16_call(x, packed, n, bias, "bf16_linear_packed_amx");
  const int64_t rows = c.rows, k = c.k, pairs = c.pairs, used_groups = c.used_groups;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(c.x.data_ptr());
  // The partial last row block as a whole A tile: its rows, then zeros (their outputs are never stored).
  const int64_t whole_rows = rows / kTileRows * kTileRows;
  at::Tensor tail;
  if (whole_rows != rows) {
    tail = at::zeros({kTileRows, k}, c.x.options());
    tail.narrow(0, 0, rows - whole_rows).copy_(c.x.narrow(0, whole_rows, rows - whole_rows));
  }
  const uint16_t* tp = tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr()) : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(c.y.data_ptr());
  const float* bp = c.bias32.defined() ? c.bias32.data_ptr<float>() : nullptr;
  const int64_t group_stride = pairs * 2 * kGroup;  // elements
  at::parallel_for(0, used_groups, 1, [&](int64_t begin, int64_t end) {
    run_groups(begin, end, xp, tp, rows, k, wp, group_stride, bp, yp, n);
  });
  return c.y.view(c.shape);
}

bool bf16_linear_amx_available() { return cpu_has_amx_bf16(); }

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
at::Tensor bf16_linear_packed_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                  const c10::optional<at::Tensor>& bias) {
  return ::bf16_linear_packed_amx(x, packed, n, bias);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("bf16_linear_amx_available() -> bool", &bf16_linear_amx_available);
  m.def("bf16_linear_packed_amx(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("bf16_linear_packed_amx", &bf16_linear_packed_amx); }
