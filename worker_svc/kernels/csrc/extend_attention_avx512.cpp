// Extend (prefill) attention for bf16 on AVX512-BF16: one request's new tokens over its whole context, causal
// with the cached prefix in front, in one flash-attention pass (attention/torch_native.py, _extend).
//
// Why: SDPA's CPU flash kernel ran a 512-token causal prefill of SmolLM2's heads at ~70 GFLOP/s on the Zen 4
// host, 31% of the prefill, where this library's packed bf16 linears run VDPBF16PS at ~440 (docs/benchmarks.md).
// Here both products are VDPBF16PS on operands packed for it:
//   scores: a tile of 4 query rows x 64 keys in 16 fp32 registers; per pair of head dims, the query pair
//           (q[2p], q[2p + 1]) broadcast as one 32-bit word against the packed keys [64 keys][2].
//   P . V:  per pair of keys, their two probabilities (bf16) broadcast against the packed values [Dv][2].
// Scores stay fp32 (bf16 products are exact in fp32); the online softmax (running max and sum per row) is
// fp32; P is rounded to bf16 for its product with V, as SDPA's kernel rounds it for bf16 inputs.
//
// Packing, per call (O(context x head dims), against the products' O(tokens x context x head dims)):
//   keys   [kv_heads][key blocks][Dk / 2][64 keys][2]: a block's 4 vectors for one pair of dims adjacent.
//   values [kv_heads][key pairs][Dv][2].
// Padding keys (to whole blocks of 64) are zeros, and masked: their probabilities are exactly 0.
//
// Threads take tasks (a query head x a block of 32 query rows) from a shared counter, the costliest (last
// rows: the most keys) first.
//
// AMX (run_task_amx, CPUs with AMX-BF16, key heads a multiple of 32): the same packing is AMX's B operand
// for both products, so each product is tile multiplies (TDPBF16PS: 16 x 32 by 32 x 16) instead of
// broadcast VDPBF16PS: scores of 16 query rows x 64 keys are Dk / 32 x 4 tile products against the query rows
// (A, 16 rows x 32 dims); P . V are 2 x Dv / 16 tile products of P (A: 16 rows x 32 keys, bf16) against the
// packed values. Same fp32 scores and bf16 P as the AVX512-BF16 path; the block's P . V is added to the
// running output (rescaled by the row's correction) in fp32. Tasks are 16 query rows. Its online softmax takes
// the 16 rows together (the softmax, not the tile products, was half of a 64-token extend over a 512-token
// prefix): row maxima and sums by one transposing reduction of the 16 rows (reduce_rows) instead of a horizontal
// reduction per row, masks only in blocks some row sees in part, and exp2 of the scores scaled by
// scale * log2(e) in one FMA (exp2_nonpositive: no range reduction by ln 2). Same accuracy (tests), 1.1-1.5x
// faster a call on the AMX Xeon host (docs/benchmarks.md, 2026-12-05).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "avx512.h"

namespace {

using llmserve::cpu_has_avx512_bf16;
using llmserve::dot_bf16;
using llmserve::exp2_nonpositive;
using llmserve::first_lanes;

constexpr int64_t kLanes = 16;
constexpr int64_t kKeyBlock = 64;                  // keys per score tile
constexpr int kKeyVecs = kKeyBlock / kLanes;       // 4 registers per tile row
constexpr int kRows = 4;                           // query rows per score tile
constexpr int64_t kQueryBlock = 32;                // query rows per task (a multiple of kRows)
constexpr int64_t kValueChunk = 64;                // values accumulated per pass: 4 registers per row

// Where a context row lives: keys / values [rows, kv_heads, D] (last dim contiguous, any row and head
// strides), context row c at row slots[c] (or c without slots).
struct Source {
  const uint16_t* base;
  int64_t row_stride, head_stride;  // elements
  const int64_t* slots;
  const uint16_t* row(int64_t c, int64_t head) const {
    return base + (slots ? slots[c] : c) * row_stride + head * head_stride;
  }
};

// In place: m[r] word c <- m[c] word r (a 16 x 16 transpose of 32-bit words).
LLMSERVE_AVX512 inline void transpose16(__m512i (&m)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(m[i + j], m[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(m[i + j], m[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    m[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    m[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// pack_key_block for key heads of whole 32-dim tiles: 16 keys x 16 dim pairs transposed in registers (the
// scalar copy took about half of a 64-token chunk's attention over a 512-token prefix on AMX).
LLMSERVE_AVX512 void pack_key_block_avx512(const Source& keys, int64_t h, int64_t b, int64_t C, int64_t Dk,
                                           uint32_t* dst) {
  const int64_t pairs = Dk / 2;
  for (int64_t i0 = 0; i0 < kKeyBlock; i0 += kLanes) {
    const uint32_t* rows[kLanes];  // null past the context: zero keys
    for (int64_t r = 0; r < kLanes; ++r) {
      const int64_t c = b * kKeyBlock + i0 + r;
      rows[r] = c < C ? reinterpret_cast<const uint32_t*>(keys.row(c, h)) : nullptr;
    }
    for (int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
      __m512i m[kLanes];
      for (int64_t r = 0; r < kLanes; ++r) m[r] = rows[r] ? _mm512_loadu_si512(rows[r] + p0) : _mm512_setzero_si512();
      transpose16(m);
      for (int64_t r = 0; r < kLanes; ++r) _mm512_storeu_si512(dst + (p0 + r) * kKeyBlock + i0, m[r]);
    }
  }
}

// Keys of kv head h, block b -> packed [Dk / 2][64][2] (as 32-bit words: [Dk / 2][64]).
void pack_key_block(const Source& keys, int64_t h, int64_t b, int64_t C, int64_t Dk, uint32_t* dst) {
  if (Dk % 32 == 0) return pack_key_block_avx512(keys, h, b, C, Dk, dst);
  const int64_t pairs = Dk / 2;
  for (int64_t i = 0; i < kKeyBlock; ++i) {
    const int64_t c = b * kKeyBlock + i;
    if (c >= C) {
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeyBlock + i] = 0;
      continue;
    }
    const uint32_t* src = reinterpret_cast<const uint32_t*>(keys.row(c, h));
    for (int64_t p = 0; p < pairs; ++p) dst[p * kKeyBlock + i] = src[p];
  }
}

// Values of kv head h, block b -> packed [32 key pairs][Dv][2]: word (j, d) = (V[2j][d], V[2j + 1][d]).
LLMSERVE_AVX512 void pack_value_block(const Source& values, int64_t h, int64_t b, int64_t C, int64_t Dv,
                                      uint32_t* dst) {
  for (int64_t j = 0; j < kKeyBlock / 2; ++j) {
    const int64_t c = b * kKeyBlock + 2 * j;
    uint32_t* out = dst + j * Dv;
    const uint16_t* even = c < C ? values.row(c, h) : nullptr;
    const uint16_t* odd = c + 1 < C ? values.row(c + 1, h) : nullptr;
    int64_t d = 0;
    for (; d + kLanes <= Dv; d += kLanes) {
      const __m512i lo = even ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)))
                              : _mm512_setzero_si512();
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d)))
                             : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; d < Dv; ++d)
      out[d] = (even ? uint32_t(even[d]) : 0u) | ((odd ? uint32_t(odd[d]) : 0u) << 16);
  }
}

struct Problem {
  const uint16_t* q;
  int64_t q_row, q_head;  // elements between query rows, between heads
  int64_t T, prefix, Hq, Hkv, Dk, Dv;
  float scale;
  const uint32_t* keys;    // packed, per kv head key_blocks * Dk / 2 * 64 words
  const uint32_t* values;  // packed, per kv head key_blocks * 32 * Dv words
  int64_t key_blocks;
  uint16_t* out;  // [T, Hq, Dv]
};

// The task's output rows: o [rows][Dv] / sum, rounded to bf16, to out[t0 + r][hq].
LLMSERVE_AVX512 void store_rows(const Problem& pb, int64_t hq, int64_t t0, int64_t rows, const float* o,
                                const float* sum) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    uint16_t* dst = pb.out + ((t0 + r) * pb.Hq + hq) * pb.Dv;
    for (int64_t d = 0; d < pb.Dv; d += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          llmserve::to_bf16(_mm512_mul_ps(_mm512_loadu_ps(o + r * pb.Dv + d), inv)));
  }
}

// Per thread: a task's running state.
struct TaskState {
  std::vector<float> o;      // [kQueryBlock][Dv] fp32 output accumulators
  std::vector<float> max, sum;
  alignas(64) uint32_t probs[kRows][kKeyBlock / 2];  // P of a tile as bf16 pairs
};

// o[rows][chunk] = o * corr + P . V over `pairs` key pairs of the block, CW registers (16 CW values) per row.
template <int CW>
LLMSERVE_AVX512_BF16 void accumulate_values(float* o, int64_t Dv, const float* corr,
                                            const uint32_t (&probs)[kRows][kKeyBlock / 2], const uint32_t* v,
                                            int64_t pairs) {
  __m512 acc[kRows][CW];
  for (int m = 0; m < kRows; ++m)
    for (int c = 0; c < CW; ++c) acc[m][c] = _mm512_mul_ps(_mm512_loadu_ps(o + m * Dv + c * kLanes), _mm512_set1_ps(corr[m]));
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i value[CW];
    for (int c = 0; c < CW; ++c) value[c] = _mm512_loadu_si512(v + j * Dv + c * kLanes);
    for (int m = 0; m < kRows; ++m) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(probs[m][j]));
      for (int c = 0; c < CW; ++c) acc[m][c] = dot_bf16(acc[m][c], value[c], p);
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(o + m * Dv + c * kLanes, acc[m][c]);
}

// Query head hq, rows [t0, t0 + rows) of the block.
LLMSERVE_AVX512_BF16 void run_task(const Problem& pb, int64_t hq, int64_t t0, int64_t rows, TaskState& st) {
  const int64_t h = hq / (pb.Hq / pb.Hkv), pairs = pb.Dk / 2;
  const uint32_t* keys = pb.keys + h * pb.key_blocks * pairs * kKeyBlock;
  const uint32_t* values = pb.values + h * pb.key_blocks * (kKeyBlock / 2) * pb.Dv;
  std::fill(st.o.begin(), st.o.end(), 0.f);
  std::fill(st.max.begin(), st.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(st.sum.begin(), st.sum.end(), 0.f);
  // Scores in log2 units (scale * log2(e)): the softmax is exp2 (exp2_nonpositive), without exp's range reduction.
  const __m512 scale2 = _mm512_set1_ps(pb.scale * 1.44269504088896341f);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // The last row sees keys [0, prefix + t0 + rows).
  const int64_t blocks = (pb.prefix + t0 + rows + kKeyBlock - 1) / kKeyBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* kb = keys + b * pairs * kKeyBlock;
    const uint32_t* vb = values + b * (kKeyBlock / 2) * pb.Dv;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int live_rows = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      // Keys of this block each row sees (rows past the block's end repeat its last row, unused).
      int64_t seen[kRows];
      const uint32_t* q[kRows];
      for (int m = 0; m < kRows; ++m) {
        const int64_t t = t0 + r0 + std::min(m, live_rows - 1);
        seen[m] = std::clamp<int64_t>(pb.prefix + t + 1 - b * kKeyBlock, 0, kKeyBlock);
        q[m] = reinterpret_cast<const uint32_t*>(pb.q + t * pb.q_row + hq * pb.q_head);
      }
      if (seen[kRows - 1] == 0) continue;  // causal: the whole block is after these rows
      __m512 s[kRows][kKeyVecs];
      for (int m = 0; m < kRows; ++m)
        for (int v = 0; v < kKeyVecs; ++v) s[m][v] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        __m512i k[kKeyVecs];
        for (int v = 0; v < kKeyVecs; ++v) k[v] = _mm512_loadu_si512(kb + p * kKeyBlock + v * kLanes);
        for (int m = 0; m < kRows; ++m) {
          const __m512i qp = _mm512_set1_epi32(static_cast<int>(q[m][p]));
          for (int v = 0; v < kKeyVecs; ++v) s[m][v] = dot_bf16(s[m][v], k[v], qp);
        }
      }
      // Scale, mask and each row's new running max; then one vector exp for the 4 rows' corrections.
      alignas(64) float shift_by[kLanes] = {};
      for (int m = 0; m < kRows; ++m) {
        __m512 peak = minus_inf;
        for (int v = 0; v < kKeyVecs; ++v) {
          s[m][v] = _mm512_mask_mul_ps(minus_inf, first_lanes(seen[m] - v * kLanes), s[m][v], scale2);
          peak = _mm512_max_ps(peak, s[m][v]);
        }
        float& row_max = st.max[r0 + m];
        // Every row sees key 0 in block 0, so the new max is finite; the first block's correction is 2^-inf = 0.
        const float new_max = std::max(row_max, _mm512_reduce_max_ps(peak));
        shift_by[m] = row_max - new_max;
        row_max = new_max;
      }
      alignas(64) float corr[kLanes];
      _mm512_store_ps(corr, exp2_nonpositive(_mm512_load_ps(shift_by)));
      for (int m = 0; m < kRows; ++m) {
        const __m512 shift = _mm512_set1_ps(st.max[r0 + m]);
        __m512 total = _mm512_setzero_ps();
        for (int v = 0; v < kKeyVecs; ++v) {
          s[m][v] = exp2_nonpositive(_mm512_sub_ps(s[m][v], shift));
          total = _mm512_add_ps(total, s[m][v]);
        }
        st.sum[r0 + m] = st.sum[r0 + m] * corr[m] + _mm512_reduce_add_ps(total);
        for (int v = 0; v < kKeyVecs; v += 2) {
          const __m512bh pair = _mm512_cvtne2ps_pbh(s[m][v + 1], s[m][v]);  // keys 16 v .. 16 v + 31 in order
          _mm512_store_si512(st.probs[m] + v * kLanes / 2, reinterpret_cast<const __m512i&>(pair));
        }
      }
      const int64_t key_pairs = (seen[kRows - 1] + 1) / 2;  // the last row sees the most
      float* o = st.o.data() + r0 * pb.Dv;
      int64_t d = 0;
      for (; d + kValueChunk <= pb.Dv; d += kValueChunk)
        accumulate_values<kValueChunk / kLanes>(o + d, pb.Dv, corr, st.probs, vb + d, key_pairs);
      if (d < pb.Dv) accumulate_values<2>(o + d, pb.Dv, corr, st.probs, vb + d, key_pairs);  // Dv % 64 == 32
    }
  }
  store_rows(pb, hq, t0, rows, st.o.data(), st.sum.data());
}

// ---- AMX ------------------------------------------------------------------------------------------------

constexpr int64_t kAmxRows = llmserve::kAmxTileRows;  // query rows per task: one A tile
constexpr int64_t kAmxDimGroup = 16;                   // output dims (or keys) per C tile

struct AmxTaskState {
  std::vector<uint16_t> q;                             // [16][Dk]: the task's query rows, zero past the last
  std::vector<float> o;                                // [16][Dv] fp32 output accumulators
  alignas(64) float max[kAmxRows];                    // per row: the running max score (unscaled)
  alignas(64) float sum[kAmxRows];                    // and the running sum of exp2(scaled score - scaled max)
  alignas(64) float scores[kAmxRows][kKeyBlock];       // C tiles 0-3 of the score product
  alignas(64) uint16_t probs[kAmxRows][kKeyBlock];     // P in bf16, keys in order: A of the value product
  alignas(64) float pv[kAmxRows][4 * kAmxDimGroup];    // C tiles 0-3 of a value product (64 dims)
};

// C tiles 0..n-1 (n <= 4): zero / store with a row stride of `stride` bytes, tile g at column 16 g.
LLMSERVE_AMX inline void zero_tiles(int n) {
  _tile_zero(0);
  if (n > 1) _tile_zero(1);
  if (n > 2) _tile_zero(2);
  if (n > 3) _tile_zero(3);
}

LLMSERVE_AMX inline void store_tiles(int n, float* c, int64_t stride) {
  _tile_stored(0, c, stride);
  if (n > 1) _tile_stored(1, c + kAmxDimGroup, stride);
  if (n > 2) _tile_stored(2, c + 2 * kAmxDimGroup, stride);
  if (n > 3) _tile_stored(3, c + 3 * kAmxDimGroup, stride);
}

// tmm4 holds A; C tile g += A . B_g for g < n, B_g at b + g * b_step words (16 rows, b_stride bytes apart).
LLMSERVE_AMX inline void multiply_tiles(int n, const uint32_t* b, int64_t b_step, int64_t b_stride) {
  _tile_loadd(6, b, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  if (n > 1) {
    _tile_loadd(7, b + b_step, b_stride);
    _tile_dpbf16ps(1, 4, 7);
  }
  if (n > 2) {
    _tile_loadd(6, b + 2 * b_step, b_stride);
    _tile_dpbf16ps(2, 4, 6);
  }
  if (n > 3) {
    _tile_loadd(7, b + 3 * b_step, b_stride);
    _tile_dpbf16ps(3, 4, 7);
  }
}

struct Max {
  LLMSERVE_AVX512 static __m512 apply(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
};
struct Sum {
  LLMSERVE_AVX512 static __m512 apply(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
};

// 16 vectors -> one whose lane i is the reduction (Op) of v[i]'s 16 lanes: each step halves the vectors and the
// partials per row (46 shuffles and ops, where 16 horizontal reductions take ~130 and a dependent chain each).
template <class Op>
LLMSERVE_AVX512 inline __m512 reduce_rows(__m512 (&v)[16]) {
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1: row i's 8 partials, 2-3: row i + 8's
    v[i] = Op::apply(_mm512_shuffle_f32x4(v[i], v[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                     _mm512_shuffle_f32x4(v[i], v[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // lanes: rows i, i + 8, i + 4, i + 12, 4 partials each
    v[i] = Op::apply(_mm512_shuffle_f32x4(v[i], v[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm512_shuffle_f32x4(v[i], v[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // per lane, 2 partials of each of two rows: (i, i + 2), (i + 8, i + 10), ...
    v[i] = Op::apply(_mm512_shuffle_ps(v[i], v[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                     _mm512_shuffle_ps(v[i], v[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  // Per lane, one value per row: lane 0 holds rows 0, 2, 1, 3; lane 1 rows 8, 10, 9, 11; lane 2 4, 6, 5, 7; ...
  const __m512 r = Op::apply(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i in_row_order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(in_row_order, r);
}

// Scores of a block some rows see only in part: row m (up to the last live row, `rows` - 1; later rows repeat it)
// sees its first `first_row_sees` + m keys (clamped to [0, 64]); the rest become -inf.
LLMSERVE_AVX512 void mask_hidden_keys(float (&scores)[kAmxRows][kKeyBlock], int64_t first_row_sees, int64_t rows) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < kAmxRows; ++m) {
    const int64_t seen = std::clamp<int64_t>(first_row_sees + std::min(m, rows - 1), 0, kKeyBlock);
    for (int v = 0; v < kKeyVecs; ++v) {
      const __mmask16 hide = static_cast<__mmask16>(~first_lanes(seen - v * kLanes));
      if (hide != 0) _mm512_mask_storeu_ps(scores[m] + v * kLanes, hide, minus_inf);
    }
  }
}

// Query head hq, rows [t0, t0 + rows) (rows <= 16), as run_task computes them.
LLMSERVE_AMX void run_task_amx(const Problem& pb, int64_t hq, int64_t t0, int64_t rows, AmxTaskState& st) {
  const int64_t h = hq / (pb.Hq / pb.Hkv), pairs = pb.Dk / 2;
  const uint32_t* keys = pb.keys + h * pb.key_blocks * pairs * kKeyBlock;
  const uint32_t* values = pb.values + h * pb.key_blocks * (kKeyBlock / 2) * pb.Dv;
  std::fill(st.q.begin(), st.q.end(), uint16_t{0});
  for (int64_t m = 0; m < rows; ++m)
    std::memcpy(st.q.data() + m * pb.Dk, pb.q + (t0 + m) * pb.q_row + hq * pb.q_head, pb.Dk * sizeof(uint16_t));
  std::fill(st.o.begin(), st.o.end(), 0.f);
  std::fill(st.max, st.max + kAmxRows, -std::numeric_limits<float>::infinity());
  std::fill(st.sum, st.sum + kAmxRows, 0.f);
  const __m512 scale2 = _mm512_set1_ps(pb.scale * 1.44269504088896341f);  // scores -> log2 units
  const int64_t blocks = (pb.prefix + t0 + rows + kKeyBlock - 1) / kKeyBlock;  // the last row's keys
  for (int64_t b = 0; b < blocks; ++b) {
    // Scores: 16 rows x 64 keys, Dk / 32 steps of 4 tile products (B: 16 dim pairs x 16 keys, 256 bytes a row).
    const uint32_t* kb = keys + b * pairs * kKeyBlock;
    zero_tiles(4);
    for (int64_t kc = 0; kc < pb.Dk; kc += llmserve::kAmxTileK) {
      _tile_loadd(4, st.q.data() + kc, pb.Dk * sizeof(uint16_t));
      multiply_tiles(4, kb + (kc / 2) * kKeyBlock, kAmxDimGroup, kKeyBlock * sizeof(uint32_t));
    }
    store_tiles(4, &st.scores[0][0], kKeyBlock * sizeof(float));
    // Online softmax, the 16 rows together (exp2 of scores scaled by scale * log2(e); their max per row by a
    // transposing reduction rather than one horizontal reduction per row). Only a block that reaches past the
    // first row's last key needs a mask: its hidden keys become -inf (rows past the last live one repeat its
    // mask; their output is never stored).
    const int64_t first_row_sees = pb.prefix + t0 + 1 - b * kKeyBlock;
    if (first_row_sees < kKeyBlock) mask_hidden_keys(st.scores, first_row_sees, rows);
    __m512 row_peaks[kAmxRows];
    for (int64_t m = 0; m < kAmxRows; ++m) {
      const float* s = st.scores[m];
      row_peaks[m] = _mm512_max_ps(_mm512_max_ps(_mm512_load_ps(s), _mm512_load_ps(s + kLanes)),
                                   _mm512_max_ps(_mm512_load_ps(s + 2 * kLanes), _mm512_load_ps(s + 3 * kLanes)));
    }
    // Every row sees key 0 in block 0, so the new max is finite; the first block's correction is 2^-inf = 0.
    const __m512 old_max = _mm512_load_ps(st.max);
    const __m512 new_max = _mm512_max_ps(old_max, reduce_rows<Max>(row_peaks));
    _mm512_store_ps(st.max, new_max);
    alignas(64) float corr[kAmxRows], shift[kAmxRows];
    const __m512 corr16 = exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), scale2));
    _mm512_store_ps(corr, corr16);
    _mm512_store_ps(shift, _mm512_mul_ps(new_max, scale2));
    __m512 row_sums[kAmxRows];
    for (int64_t m = 0; m < kAmxRows; ++m) {
      const __m512 by = _mm512_set1_ps(shift[m]);
      __m512 e[kKeyVecs];
      for (int v = 0; v < kKeyVecs; ++v)
        e[v] = exp2_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(st.scores[m] + v * kLanes), scale2, by));
      row_sums[m] = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
      for (int v = 0; v < kKeyVecs; v += 2) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(e[v + 1], e[v]);  // keys 16 v .. 16 v + 31 in order
        _mm512_store_si512(st.probs[m] + v * kLanes, reinterpret_cast<const __m512i&>(pair));
      }
    }
    _mm512_store_ps(st.sum, _mm512_fmadd_ps(_mm512_load_ps(st.sum), corr16, reduce_rows<Sum>(row_sums)));
    // P . V, 64 output dims at a time: 2 key halves x up to 4 tile products (B: 16 key pairs x 16 dims).
    const uint32_t* vb = values + b * (kKeyBlock / 2) * pb.Dv;
    for (int64_t d0 = 0; d0 < pb.Dv; d0 += 4 * kAmxDimGroup) {
      const int groups = static_cast<int>(std::min<int64_t>(4, (pb.Dv - d0) / kAmxDimGroup));
      zero_tiles(groups);
      for (int64_t half = 0; half < 2; ++half) {
        _tile_loadd(4, &st.probs[0][0] + half * (kKeyBlock / 2), kKeyBlock * sizeof(uint16_t));
        multiply_tiles(groups, vb + half * (kKeyBlock / 4) * pb.Dv + d0, kAmxDimGroup, pb.Dv * sizeof(uint32_t));
      }
      store_tiles(groups, &st.pv[0][0], 4 * kAmxDimGroup * sizeof(float));
      for (int64_t m = 0; m < rows; ++m) {
        const __m512 c = _mm512_set1_ps(corr[m]);
        float* o = st.o.data() + m * pb.Dv + d0;
        for (int g = 0; g < groups; ++g)
          _mm512_storeu_ps(o + g * kLanes, _mm512_fmadd_ps(_mm512_loadu_ps(o + g * kLanes), c,
                                                           _mm512_load_ps(st.pv[m] + g * kLanes)));
      }
    }
  }
  store_rows(pb, hq, t0, rows, st.o.data(), st.sum);
}

LLMSERVE_AMX void run_tasks_amx(const Problem& pb, std::atomic<int64_t>& next, int64_t query_blocks) {
  llmserve::load_amx_tile_config();  // tile state is per thread
  AmxTaskState st;
  st.q.resize(kAmxRows * pb.Dk);
  st.o.resize(kAmxRows * pb.Dv);
  const int64_t tasks = query_blocks * pb.Hq;
  for (int64_t i = next++; i < tasks; i = next++) {
    const int64_t qb = query_blocks - 1 - i / pb.Hq, hq = i % pb.Hq;  // the last blocks (most keys) first
    const int64_t t0 = qb * kAmxRows;
    run_task_amx(pb, hq, t0, std::min(kAmxRows, pb.T - t0), st);
  }
  _tile_release();
}

bool amx_fits(int64_t Dk, int64_t Dv) { return llmserve::cpu_has_amx_bf16() && Dk % 32 == 0 && Dv % 16 == 0; }

// 1 = AVX512-BF16, 2 = AMX: the path impl 0 (auto) runs for these head sizes.
int64_t auto_impl(int64_t Dk, int64_t Dv) { return amx_fits(Dk, Dv) ? 2 : 1; }

// Room for a call's packed keys and values (every word is written by the packing), kept by the calling thread
// for its next call: a fresh allocation of this size is mmapped and page-faulted on each call (one token over a
// 575-token context: 107 -> 80 us a call with the buffer kept). Contexts too large to keep around (over 64 MiB
// packed) get a one-off buffer.
uint32_t* packing_buffer(int64_t words, std::vector<uint32_t>& one_off) {
  constexpr int64_t kKeptWords = (int64_t(64) << 20) / sizeof(uint32_t);
  if (words > kKeptWords) {
    one_off.resize(words);
    return one_off.data();
  }
  thread_local std::vector<uint32_t> kept;
  if (static_cast<int64_t>(kept.size()) < words) kept.resize(words);
  return kept.data();
}

void check_kv(const at::Tensor& t, const char* name, int64_t heads) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu() && t.dim() == 3, "extend_attention: ", name,
              " must be a bfloat16 CPU tensor [rows, kv_heads, dim]");
  TORCH_CHECK(t.size(1) == heads && t.stride(2) == 1, "extend_attention: ", name, " must have ", heads,
              " heads, each contiguous");
}

// q [T, Hq, Dk]; keys [rows, Hkv, Dk], values [rows, Hkv, Dv] (rows: the context, or the pool with `slots`
// [prefix + T] naming each context position's row); query t attends to context [0, prefix + t]. -> [T, Hq, Dv].
// impl: 0 = the best that fits (AMX where the CPU has it and Dk is a multiple of 32), 1 = AVX512-BF16, 2 = AMX.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const c10::optional<at::Tensor>& slots_opt, int64_t prefix, double scale, int64_t impl) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "extend_attention: this CPU lacks AVX512-BF16");
  TORCH_CHECK(impl >= 0 && impl <= 2, "extend_attention: impl must be 0 (auto), 1 (avx512_bf16) or 2 (amx_bf16)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1,
              "extend_attention: q must be a bfloat16 CPU tensor [tokens, heads, dim], each head contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), Dk = q.size(2), Hkv = keys.dim() == 3 ? keys.size(1) : 0;
  check_kv(keys, "keys", Hkv);
  check_kv(values, "values", Hkv);
  const int64_t Dv = values.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "extend_attention: query heads (", Hq, ") must be a multiple of kv heads (",
              Hkv, ")");
  TORCH_CHECK(keys.size(2) == Dk && Dk % 2 == 0 && Dv % 32 == 0 && Dv > 0, "extend_attention: keys must have the "
              "query's even head dim (", Dk, "), values a multiple of 32 (", Dv, ")");
  TORCH_CHECK(prefix >= 0, "extend_attention: prefix must be >= 0");
  const int64_t C = prefix + T;
  const int64_t* slots = nullptr;
  at::Tensor slots_c;
  if (slots_opt.has_value() && slots_opt->defined()) {
    slots_c = slots_opt->contiguous();
    TORCH_CHECK(slots_c.scalar_type() == at::kLong && slots_c.numel() == C, "extend_attention: slots must be int64 [",
                C, "] (prefix + tokens)");
    slots = slots_c.data_ptr<int64_t>();
    const int64_t rows = std::min(keys.size(0), values.size(0));
    for (int64_t c = 0; c < C; ++c)
      TORCH_CHECK(slots[c] >= 0 && slots[c] < rows, "extend_attention: slot ", slots[c], " out of range [0, ", rows, ")");
  } else {
    TORCH_CHECK(keys.size(0) >= C && values.size(0) >= C, "extend_attention: keys and values need prefix + tokens (",
                C, ") rows without slots");
  }
  const int64_t path = impl == 0 ? auto_impl(Dk, Dv) : impl;
  TORCH_CHECK(path != 2 || amx_fits(Dk, Dv), "extend_attention: the AMX path needs AMX-BF16 and key heads a multiple "
              "of 32 (", Dk, ")");
  at::Tensor out = at::empty({T, Hq, Dv}, q.options());
  if (T == 0) return out;
  const int64_t key_blocks = (C + kKeyBlock - 1) / kKeyBlock;
  const int64_t key_words = key_blocks * (Dk / 2) * kKeyBlock, value_words = key_blocks * (kKeyBlock / 2) * Dv;
  std::vector<uint32_t> one_off;
  uint32_t* packed = packing_buffer(Hkv * (key_words + value_words), one_off);
  uint32_t* const packed_keys = packed;
  uint32_t* const packed_values = packed + Hkv * key_words;
  const Source ks{reinterpret_cast<const uint16_t*>(keys.data_ptr()), keys.stride(0), keys.stride(1), slots};
  const Source vs{reinterpret_cast<const uint16_t*>(values.data_ptr()), values.stride(0), values.stride(1), slots};
  at::parallel_for(0, Hkv * key_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / key_blocks, b = i % key_blocks;
      pack_key_block(ks, h, b, C, Dk, packed_keys + h * key_words + b * (Dk / 2) * kKeyBlock);
      pack_value_block(vs, h, b, C, Dv, packed_values + h * value_words + b * (kKeyBlock / 2) * Dv);
    }
  });
  const Problem pb{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1), T, prefix, Hq, Hkv, Dk, Dv,
                   static_cast<float>(scale), packed_keys, packed_values, key_blocks,
                   reinterpret_cast<uint16_t*>(out.data_ptr())};
  std::atomic<int64_t> next{0};
  if (path == 2) {
    const int64_t query_blocks = (T + kAmxRows - 1) / kAmxRows;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), query_blocks * Hq);
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { run_tasks_amx(pb, next, query_blocks); });
    return out;
  }
  const int64_t query_blocks = (T + kQueryBlock - 1) / kQueryBlock, tasks = query_blocks * Hq;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    TaskState st;
    st.o.resize(kQueryBlock * Dv);
    st.max.resize(kQueryBlock);
    st.sum.resize(kQueryBlock);
    for (int64_t i = next++; i < tasks; i = next++) {
      const int64_t qb = query_blocks - 1 - i / Hq, hq = i % Hq;  // the last blocks (most keys) first
      const int64_t t0 = qb * kQueryBlock;
      run_task(pb, hq, t0, std::min(kQueryBlock, T - t0), st);
    }
  });
  return out;
}

bool extend_attention_available() { return cpu_has_avx512_bf16(); }
bool extend_attention_amx_available() { return llmserve::cpu_has_amx_bf16(); }
int64_t extend_attention_auto_impl(int64_t head_dim, int64_t v_head_dim) { return auto_impl(head_dim, v_head_dim); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("extend_attention_available() -> bool", &extend_attention_available);
  m.def("extend_attention_amx_available() -> bool", &extend_attention_amx_available);
  m.def("extend_attention_auto_impl(int head_dim, int v_head_dim) -> int", &extend_attention_auto_impl);
  m.def("extend_attention(Tensor q, Tensor keys, Tensor values, Tensor? slots, int prefix, float scale, "
        "int impl=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("extend_attention", &extend_attention); }
