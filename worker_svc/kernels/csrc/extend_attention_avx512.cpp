// Extend (prefill) attention for bf16 on AVX512-BF16: each request's new tokens over its whole context, causal
// with the cached prefix in front, in one flash-attention pass (attention/torch_native.py, _extend). One call
// takes a step's requests (extend_attention_batch: prefixes read from the pool by slot, the new tokens' keys and
// values from the step's own k / v), or one request (extend_attention: the MLA backend, tests).
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
// Packing, per kv head of a request (O(context x head dims), against the products' O(tokens x context x head
// dims x query heads per kv head)):
//   keys   [key blocks][Dk / 2][64 keys][2]: a block's 4 vectors for one pair of dims adjacent.
//   values [key pairs][Dv][2].
// Padding keys (to whole blocks of 64) are zeros, and masked: their probabilities are exactly 0.
//
// Threads take units (a request's kv head, some of its query blocks: plan_units) from a shared counter, the
// costliest first, and pack the unit's context themselves before running its tasks (a query head x a block of
// 32 query rows, 16 on AMX), the last rows (the most keys) first.
//
// AMX (run_task_amx, CPUs with AMX-BF16, key heads a multiple of 32): the same packing is AMX's B operand
// for both products, so each product is tile multiplies (TDPBF16PS: 16 x 32 by 32 x 16) instead of
// broadcast VDPBF16PS: scores of 16 query rows x 64 keys are Dk / 32 x 4 tile products against the query rows
// (A, 16 rows x 32 dims); P . V are 2 x Dv / 16 tile products of P (A: 16 rows x 32 keys, bf16) against the
// packed values. Same fp32 scores and bf16 P as the AVX512-BF16 path; the block's P . V is added to the
// running output (rescaled by the row's correction) in fp32. Its online softmax takes the 16 rows together
// (the softmax, not the tile products, was half of a 64-token extend over a 512-token prefix): row maxima and
// sums by one transposing reduction of the 16 rows (reduce_rows) instead of a horizontal reduction per row,
// masks only in blocks some row sees in part, and exp2 of the scores scaled by scale * log2(e) in one FMA
// (exp2_below128: no range reduction by ln 2). Same accuracy (tests), 1.1-1.5x faster a call on the AMX Xeon
// host (docs/benchmarks.md, 2026-12-05). Value heads of at most 64 dims keep the output in tiles instead
// (run_task_amx_resident, a lazily moved max).
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
#include "ops.h"

namespace {

using llmserve::cpu_has_avx512_bf16;
using llmserve::dot_bf16;
using llmserve::exp2_below128;
using llmserve::first_lanes;

constexpr int64_t kLanes = 16;
constexpr int64_t kKeyBlock = 64;                  // keys per score tile
constexpr int kKeyVecs = kKeyBlock / kLanes;       // 4 registers per tile row
constexpr int kRows = 4;                           // query rows per score tile
constexpr int64_t kQueryBlock = 32;                // query rows per task (a multiple of kRows)
constexpr int64_t kValueChunk = 64;                // values accumulated per pass: 4 registers per row

// Where a request's context rows live: positions [0, split) in `cached` [rows, kv_heads, D] at row slots[c]
// (or c without slots), positions [split, C) in `fresh` [rows, kv_heads, D] from its row 0 (the step's own
// keys / values, not yet read back from the pool). Last dim contiguous, any row and head strides (elements).
struct Source {
  const uint16_t* cached;
  int64_t cached_row, cached_head;
  const int64_t* slots;
  int64_t split;
  const uint16_t* fresh;
  int64_t fresh_row, fresh_head;
  const uint16_t* row(int64_t c, int64_t head) const {
    if (c < split) return cached + (slots ? slots[c] : c) * cached_row + head * cached_head;
    return fresh + (c - split) * fresh_row + head * fresh_head;
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

// One request and one kv head: its query rows, and its context packed for the head.
struct Problem {
  const uint16_t* q;      // the request's first query row
  int64_t q_row, q_head;  // elements between query rows, between heads
  int64_t T, prefix, Hq, Hkv, Dk, Dv;
  float scale;
  const uint32_t* keys;    // the kv head's packed keys, key blocks x Dk / 2 x 64 words
  const uint32_t* values;  // and values, key blocks x 32 x Dv words
  uint16_t* out;  // the request's first output row, [T, Hq, Dv]
};

// The task's output rows: o [rows][o_stride] (the first Dv of each) / sum, rounded to bf16, to out[t0 + r][hq].
LLMSERVE_AVX512 void store_rows(const Problem& pb, int64_t hq, int64_t t0, int64_t rows, const float* o,
                                int64_t o_stride, const float* sum) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    uint16_t* dst = pb.out + ((t0 + r) * pb.Hq + hq) * pb.Dv;
    for (int64_t d = 0; d < pb.Dv; d += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          llmserve::to_bf16(_mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + d), inv)));
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
  const int64_t pairs = pb.Dk / 2;
  const uint32_t* keys = pb.keys;
  const uint32_t* values = pb.values;
  std::fill(st.o.begin(), st.o.end(), 0.f);
  std::fill(st.max.begin(), st.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(st.sum.begin(), st.sum.end(), 0.f);
  // Scores in log2 units (scale * log2(e)): the softmax is exp2 (exp2_below128), without exp's range reduction.
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
      _mm512_store_ps(corr, exp2_below128(_mm512_load_ps(shift_by)));
      for (int m = 0; m < kRows; ++m) {
        const __m512 shift = _mm512_set1_ps(st.max[r0 + m]);
        __m512 total = _mm512_setzero_ps();
        for (int v = 0; v < kKeyVecs; ++v) {
          s[m][v] = exp2_below128(_mm512_sub_ps(s[m][v], shift));
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
  store_rows(pb, hq, t0, rows, st.o.data(), pb.Dv, st.sum.data());
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

// Scores of a block (Keys: 64, or half a block) some rows see only in part: row m (up to the last live row,
// `rows` - 1; later rows repeat it) sees its first `first_row_sees` + m keys (clamped to [0, Keys]); the rest
// become -inf.
template <int64_t Keys>
LLMSERVE_AVX512 void mask_hidden_keys(float (&scores)[kAmxRows][Keys], int64_t first_row_sees, int64_t rows) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < kAmxRows; ++m) {
    const int64_t seen = std::clamp<int64_t>(first_row_sees + std::min(m, rows - 1), 0, Keys);
    for (int64_t v = 0; v < Keys / kLanes; ++v) {
      const __mmask16 hide = static_cast<__mmask16>(~first_lanes(seen - v * kLanes));
      if (hide != 0) _mm512_mask_storeu_ps(scores[m] + v * kLanes, hide, minus_inf);
    }
  }
}

// Query head hq, rows [t0, t0 + rows) (rows <= 16), as run_task computes them.
LLMSERVE_AMX void run_task_amx(const Problem& pb, int64_t hq, int64_t t0, int64_t rows, AmxTaskState& st) {
  const int64_t pairs = pb.Dk / 2;
  const uint32_t* keys = pb.keys;
  const uint32_t* values = pb.values;
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
    const __m512 corr16 = exp2_below128(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), scale2));
    _mm512_store_ps(corr, corr16);
    _mm512_store_ps(shift, _mm512_mul_ps(new_max, scale2));
    __m512 row_sums[kAmxRows];
    for (int64_t m = 0; m < kAmxRows; ++m) {
      const __m512 by = _mm512_set1_ps(shift[m]);
      __m512 e[kKeyVecs];
      for (int v = 0; v < kKeyVecs; ++v)
        e[v] = exp2_below128(_mm512_fmsub_ps(_mm512_load_ps(st.scores[m] + v * kLanes), scale2, by));
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
  store_rows(pb, hq, t0, rows, st.o.data(), pb.Dv, st.sum);
}

// ---- AMX, value accumulators held in tiles (value heads of at most 64 dims) ------------------------------
//
// run_task_amx stores each block's P . V from its tiles and adds it to the fp32 output, rescaled by the rows'
// correction: 4 tile stores and 16 x 64 loads, FMAs and stores a block, a third of a 64-token extend over a
// 512-token prefix. Here the output stays in tiles 0-3 across the blocks, which the running max allows only
// while it does not move: the max is moved lazily, when a row's scores exceed it by more than
// kLazyMaxSlack (in log2 units), so probabilities are at most 2^kLazyMaxSlack (bf16 and fp32 hold that, and
// the rounding of P is relative, so the accuracy is the same). When the max moves, the tiles are flushed into
// the fp32 output and rescaled there; with typical scores that happens in the first blocks only.
// Tiles: 0-3 the output (16 rows x 16 dims each), 4-5 the scores of 32 keys (half a packed block: the other
// two tiles hold the output), then 4 holds P (A of the value product) and 5-7 its B tiles; 6 the query rows (A
// of the scores), 7 their B.
// The halves are pipelined: the next half's score products are issued (and stored) before this half's softmax,
// so the tile unit multiplies while the vector units take the exponentials; in order, each waited for the other.
constexpr float kLazyMaxSlack = 8.f;
constexpr int64_t kHalfBlock = kKeyBlock / 2;

struct AmxResidentState {
  std::vector<uint16_t> q;                         // [16][Dk]: the task's query rows, zero past the last
  alignas(64) float o[kAmxRows][4 * kAmxDimGroup];  // fp32 output flushed from tiles 0-3, at the max `used`
  alignas(64) float used[kAmxRows];                // per row: the max the probabilities are taken against
  alignas(64) float sum[kAmxRows];                 // and the sum of those probabilities
  alignas(64) float scores[2][kAmxRows][kHalfBlock];  // tiles 4-5: this half's scores, the next half's
  alignas(64) uint16_t probs[kAmxRows][kHalfBlock];  // P of the half block in bf16: A of the value product
  alignas(64) float pv[kAmxRows][4 * kAmxDimGroup];  // tiles 0-3 stored
};

// o = (o + tiles 0..groups-1) * corr[row]; the tiles are left as they were (the caller zeroes them).
LLMSERVE_AMX void flush_output_tiles(AmxResidentState& st, int groups, const float* corr) {
  store_tiles(groups, &st.pv[0][0], 4 * kAmxDimGroup * sizeof(float));
  for (int64_t m = 0; m < kAmxRows; ++m) {
    const __m512 c = _mm512_set1_ps(corr[m]);
    for (int g = 0; g < groups; ++g) {
      float* o = st.o[m] + g * kLanes;
      _mm512_store_ps(o, _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(o), _mm512_load_ps(st.pv[m] + g * kLanes)), c));
    }
  }
}

// tmm4 holds A; C tile g += A . B_g for g < n, B_g at b + g * b_step words (16 rows, b_stride bytes apart), in
// tiles 5, 6, 7, 5: the first three loads need not wait for a product to have read the tile before.
LLMSERVE_AMX inline void multiply_tiles_from_5(int n, const uint32_t* b, int64_t b_step, int64_t b_stride) {
  _tile_loadd(5, b, b_stride);
  if (n > 1) _tile_loadd(6, b + b_step, b_stride);
  if (n > 2) _tile_loadd(7, b + 2 * b_step, b_stride);
  _tile_dpbf16ps(0, 4, 5);
  if (n > 1) _tile_dpbf16ps(1, 4, 6);
  if (n > 2) _tile_dpbf16ps(2, 4, 7);
  if (n > 3) {
    _tile_loadd(5, b + 3 * b_step, b_stride);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// Scores of half block hb (16 query rows x 32 keys, raw q . k) through tiles 4-5 to `out`: Dk / 32 steps, the
// query rows in tile 6 (A), 16 dim pairs x 16 keys of B in tile 7 (256 bytes a row).
LLMSERVE_AMX inline void score_half(const AmxResidentState& st, const uint32_t* keys, int64_t Dk, int64_t hb,
                                    float (&out)[kAmxRows][kHalfBlock]) {
  const uint32_t* kb = keys + (hb / 2) * (Dk / 2) * kKeyBlock + (hb % 2) * kHalfBlock;
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t kc = 0; kc < Dk; kc += llmserve::kAmxTileK) {
    _tile_loadd(6, st.q.data() + kc, Dk * sizeof(uint16_t));
    _tile_loadd(7, kb + (kc / 2) * kKeyBlock, kKeyBlock * sizeof(uint32_t));
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, kb + (kc / 2) * kKeyBlock + kAmxDimGroup, kKeyBlock * sizeof(uint32_t));
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, &out[0][0], kHalfBlock * sizeof(float));
  _tile_stored(5, &out[0][0] + kAmxDimGroup, kHalfBlock * sizeof(float));
}

// Query head hq, rows [t0, t0 + rows) (rows <= 16), value heads of Dv <= 64: run_task_amx's result, the output
// accumulated in tiles.
LLMSERVE_AMX void run_task_amx_resident(const Problem& pb, int64_t hq, int64_t t0, int64_t rows,
                                        AmxResidentState& st) {
  const uint32_t* values = pb.values;
  const int groups = static_cast<int>(pb.Dv / kAmxDimGroup);  // 1..4 output tiles
  std::fill(st.q.begin(), st.q.end(), uint16_t{0});
  for (int64_t m = 0; m < rows; ++m)
    std::memcpy(st.q.data() + m * pb.Dk, pb.q + (t0 + m) * pb.q_row + hq * pb.q_head, pb.Dk * sizeof(uint16_t));
  std::memset(st.o, 0, sizeof(st.o));
  std::fill(st.used, st.used + kAmxRows, -std::numeric_limits<float>::infinity());
  std::fill(st.sum, st.sum + kAmxRows, 0.f);
  zero_tiles(groups);
  bool tiles_hold_output = false;  // nothing to flush before the first half's P . V
  const __m512 scale2 = _mm512_set1_ps(pb.scale * 1.44269504088896341f);  // scores -> log2 units
  const __m512 slack = _mm512_set1_ps(kLazyMaxSlack);
  // The last live row sees keys [0, prefix + t0 + rows): whole halves up to that.
  const int64_t halves = (pb.prefix + t0 + rows + kHalfBlock - 1) / kHalfBlock;
  score_half(st, pb.keys, pb.Dk, 0, st.scores[0]);
  for (int64_t hb = 0; hb < halves; ++hb) {
    float(&scores)[kAmxRows][kHalfBlock] = st.scores[hb % 2];
    if (hb + 1 < halves) score_half(st, pb.keys, pb.Dk, hb + 1, st.scores[(hb + 1) % 2]);
    const int64_t first_row_sees = pb.prefix + t0 + 1 - hb * kHalfBlock;
    if (first_row_sees < kHalfBlock) mask_hidden_keys(scores, first_row_sees, rows);
    __m512 row_peaks[kAmxRows];
    for (int64_t m = 0; m < kAmxRows; ++m)
      row_peaks[m] = _mm512_max_ps(_mm512_load_ps(scores[m]), _mm512_load_ps(scores[m] + kLanes));
    // The half's max per row in log2 units (-inf for a row that sees none of it; every row sees key 0, so the
    // first half sets a finite max for all).
    const __m512 peak = _mm512_mul_ps(reduce_rows<Max>(row_peaks), scale2);
    const __m512 used = _mm512_load_ps(st.used);
    if (_mm512_cmp_ps_mask(peak, _mm512_add_ps(used, slack), _CMP_GT_OQ) != 0) {
      const __m512 moved = _mm512_max_ps(used, peak);
      alignas(64) float corr[kAmxRows];
      const __m512 corr16 = exp2_below128(_mm512_sub_ps(used, moved));  // 2^-inf = 0 before the first half
      _mm512_store_ps(corr, corr16);
      if (tiles_hold_output) {
        flush_output_tiles(st, groups, corr);
        zero_tiles(groups);
      }
      _mm512_store_ps(st.sum, _mm512_mul_ps(_mm512_load_ps(st.sum), corr16));
      _mm512_store_ps(st.used, moved);
    }
    alignas(64) float shift[kAmxRows];
    _mm512_store_ps(shift, _mm512_load_ps(st.used));
    __m512 row_sums[kAmxRows];
    for (int64_t m = 0; m < kAmxRows; ++m) {
      const __m512 by = _mm512_set1_ps(shift[m]);
      const __m512 e0 = exp2_below128(_mm512_fmsub_ps(_mm512_load_ps(scores[m]), scale2, by));
      const __m512 e1 = exp2_below128(_mm512_fmsub_ps(_mm512_load_ps(scores[m] + kLanes), scale2, by));
      row_sums[m] = _mm512_add_ps(e0, e1);
      const __m512bh pair = _mm512_cvtne2ps_pbh(e1, e0);  // the half's 32 keys in order
      _mm512_store_si512(st.probs[m], reinterpret_cast<const __m512i&>(pair));
    }
    _mm512_store_ps(st.sum, _mm512_add_ps(_mm512_load_ps(st.sum), reduce_rows<Sum>(row_sums)));
    // P . V into the output tiles: A = P (16 rows x 32 keys), B_g = 16 key pairs x dims 16 g .. 16 g + 15.
    const uint32_t* vb = values + (hb / 2) * (kKeyBlock / 2) * pb.Dv + (hb % 2) * (kHalfBlock / 2) * pb.Dv;
    _tile_loadd(4, &st.probs[0][0], kHalfBlock * sizeof(uint16_t));  // the next scores are stored: 4 is free
    multiply_tiles_from_5(groups, vb, kAmxDimGroup, pb.Dv * sizeof(uint32_t));
    tiles_hold_output = true;
  }
  alignas(64) float one[kAmxRows];
  std::fill(one, one + kAmxRows, 1.f);
  flush_output_tiles(st, groups, one);
  store_rows(pb, hq, t0, rows, &st.o[0][0], 4 * kAmxDimGroup, st.sum);
}

bool amx_fits(int64_t Dk, int64_t Dv) { return llmserve::cpu_has_amx_bf16() && Dk % 32 == 0 && Dv % 16 == 0; }

// 1 = AVX512-BF16, 2 = AMX: the path impl 0 (auto) runs for these head sizes.
int64_t auto_impl(int64_t Dk, int64_t Dv) { return amx_fits(Dk, Dv) ? 2 : 1; }

// Room for a unit's packed keys and values (every word is written by the packing), kept by the thread for its
// next unit: a fresh allocation of this size is mmapped and page-faulted each time (one token over a 575-token
// context: 107 -> 80 us a call with the buffer kept). Contexts too large to keep around (over 64 MiB packed)
// get a one-off buffer.
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

// A request of the call: its query rows [q_start, q_start + T) (of q and of the output), prefix cached tokens.
struct Request {
  int64_t q_start, T, prefix;
  Source keys, values;
};

// The work a thread takes at a time: one request's kv head, query blocks [block_begin, block_end) of it, for
// every query head sharing the kv head. The thread packs the head's context itself, so the packed keys and
// values are written and read in its own L2: packed by all threads and read by whichever took a task, they
// crossed cores, and the packing ran 2.8x slower on two threads than on one (docs/benchmarks.md).
struct Unit {
  int64_t request, kv_head, block_begin, block_end;
  double cost;  // query rows x keys they see: the costliest units go first
};

struct Shapes {
  const uint16_t* q;
  int64_t q_row, q_head, Hq, Hkv, Dk, Dv;
  float scale;
  uint16_t* out;  // [rows of q, Hq, Dv], contiguous
};

// Every request's query blocks, in units enough to keep `threads` busy: a request's kv heads, its query
// blocks split further only while there are fewer units than threads. Each split packs the head's context
// again (up to its last row), which costs more than the idle thread it saves: one 64-token request over a
// 512-token prefix, 9 heads of 3 kv heads, two threads: 89 us a call as 3 units, 98 as 6, 104-113 as 9.
std::vector<Unit> plan_units(const std::vector<Request>& requests, int64_t Hkv, int64_t block_rows, int64_t threads) {
  int64_t heads = 0;
  for (const Request& r : requests) heads += r.T > 0 ? Hkv : 0;
  std::vector<Unit> units;
  for (int64_t i = 0; i < static_cast<int64_t>(requests.size()); ++i) {
    const Request& r = requests[i];
    if (r.T == 0) continue;
    const int64_t blocks = (r.T + block_rows - 1) / block_rows;
    const int64_t splits = std::clamp<int64_t>((threads + heads - 1) / std::max<int64_t>(heads, 1), 1, blocks);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t begin = blocks * sp / splits, end = blocks * (sp + 1) / splits;
        const int64_t first_row = begin * block_rows, last_row = std::min(r.T, end * block_rows);
        const double rows = static_cast<double>(last_row - first_row);
        units.push_back({i, h, begin, end, rows * (r.prefix + (first_row + last_row) / 2.0)});
      }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  return units;
}

// The unit's kv head packed: keys of blocks [0, key_blocks) then their values (a thread's kept buffer).
Problem pack_unit(const Shapes& sh, const Request& r, const Unit& u, int64_t block_rows, std::vector<uint32_t>& one_off) {
  const int64_t C = r.prefix + r.T;
  const int64_t last_row = std::min(r.T, u.block_end * block_rows);
  const int64_t key_blocks = (r.prefix + last_row + kKeyBlock - 1) / kKeyBlock;  // the unit's last row's keys
  const int64_t key_words = key_blocks * (sh.Dk / 2) * kKeyBlock;
  uint32_t* packed = packing_buffer(key_words + key_blocks * (kKeyBlock / 2) * sh.Dv, one_off);
  for (int64_t b = 0; b < key_blocks; ++b) {
    pack_key_block(r.keys, u.kv_head, b, C, sh.Dk, packed + b * (sh.Dk / 2) * kKeyBlock);
    pack_value_block(r.values, u.kv_head, b, C, sh.Dv, packed + key_words + b * (kKeyBlock / 2) * sh.Dv);
  }
  return Problem{sh.q + r.q_start * sh.q_row, sh.q_row, sh.q_head, r.T, r.prefix, sh.Hq, sh.Hkv, sh.Dk, sh.Dv,
                 sh.scale, packed, packed + key_words, sh.out + r.q_start * sh.Hq * sh.Dv};
}

// Tasks of a unit: its query blocks x the query heads sharing its kv head.
int64_t tasks_of(const Unit& u, const Shapes& sh) { return (u.block_end - u.block_begin) * (sh.Hq / sh.Hkv); }

// The context rows the thread packs next (its following unit's kv head), fetched toward L2 a slice per task of
// the unit it runs now: the pool rows of a cached prefix were last read a step ago, and the packing waited on
// them (a flushed cache made a 64-token call over a 512-token prefix 1.4x slower). Steps of 1-8 such requests:
// 1.01-1.05x faster (engine alone, interleaved in one process, docs/benchmarks.md).
class ContextPrefetch {
 public:
  ContextPrefetch(const Request* next, const Unit* next_unit, int64_t block_rows, int64_t tasks, int64_t key_bytes,
                  int64_t value_bytes)
      : next_(next), head_(next_unit ? next_unit->kv_head : 0), key_bytes_(key_bytes), value_bytes_(value_bytes) {
    if (next == nullptr) return;
    end_ = next->prefix + std::min(next->T, next_unit->block_end * block_rows);
    per_task_ = (end_ + tasks - 1) / std::max<int64_t>(tasks, 1);
  }
  void step() {
    const int64_t to = std::min(end_, pos_ + per_task_);
    for (; pos_ < to; ++pos_) {
      fetch(next_->keys.row(pos_, head_), key_bytes_);
      fetch(next_->values.row(pos_, head_), value_bytes_);
    }
  }

 private:
  static void fetch(const uint16_t* row, int64_t bytes) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
  const Request* next_;
  int64_t head_, key_bytes_, value_bytes_;
  int64_t end_ = 0, per_task_ = 0, pos_ = 0;
};

// The unit's tasks, the last query blocks (the most keys) first; kv head h's query heads are
// [h * group, (h + 1) * group).
template <class RunTask>
void run_unit(const Problem& pb, const Unit& u, int64_t block_rows, RunTask&& run_task) {
  const int64_t group = pb.Hq / pb.Hkv;
  for (int64_t qb = u.block_end - 1; qb >= u.block_begin; --qb) {
    const int64_t t0 = qb * block_rows, rows = std::min(block_rows, pb.T - t0);
    for (int64_t hq = u.kv_head * group; hq < (u.kv_head + 1) * group; ++hq) run_task(pb, hq, t0, rows);
  }
}

// A thread's share: units from the shared counter until none is left. Each unit is packed by the thread, its next
// one claimed ahead so that unit's context is fetched (ContextPrefetch) while this one's tasks run.
template <class RunTask>
void take_units(const Shapes& sh, const std::vector<Request>& requests, const std::vector<Unit>& units,
                std::atomic<int64_t>& next, int64_t block_rows, RunTask&& run_task) {
  std::vector<uint32_t> one_off;
  const int64_t n = static_cast<int64_t>(units.size());
  for (int64_t i = next++; i < n;) {
    const int64_t following = next++;
    const Unit& u = units[i];
    const Problem pb = pack_unit(sh, requests[u.request], u, block_rows, one_off);
    ContextPrefetch prefetch(following < n ? &requests[units[following].request] : nullptr,
                             following < n ? &units[following] : nullptr, block_rows, tasks_of(u, sh), sh.Dk * 2,
                             sh.Dv * 2);
    run_unit(pb, u, block_rows, [&](const Problem& p, int64_t hq, int64_t t0, int64_t rows) {
      prefetch.step();
      run_task(p, hq, t0, rows);
    });
    i = following;
  }
}

LLMSERVE_AMX void run_units_amx(const Shapes& sh, const std::vector<Request>& requests, const std::vector<Unit>& units,
                                std::atomic<int64_t>& next) {
  llmserve::load_amx_tile_config();  // tile state is per thread
  const bool resident = sh.Dv <= 4 * kAmxDimGroup;
  AmxTaskState st;
  AmxResidentState rst;
  (resident ? rst.q : st.q).resize(kAmxRows * sh.Dk);
  if (!resident) st.o.resize(kAmxRows * sh.Dv);
  take_units(sh, requests, units, next, kAmxRows, [&](const Problem& p, int64_t hq, int64_t t0, int64_t rows) {
    if (resident)
      run_task_amx_resident(p, hq, t0, rows, rst);
    else
      run_task_amx(p, hq, t0, rows, st);
  });
  _tile_release();
}

void run_units_avx512(const Shapes& sh, const std::vector<Request>& requests, const std::vector<Unit>& units,
                      std::atomic<int64_t>& next) {
  TaskState st;
  st.o.resize(kQueryBlock * sh.Dv);
  st.max.resize(kQueryBlock);
  st.sum.resize(kQueryBlock);
  take_units(sh, requests, units, next, kQueryBlock,
             [&](const Problem& p, int64_t hq, int64_t t0, int64_t rows) { run_task(p, hq, t0, rows, st); });
}

// Every request's attention on `path` (1 = AVX512-BF16, 2 = AMX), threads taking units from a shared counter.
void run_requests(const Shapes& sh, const std::vector<Request>& requests, int64_t path) {
  const int64_t block_rows = path == 2 ? kAmxRows : kQueryBlock;
  const std::vector<Unit> units = plan_units(requests, sh.Hkv, block_rows, at::get_num_threads());
  if (units.empty()) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(units.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (path == 2)
      run_units_amx(sh, requests, units, next);
    else
      run_units_avx512(sh, requests, units, next);
  });
}

void check_kv(const at::Tensor& t, const char* fn, const char* name, int64_t heads) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu() && t.dim() == 3, fn, ": ", name,
              " must be a bfloat16 CPU tensor [rows, kv_heads, dim]");
  TORCH_CHECK(t.size(1) == heads && t.stride(2) == 1, fn, ": ", name, " must have ", heads, " heads, each contiguous");
}

void check_query(const at::Tensor& q, const char* fn) {
  TORCH_CHECK(cpu_has_avx512_bf16(), fn, ": this CPU lacks AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, fn,
              ": q must be a bfloat16 CPU tensor [tokens, heads, dim], each head contiguous");
}

// The path impl (0 = auto, 1 = AVX512-BF16, 2 = AMX) names, refused where it cannot run these heads.
int64_t check_path(int64_t impl, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, const char* fn) {
  TORCH_CHECK(impl >= 0 && impl <= 2, fn, ": impl must be 0 (auto), 1 (avx512_bf16) or 2 (amx_bf16)");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, fn, ": query heads (", Hq, ") must be a multiple of kv heads (", Hkv, ")");
  TORCH_CHECK(Dk % 2 == 0 && Dv % 32 == 0 && Dv > 0, fn, ": keys must have the query's even head dim (", Dk,
              "), values a multiple of 32 (", Dv, ")");
  const int64_t path = impl == 0 ? auto_impl(Dk, Dv) : impl;
  TORCH_CHECK(path != 2 || amx_fits(Dk, Dv), fn, ": the AMX path needs AMX-BF16 and key heads a multiple of 32 (",
              Dk, ")");
  return path;
}

void check_slots(const int64_t* slots, int64_t n, int64_t rows, const char* fn) {
  for (int64_t c = 0; c < n; ++c)
    TORCH_CHECK(slots[c] >= 0 && slots[c] < rows, fn, ": slot ", slots[c], " out of range [0, ", rows, ")");
}

Source source_of(const at::Tensor& t) {
  return Source{reinterpret_cast<const uint16_t*>(t.data_ptr()), t.stride(0), t.stride(1), nullptr, 0, nullptr, 0, 0};
}

// q [T, Hq, Dk]; keys [rows, Hkv, Dk], values [rows, Hkv, Dv] (rows: the context, or the pool with `slots`
// [prefix + T] naming each context position's row); query t attends to context [0, prefix + t]. -> [T, Hq, Dv].
// impl: 0 = the best that fits (AMX where the CPU has it and Dk is a multiple of 32), 1 = AVX512-BF16, 2 = AMX.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const c10::optional<at::Tensor>& slots_opt, int64_t prefix, double scale, int64_t impl) {
  constexpr const char* fn = "extend_attention";
  check_query(q, fn);
  const int64_t T = q.size(0), Hq = q.size(1), Dk = q.size(2), Hkv = keys.dim() == 3 ? keys.size(1) : 0;
  check_kv(keys, fn, "keys", Hkv);
  check_kv(values, fn, "values", Hkv);
  const int64_t Dv = values.size(2);
  TORCH_CHECK(keys.size(2) == Dk, fn, ": keys must have the query's head dim (", Dk, ")");
  const int64_t path = check_path(impl, Hq, Hkv, Dk, Dv, fn);
  TORCH_CHECK(prefix >= 0, fn, ": prefix must be >= 0");
  const int64_t C = prefix + T;
  Source ks = source_of(keys), vs = source_of(values);
  ks.split = vs.split = C;  // the whole context from keys / values
  at::Tensor slots_c;
  if (slots_opt.has_value() && slots_opt->defined()) {
    slots_c = slots_opt->contiguous();
    TORCH_CHECK(slots_c.scalar_type() == at::kLong && slots_c.numel() == C, fn, ": slots must be int64 [", C,
                "] (prefix + tokens)");
    ks.slots = vs.slots = slots_c.data_ptr<int64_t>();
    check_slots(ks.slots, C, std::min(keys.size(0), values.size(0)), fn);
  } else {
    TORCH_CHECK(keys.size(0) >= C && values.size(0) >= C, fn, ": keys and values need prefix + tokens (", C,
                ") rows without slots");
  }
  at::Tensor out = at::empty({T, Hq, Dv}, q.options());
  const Shapes sh{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1), Hq, Hkv, Dk, Dv,
                  static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr())};
  run_requests(sh, {Request{0, T, prefix, ks, vs}}, path);
  return out;
}

// A step's extends in one call. Request i: query rows [q_starts[i], q_starts[i] + extend_lens[i]) of q and out,
// whose own keys / values are the same rows of k / v, after prefix_lens[i] cached tokens at pool rows given by
// its span of prefix_slots (the requests' cached slots, concatenated in order). Writes those rows of out
// [tokens, Hq, Dv]; rows of no request are left as they were.
void extend_attention_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& prefix_slots, at::IntArrayRef q_starts,
                            at::IntArrayRef extend_lens, at::IntArrayRef prefix_lens, double scale, int64_t impl,
                            at::Tensor& out) {
  constexpr const char* fn = "extend_attention_batch";
  check_query(q, fn);
  const int64_t N = q.size(0), Hq = q.size(1), Dk = q.size(2), Hkv = k.dim() == 3 ? k.size(1) : 0;
  check_kv(k, fn, "k", Hkv);
  check_kv(v, fn, "v", Hkv);
  check_kv(k_pool, fn, "k_pool", Hkv);
  check_kv(v_pool, fn, "v_pool", Hkv);
  const int64_t Dv = v.size(2);
  TORCH_CHECK(k.size(2) == Dk && k_pool.size(2) == Dk && v_pool.size(2) == Dv && k.size(0) == N && v.size(0) == N,
              fn, ": k [tokens, kv_heads, ", Dk, "], v [tokens, kv_heads, ", Dv, "] and the pools must match q");
  const int64_t path = check_path(impl, Hq, Hkv, Dk, Dv, fn);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 3 && out.size(0) == N &&
              out.size(1) == Hq && out.size(2) == Dv, fn, ": out must be a contiguous bfloat16 [", N, ", ", Hq, ", ",
              Dv, "]");
  const int64_t R = static_cast<int64_t>(q_starts.size());
  TORCH_CHECK(static_cast<int64_t>(extend_lens.size()) == R && static_cast<int64_t>(prefix_lens.size()) == R, fn,
              ": q_starts, extend_lens and prefix_lens must have one entry per request");
  const at::Tensor slots_c = prefix_slots.contiguous();
  TORCH_CHECK(slots_c.scalar_type() == at::kLong && slots_c.dim() == 1, fn, ": prefix_slots must be int64 [cached]");
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  int64_t cached = 0;
  std::vector<Request> requests;
  requests.reserve(R);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t start = q_starts[i], T = extend_lens[i], prefix = prefix_lens[i];
    TORCH_CHECK(start >= 0 && T >= 0 && start + T <= N && prefix >= 0, fn, ": request ", i, " (q_start ", start,
                ", extend ", T, ", prefix ", prefix, ") is outside the ", N, " query rows");
    TORCH_CHECK(cached + prefix <= slots_c.numel(), fn, ": prefix_slots has ", slots_c.numel(),
                " slots, fewer than the prefixes' ", cached + prefix);
    Source ks = source_of(k_pool), vs = source_of(v_pool);
    ks.slots = vs.slots = slots + cached;
    ks.split = vs.split = prefix;
    ks.fresh = reinterpret_cast<const uint16_t*>(k.data_ptr()) + start * k.stride(0);
    ks.fresh_row = k.stride(0);
    ks.fresh_head = k.stride(1);
    vs.fresh = reinterpret_cast<const uint16_t*>(v.data_ptr()) + start * v.stride(0);
    vs.fresh_row = v.stride(0);
    vs.fresh_head = v.stride(1);
    requests.push_back(Request{start, T, prefix, ks, vs});
    cached += prefix;
  }
  TORCH_CHECK(cached == slots_c.numel(), fn, ": prefix_slots has ", slots_c.numel(), " slots, the prefixes ", cached);
  check_slots(slots, cached, std::min(k_pool.size(0), v_pool.size(0)), fn);
  const Shapes sh{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1), Hq, Hkv, Dk, Dv,
                  static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr())};
  run_requests(sh, requests, path);
}

bool extend_attention_available() { return cpu_has_avx512_bf16(); }
bool extend_attention_amx_available() { return llmserve::cpu_has_amx_bf16(); }
int64_t extend_attention_auto_impl(int64_t head_dim, int64_t v_head_dim) { return auto_impl(head_dim, v_head_dim); }

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
void extend_attention_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& prefix_slots, at::IntArrayRef q_starts,
                            at::IntArrayRef extend_lens, at::IntArrayRef prefix_lens, double scale, int64_t impl,
                            at::Tensor& out) {
  ::extend_attention_batch(q, k, v, k_pool, v_pool, prefix_slots, q_starts, extend_lens, prefix_lens, scale, impl, out);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("extend_attention_available() -> bool", &extend_attention_available);
  m.def("extend_attention_amx_available() -> bool", &extend_attention_amx_available);
  m.def("extend_attention_auto_impl(int head_dim, int v_head_dim) -> int", &extend_attention_auto_impl);
  m.def("extend_attention(Tensor q, Tensor keys, Tensor values, Tensor? slots, int prefix, float scale, "
        "int impl=0) -> Tensor");
  m.def("extend_attention_batch(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor prefix_slots, "
        "int[] q_starts, int[] extend_lens, int[] prefix_lens, float scale, int impl, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("extend_attention", &extend_attention);
  m.impl("extend_attention_batch", &extend_attention_batch);
}
