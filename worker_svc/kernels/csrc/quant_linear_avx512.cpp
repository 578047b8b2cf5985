// Weight-only quantized linears (int8 per channel, int4 grouped asymmetric) for CPUs with AVX-512
// (F/BW/VL/DQ), with a VDPBF16PS path for bf16 activations where the CPU has AVX512-BF16.
//
// Why: aten's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu leave much of the memory bandwidth
// unused at one row and scale poorly to a few rows, and the AVX2 kernels (quant_linear_avx2.cpp) keep
// one weight row per vector, which costs a horizontal sum per output. Here 16 outputs share a zmm, the
// activation is broadcast, and the weights are packed once at load for that (the packing is done in
// Python, kernels/quant_linear.py, which also unpacks them for the tests).
//
// Weights stay quantized in memory and are widened in registers; accumulation is fp32:
//   int8:  packed int8 [G, Kp/2, 16, 2]: per group of 16 outputs, per pair of inputs, 16 outputs x 2
//          inputs (n0k0 n0k1 n1k0 ...; Kp = K rounded up to even, N padded to 16 G with zero rows).
//          fp32 path: 16 int8 -> 16 fp32 (8 outputs x 2 inputs) times the broadcast input pair, the
//          pair's halves added at the end. bf16 path (from kI8Bf16MinRows rows): per tile, the weights
//          widened once to bf16 (exact) into a panel that every block of rows reads with VDPBF16PS. The
//          channel scale (fp32 [16 G]) multiplies the sum at the end.
//   int4:  per group of 16 outputs and quantization group, a record (Int4Args): the 16 scales and 16
//          zeros in the model dtype, then per 8 inputs one 32-bit word per output holding q[n, 8b + t] in
//          bits 4t..4t+3 -- one sequential stream per output group. fp32 path: nibble t of every word
//          indexes a 16-entry table of (q - 8) (a shift and a VPERMPS), FMA with broadcast x[8b + t].
//          bf16 path: a word-wise shift puts nibbles t and 4 + t at the bottom of the two halves of each
//          word, one VPTERNLOGD makes them the bf16 numbers 128 + q (bits 0x4300 | q, exact), one
//          VDPBF16PS takes (x[8b + t], x[8b + 4 + t]). Per quantization group:
//          total += s * (x . (q + 128)) + (z - 136 s) * sum(x over the group).
//          AMX path (from kI4AmxMinRows bf16 rows, quantization groups of whole 32-input tiles, on CPUs
//          with AMX-BF16): a VPERMW lookup of (q - 8) per word and step is one AMX B row (16 outputs x the
//          input pair (8b + t, 8b + 4 + t)); per pair of output groups and quantization group the B tiles
//          are written once into L1, every block of 32 rows of x (paired the same way) multiplies them,
//          and the group fold reads the tiles' fp32 sums.
//   int8 AMX path (from kI8AmxMinRows bf16 rows, inputs in whole 32-input tiles): the int8 pairs widened
//          to bf16 are AMX B rows; up to 32 rows the tiles are widened as the weights stream, beyond that
//          into a per-tile panel every row block reuses; the channel scale multiplies the tiles' sums.
//   A bias (any float dtype) is added in fp32 before the one rounding to the output dtype.
//
// Tiles: MR rows x NV groups of 16 outputs in fp32 registers; threads (at::parallel_for) split the
// output groups, so each thread streams a contiguous range of the packed weights. Every function using
// AVX-512 carries its own target attribute, so the library still builds with the AVX2 base flags, and
// the ops check the CPU before running.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "avx512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "ops.h"

namespace {

using llmserve::cpu_has_avx512;
using llmserve::cpu_has_avx512_bf16;
using llmserve::dot_bf16;
using llmserve::first_lanes;
using llmserve::to_bf16;

constexpr int64_t kOut = 16;      // outputs per group: one zmm of fp32 sums

// Software prefetch along each weight stream, into L1 this far ahead and into L2 further: at one row,
// measured interleaved on the Zen 4 host, the L1 prefetch alone added 5-10% over the hardware
// prefetchers (256-2048 bytes alike) and the L2 one another 2-17% (more than 2 KiB ahead did worse).
constexpr int64_t kPrefetchL1Bytes = 512;
constexpr int64_t kPrefetchL2Bytes = 2048;

inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchL1Bytes, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
}

enum class Kind : int { f32 = 0, bf16 = 1, f16 = 2 };

Kind kind_of(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kFloat: return Kind::f32;
    case at::kBFloat16: return Kind::bf16;
    case at::kHalf: return Kind::f16;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", type, " (float32, bfloat16 or float16)");
  }
}

// ---- loads and stores of 16 values in any of the three dtypes --------------------------------------

LLMSERVE_AVX512 inline __m512 load16(const void* p, Kind kind) {
  switch (kind) {
    case Kind::f32: return _mm512_loadu_ps(p);
    case Kind::bf16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
    default: return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
}

LLMSERVE_AVX512 inline void store16(void* p, int64_t index, __m512 v, Kind kind, __mmask16 mask) {
  switch (kind) {
    case Kind::f32: _mm512_mask_storeu_ps(static_cast<float*>(p) + index, mask, v); break;
    case Kind::bf16: _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + index, mask, to_bf16(v)); break;
    default:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + index, mask,
                               _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Row of K activations (any of the three dtypes) -> fp32 in dst[0 .. K), zeros in dst[K .. Kp).
LLMSERVE_AVX512 void row_to_f32(const void* src, Kind kind, int64_t K, int64_t Kp, float* dst) {
  const int64_t esize = kind == Kind::f32 ? 4 : 2;
  const char* p = static_cast<const char*>(src);
  int64_t k = 0;
  for (; k + kOut <= K; k += kOut) _mm512_storeu_ps(dst + k, load16(p + k * esize, kind));
  for (; k < Kp; ++k) {
    float v = 0.f;
    if (k < K) {
      uint16_t h;
      if (kind == Kind::f32) std::memcpy(&v, p + 4 * k, 4);
      else {
        std::memcpy(&h, p + 2 * k, 2);
        v = kind == Kind::bf16 ? static_cast<float>(c10::BFloat16(h, c10::BFloat16::from_bits()))
                               : static_cast<float>(c10::Half(h, c10::Half::from_bits()));
      }
    }
    dst[k] = v;
  }
}

// Per quantization group of an fp32 row, the sum of its activations.
LLMSERVE_AVX512 void group_sums(const float* x, int64_t groups, int64_t group, float* dst) {
  for (int64_t q = 0; q < groups; ++q) {
    const float* g = x + q * group;
    int64_t k = 0;
    __m512 acc = _mm512_setzero_ps();
    for (; k + kOut <= group; k += kOut) acc = _mm512_add_ps(acc, _mm512_loadu_ps(g + k));
    float sum = _mm512_reduce_add_ps(acc);
    for (; k < group; ++k) sum += g[k];
    dst[q] = sum;
  }
}

// Where a tile writes: out [rows, ldo] in `kind`, plus bias [ldo] in bias_kind when bias is not null.
struct OutView {
  void* out; int64_t ldo; Kind kind; const void* bias; Kind bias_kind;
};

LLMSERVE_AVX512 inline __m512 load16_masked(const void* p, int64_t index, Kind kind, __mmask16 mask) {
  switch (kind) {
    case Kind::f32: return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + index);
    case Kind::bf16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + index)), 16));
    default: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + index));
  }
}

// out[row, col .. col + 15] = v (+ bias[col ..]) for the lanes in mask, rounded once to the output dtype.
LLMSERVE_AVX512 inline void store_out(const OutView& o, int64_t row, int64_t col, __m512 v, __mmask16 mask) {
  if (o.bias != nullptr) v = _mm512_add_ps(v, load16_masked(o.bias, col, o.bias_kind, mask));
  store16(o.out, row * o.ldo + col, v, o.kind, mask);
}

// ---- int8 ----------------------------------------------------------------------------------------

constexpr int64_t kI8PairBytes = 2 * kOut;  // one pair of inputs for 16 outputs

// 8 outputs x 2 inputs of int8 -> 16 fp32.
LLMSERVE_AVX512 inline __m512 widen16_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Sums the pair lanes of lo (outputs 0-7) and hi (outputs 8-15) into 16 outputs.
LLMSERVE_AVX512 inline __m512 fold_pairs(__m512 lo, __m512 hi) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi));
}

// x fp32 [MR, ldx] (ldx >= Kp, zero beyond K); w at the tile's first group; gstride: bytes per group.
template <int MR, int NV>
LLMSERVE_AVX512 void i8_tile_f32(const float* x, int64_t ldx, const int8_t* w, int64_t gstride, int64_t pairs,
                                 const float* scale, OutView o, int64_t row, int64_t n0, int64_t valid) {
  __m512 lo[MR][NV], hi[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) lo[m][v] = hi[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512 wl[NV], wh[NV];
    for (int v = 0; v < NV; ++v) {
      const int8_t* wp = w + v * gstride + p * kI8PairBytes;
      if (p % 2 == 0) prefetch_ahead(wp);  // one line per two pairs
      wl[v] = widen16_i8(wp);
      wh[v] = widen16_i8(wp + kOut);
    }
    for (int m = 0; m < MR; ++m) {
      double pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair));  // (x[2p], x[2p + 1]) x 8
      for (int v = 0; v < NV; ++v) {
        lo[m][v] = _mm512_fmadd_ps(xv, wl[v], lo[m][v]);
        hi[m][v] = _mm512_fmadd_ps(xv, wh[v], hi[m][v]);
      }
    }
  }
  for (int v = 0; v < NV && v * kOut < valid; ++v) {
    const __m512 s = _mm512_loadu_ps(scale + v * kOut);
    for (int m = 0; m < MR; ++m)
      store_out(o, row + m, n0 + v * kOut, _mm512_mul_ps(fold_pairs(lo[m][v], hi[m][v]), s), first_lanes(valid - v * kOut));
  }
}

// Several rows, bf16 activations: a tile's weights are widened once to bf16 (exact: |q| <= 127) into
// a panel [NV][Kp / 2][32] laid out as bf16_linear_avx512.cpp's packed weights, which every row block
// then reads with one VDPBF16PS per pair of inputs, 16 outputs and row.
LLMSERVE_AVX512_BF16 void i8_build_panel(const int8_t* w, int64_t gstride, int64_t pairs, int nv, uint16_t* panel) {
  for (int v = 0; v < nv; ++v)
    for (int64_t p = 0; p < pairs; ++p) {
      const int8_t* wp = w + v * gstride + p * kI8PairBytes;
      const __m512bh b = _mm512_cvtne2ps_pbh(widen16_i8(wp + kOut), widen16_i8(wp));
      _mm512_storeu_si512(panel + (v * pairs + p) * 2 * kOut, reinterpret_cast<const __m512i&>(b));
    }
}

// acc[m][v] += the pairs [p0, p1) of x rows (bf16 pairs as 32-bit words) times the panel's.
template <int MR, int NV>
LLMSERVE_AVX512_BF16 inline void panel_dot(const uint32_t* x, int64_t ldx, const uint16_t* panel, int64_t pstride,
                                           int64_t p0, int64_t p1, __m512 (&acc)[MR][NV]) {
  for (int64_t p = p0; p < p1; ++p) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(panel + v * pstride + p * 2 * kOut);
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[m * ldx + p]));
      for (int v = 0; v < NV; ++v) acc[m][v] = dot_bf16(acc[m][v], wv[v], xv);
    }
  }
}

template <int MR, int NV>
LLMSERVE_AVX512_BF16 void i8_panel_tile(const uint32_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                                        const float* scale, OutView o, int64_t row, int64_t n0, int64_t valid) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  panel_dot<MR, NV>(x, ldx, panel, pairs * 2 * kOut, 0, pairs, acc);
  for (int v = 0; v < NV && v * kOut < valid; ++v) {
    const __m512 s = _mm512_loadu_ps(scale + v * kOut);
    for (int m = 0; m < MR; ++m)
      store_out(o, row + m, n0 + v * kOut, _mm512_mul_ps(acc[m][v], s), first_lanes(valid - v * kOut));
  }
}

// ---- int4 ----------------------------------------------------------------------------------------

constexpr int64_t kI4Block = 8;  // inputs per 32-bit word

// bf16 of (i mod 16) - 8 for i < 32: VPERMW reads 5 index bits, the 5th is nibble t + 1's lowest.
alignas(64) constexpr uint16_t kI4Bf16Table[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000,
    0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
    0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

// Group fold: total += s * acc + z * xsum, acc = 0. sz: this quantization group's (s[16], z[16]).
LLMSERVE_AVX512 inline void fold_group(__m512& total, __m512& acc, __m512 s, __m512 z, float xsum) {
  total = _mm512_fmadd_ps(acc, s, total);
  total = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum), total);
  acc = _mm512_setzero_ps();
}

// Packed int4 weights: per output group, per quantization group q, a record of qstride bytes: its 16
// scales and 16 zeros (sz_head = 32 elements of the scale dtype), then blocks_per_group blocks of 16
// words. One output group is one sequential stream.
struct Int4Args {
  const uint8_t* w;    // the tile's first output group
  int64_t gstride;     // bytes per output group: groups * qstride
  int64_t qstride;     // bytes per quantization group record
  int64_t sz_head;     // bytes of its scales and zeros
  Kind sz_kind;
  int64_t sz_bytes;    // bytes of one scale / zero
  const float* xsum;   // [rows, ldxs]: per row and quantization group, sum of x
  int64_t ldxs;
  int64_t groups, blocks_per_group;

  const uint8_t* record(int v, int64_t q) const { return w + v * gstride + q * qstride; }
  const uint32_t* block(int v, int64_t q, int64_t bb) const {
    return reinterpret_cast<const uint32_t*>(record(v, q) + sz_head) + bb * kOut;
  }
};

// offset: what acc's weights carry beyond q - 8 (the bf16 path's weights are 128 + q, so 136), folded into
// the zero term: total += s * acc + (z - offset * s) * sum(x).
template <int MR, int NV>
LLMSERVE_AVX512 inline void i4_fold(const Int4Args& a, int64_t q, __m512 (&total)[MR][NV], __m512 (&acc)[MR][NV],
                                    float offset = 0.f) {
  for (int v = 0; v < NV; ++v) {
    const uint8_t* sz = a.record(v, q);
    const __m512 s = load16(sz, a.sz_kind);
    const __m512 z = _mm512_fnmadd_ps(_mm512_set1_ps(offset), s, load16(sz + kOut * a.sz_bytes, a.sz_kind));
    for (int m = 0; m < MR; ++m) fold_group(total[m][v], acc[m][v], s, z, a.xsum[m * a.ldxs + q]);
  }
}

template <int MR, int NV>
LLMSERVE_AVX512 inline void i4_store(__m512 (&total)[MR][NV], OutView o, int64_t row, int64_t n0, int64_t valid) {
  for (int v = 0; v < NV && v * kOut < valid; ++v)
    for (int m = 0; m < MR; ++m)
      store_out(o, row + m, n0 + v * kOut, total[m][v], first_lanes(valid - v * kOut));
}

// x fp32 [MR, ldx].
template <int MR, int NV>
LLMSERVE_AVX512 void i4_tile_f32(const float* x, int64_t ldx, Int4Args a, OutView o, int64_t row, int64_t n0,
                                 int64_t valid) {
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 total[MR][NV], acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) total[m][v] = acc[m][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < a.groups; ++q) {
    for (int64_t bb = 0; bb < a.blocks_per_group; ++bb) {
      const int64_t b = q * a.blocks_per_group + bb;
      for (int v = 0; v < NV; ++v) {
        const uint32_t* wp = a.block(v, q, bb);
        prefetch_ahead(wp);
        __m512i words = _mm512_loadu_si512(wp);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m512 wv = _mm512_permutexvar_ps(words, table);  // low 4 bits of each word: nibble t
          for (int m = 0; m < MR; ++m)
            acc[m][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + b * kI4Block + t]), wv, acc[m][v]);
          words = _mm512_srli_epi32(words, 4);
        }
      }
    }
    i4_fold<MR, NV>(a, q, total, acc);
  }
  i4_store<MR, NV>(total, o, row, n0, valid);
}

// x: per row, K / 2 32-bit words, word 4b + t = (x[8b + t], x[8b + 4 + t]) in bf16.
template <int MR, int NV>
LLMSERVE_AVX512_BF16 void i4_tile_bf16(const uint32_t* x, int64_t ldx, Int4Args a, OutView o, int64_t row,
                                       int64_t n0, int64_t valid) {
  // bf16 bits 0x4300 | q are 128 + q (exact): one VPTERNLOGD makes a weight pair from a shifted word,
  // where a VPERMW lookup of q - 8 costs two uops on Intel cores. The fold takes the 136 back out.
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
  __m512 total[MR][NV], acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) total[m][v] = acc[m][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < a.groups; ++q) {
    for (int64_t bb = 0; bb < a.blocks_per_group; ++bb) {
      const int64_t b = q * a.blocks_per_group + bb;
      for (int v = 0; v < NV; ++v) {
        const uint32_t* wp = a.block(v, q, bb);
        prefetch_ahead(wp);
        __m512i words = _mm512_loadu_si512(wp);
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          // (128 + q[8b + t], 128 + q[8b + 4 + t]): (words & nibble) | exponent
          const __m512i wv = _mm512_ternarylogic_epi32(words, nibble, exponent, 0xEA);
          for (int m = 0; m < MR; ++m)
            acc[m][v] = dot_bf16(acc[m][v], wv, _mm512_set1_epi32(static_cast<int>(x[m * ldx + b * 4 + t])));
          words = _mm512_srli_epi16(words, 4);
        }
      }
    }
    i4_fold<MR, NV>(a, q, total, acc, 136.f);
  }
  i4_store<MR, NV>(total, o, row, n0, valid);
}

// ---- int4 on AMX -----------------------------------------------------------------------------------

constexpr int64_t kTileFloats = llmserve::kAmxTileFloats;
constexpr int64_t kPanelRowElems = 2 * kOut;  // one B row: 16 outputs x 2 bf16

// Output group v's (q - 8) over quantization group q as bf16 B rows: row 4 bb + t = the bf16 path's words
// of block bb, step t; rows [16 u, 16 u + 16) are the B tile of the group's inputs [32 u, 32 u + 32).
LLMSERVE_AMX void i4_amx_b_tiles(const Int4Args& a, int v, int64_t q, uint16_t* rows) {
  const __m512i table = _mm512_load_si512(kI4Bf16Table);
  for (int64_t bb = 0; bb < a.blocks_per_group; ++bb) {
    const uint32_t* wp = a.block(v, q, bb);
    prefetch_ahead(wp);
    __m512i words = _mm512_loadu_si512(wp);
    for (int t = 0; t < 4; ++t) {
      _mm512_store_si512(rows + (4 * bb + t) * kPanelRowElems, _mm512_permutexvar_epi16(words, table));
      words = _mm512_srli_epi16(words, 4);
    }
  }
}

// c[i * 2 + j] = x rows [16 i, 16 i + 16) . the B rows of output group j, over `tiles` input tiles (int4:
// q - 8; int8: the widened panel). x: bf16 pair words at the first input (row stride ldx words); b: output
// group 0's B rows, group 1's b_stride elements on.
template <int MB, int NB>
LLMSERVE_AMX void amx_dot(const uint32_t* x, int64_t ldx, const uint16_t* b, int64_t b_stride, int64_t tiles,
                          float* c) {
  constexpr int64_t kWordsPerTile = llmserve::kAmxTileK / 2;
  llmserve::amx_zero<MB, NB>();
  for (int64_t u = 0; u < tiles; ++u)
    llmserve::amx_step<MB, NB>(x + u * kWordsPerTile, x + llmserve::kAmxTileRows * ldx + u * kWordsPerTile, ldx * 4,
                               b + u * 16 * kPanelRowElems, b + b_stride + u * 16 * kPanelRowElems);
  llmserve::amx_store<MB, NB>(c);
}

using AmxDot = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);

AmxDot amx_pick(int mb, int nb) {
  if (mb == 2) return nb == 2 ? &amx_dot<2, 2> : &amx_dot<2, 1>;
  return nb == 2 ? &amx_dot<1, 2> : &amx_dot<1, 1>;
}

// One thread's output groups [begin, end), two at a time, for every row: per quantization group, its B
// tiles are written once (into L1) and every block of 32 rows multiplies them, folding its valid rows into
// fp32 totals [rows, 32]. x: pair words [rows padded to 16, ldx]; args.xsum likewise.
LLMSERVE_AMX void i4_amx_groups(int64_t begin, int64_t end, const Int4Args& args, const uint32_t* x, int64_t ldx,
                                int64_t M, OutView o, int64_t n, uint16_t* b_rows, float* total) {
  llmserve::load_amx_tile_config();
  alignas(64) float c[4 * kTileFloats];
  const int64_t tiles = args.blocks_per_group * kI4Block / llmserve::kAmxTileK;
  const int64_t b_stride = tiles * 16 * kPanelRowElems;  // elements of one output group's B tiles
  const int64_t words_per_group = args.blocks_per_group * kI4Block / 2;
  for (int64_t g = begin; g < end; g += 2) {
    const int nb = static_cast<int>(std::min<int64_t>(2, end - g));
    Int4Args a = args;
    a.w += g * args.gstride;
    std::fill(total, total + M * 2 * kOut, 0.f);
    for (int64_t q = 0; q < a.groups; ++q) {
      for (int v = 0; v < nb; ++v) i4_amx_b_tiles(a, v, q, b_rows + v * b_stride);
      __m512 s[2], z[2];
      for (int j = 0; j < nb; ++j) {
        const uint8_t* sz = a.record(j, q);
        s[j] = load16(sz, a.sz_kind);
        z[j] = load16(sz + kOut * a.sz_bytes, a.sz_kind);
      }
      for (int64_t r = 0; r < M; r += 2 * llmserve::kAmxTileRows) {
        const int mb = M - r > llmserve::kAmxTileRows ? 2 : 1;
        amx_pick(mb, nb)(x + r * ldx + q * words_per_group, ldx, b_rows, b_stride, tiles, c);
        for (int i = 0; i < mb; ++i)
          for (int64_t m = 0; m < llmserve::kAmxTileRows; ++m) {
            const int64_t row = r + i * llmserve::kAmxTileRows + m;
            if (row >= M) break;  // padding rows: computed, never folded
            const __m512 xs = _mm512_set1_ps(a.xsum[row * a.ldxs + q]);
            for (int j = 0; j < nb; ++j) {
              float* t = total + row * 2 * kOut + j * kOut;
              const __m512 dot = _mm512_load_ps(c + (i * 2 + j) * kTileFloats + m * kOut);
              _mm512_storeu_ps(t, _mm512_fmadd_ps(z[j], xs, _mm512_fmadd_ps(dot, s[j], _mm512_loadu_ps(t))));
            }
          }
      }
    }
    for (int64_t row = 0; row < M; ++row)
      for (int j = 0; j < nb; ++j) {
        const int64_t col = (g + j) * kOut;
        if (col < n) store_out(o, row, col, _mm512_loadu_ps(total + row * 2 * kOut + j * kOut), first_lanes(n - col));
      }
  }
  _tile_release();
}

// int8 on AMX. The int8 pair layout widens to AMX's B rows as they are (i8_build_panel's layout).

// B rows of one output group's int8 weights for input pairs [p0, p0 + 16), widened to bf16 (exact).
LLMSERVE_AMX void i8_b_tile(const int8_t* w, int64_t p0, uint16_t* rows) {
  for (int64_t p = 0; p < 16; ++p) {
    const int8_t* wp = w + (p0 + p) * kI8PairBytes;
    const __m512bh b = _mm512_cvtne2ps_pbh(widen16_i8(wp + kOut), widen16_i8(wp));
    _mm512_store_si512(rows + p * kPanelRowElems, reinterpret_cast<const __m512i&>(b));
  }
}

// Up to 32 rows: the B tiles are widened into L1 one input tile at a time, the accumulators stay in tiles
// over the whole K. c as amx_dot's.
template <int MB, int NB>
LLMSERVE_AMX void i8_amx_dot_streamed(const uint32_t* x, int64_t ldx, const int8_t* w, int64_t gstride,
                                      int64_t tiles, uint16_t* b, float* c) {
  constexpr int64_t kWordsPerTile = llmserve::kAmxTileK / 2, kTileElems = 16 * kPanelRowElems;
  llmserve::amx_zero<MB, NB>();
  for (int64_t kt = 0; kt < tiles; ++kt) {
    prefetch_ahead(w + kt * 16 * kI8PairBytes);
    i8_b_tile(w, kt * 16, b);
    if constexpr (NB == 2) {
      prefetch_ahead(w + gstride + kt * 16 * kI8PairBytes);
      i8_b_tile(w + gstride, kt * 16, b + kTileElems);
    }
    llmserve::amx_step<MB, NB>(x + kt * kWordsPerTile, x + llmserve::kAmxTileRows * ldx + kt * kWordsPerTile, ldx * 4,
                               b, b + kTileElems);
  }
  llmserve::amx_store<MB, NB>(c);
}

using I8StreamedDot = void (*)(const uint32_t*, int64_t, const int8_t*, int64_t, int64_t, uint16_t*, float*);

I8StreamedDot i8_streamed_pick(int mb, int nb) {
  if (mb == 2) return nb == 2 ? &i8_amx_dot_streamed<2, 2> : &i8_amx_dot_streamed<2, 1>;
  return nb == 2 ? &i8_amx_dot_streamed<1, 2> : &i8_amx_dot_streamed<1, 1>;
}

// Rows [r, r + 16 mb) x output groups first_group + [0, nb) of the tiles' sums, times the channel scale.
LLMSERVE_AMX void i8_amx_store(const float* c, int mb, int nb, int64_t r, int64_t M, int64_t first_group,
                               const float* scale, OutView o, int64_t n) {
  for (int j = 0; j < nb; ++j) {
    const int64_t col = (first_group + j) * kOut;
    if (col >= n) continue;
    const __m512 s = _mm512_loadu_ps(scale + col);
    for (int i = 0; i < mb; ++i)
      for (int64_t m = 0; m < llmserve::kAmxTileRows && r + i * llmserve::kAmxTileRows + m < M; ++m)
        store_out(o, r + i * llmserve::kAmxTileRows + m, col,
                  _mm512_mul_ps(_mm512_load_ps(c + (i * 2 + j) * kTileFloats + m * kOut), s), first_lanes(n - col));
  }
}

// One thread's output groups [begin, end). Up to 32 rows: two groups at a time, their B tiles widened as
// they stream; more rows: up to 4 groups widened once into a panel that every block of 32 rows multiplies.
// x: bf16 pair words [rows padded to 16, pairs]; panel: 4 * pairs * 32 bf16 of scratch (64-byte aligned).
LLMSERVE_AMX void i8_amx_groups(int64_t begin, int64_t end, const int8_t* w, int64_t gstride, int64_t pairs,
                                const float* scale, const uint32_t* x, int64_t M, OutView o, int64_t n,
                                uint16_t* panel) {
  llmserve::load_amx_tile_config();
  alignas(64) float c[4 * kTileFloats];
  const int64_t b_stride = pairs * kPanelRowElems, tiles = pairs * 2 / llmserve::kAmxTileK;
  if (M <= 2 * llmserve::kAmxTileRows) {
    const int mb = M > llmserve::kAmxTileRows ? 2 : 1;
    for (int64_t g = begin; g < end; g += 2) {
      const int nb = static_cast<int>(std::min<int64_t>(2, end - g));
      i8_streamed_pick(mb, nb)(x, pairs, w + g * gstride, gstride, tiles, panel, c);
      i8_amx_store(c, mb, nb, 0, M, g, scale, o, n);
    }
  } else {
    for (int64_t g = begin; g < end; g += 4) {
      const int nv = static_cast<int>(std::min<int64_t>(4, end - g));
      i8_build_panel(w + g * gstride, gstride, pairs, nv, panel);
      for (int j0 = 0; j0 < nv; j0 += 2) {
        const int nb = std::min(2, nv - j0);
        for (int64_t r = 0; r < M; r += 2 * llmserve::kAmxTileRows) {
          const int mb = M - r > llmserve::kAmxTileRows ? 2 : 1;
          amx_pick(mb, nb)(x + r * pairs, pairs, panel + j0 * b_stride, b_stride, tiles, c);
          i8_amx_store(c, mb, nb, r, M, g + j0, scale, o, n);
        }
      }
    }
  }
  _tile_release();
}

// ---- tile selection and threading ----------------------------------------------------------------

// Register blocks (rows x output groups): one row streams the weights (more output groups in flight);
// several rows reuse each widened weight vector MR times.
struct Blocking {
  int mr, nv;
};
constexpr Blocking kOneRow{1, 4};
constexpr Blocking kDirect{4, 2};  // weights widened in registers (int4: per-group and total accumulators)
constexpr Blocking kPanelI8{4, 4};

// Tile<MR, NV>::run(args...) for the runtime mr <= MR, nv <= NV.
template <template <int, int> class Tile, int MR, int NV>
struct Pick {
  template <typename... A>
  static void run(int mr, int nv, const A&... args) {
    if constexpr (MR > 1) {
      if (mr < MR) return Pick<Tile, MR - 1, NV>::run(mr, nv, args...);
    }
    if constexpr (NV > 1) {
      if (nv < NV) return Pick<Tile, MR, NV - 1>::run(mr, nv, args...);
    }
    Tile<MR, NV>::run(args...);
  }
};

// Runs over rows [0, M) x output groups [0, G), threads splitting the groups: per tile of up to
// blk.nv groups, prepare(g, nv, panel) once, then tile(mr, nv, row, g, panel) per block of blk.mr rows.
// panel_elems: uint16 scratch per output group (0: none).
template <typename Prepare, typename F>
void for_tiles(int64_t M, int64_t G, int64_t K, Blocking blk, int64_t panel_elems, Prepare&& prepare, F&& tile) {
  // Each task gets at least ~64k weights, so small layers do not pay for a thread hand-off.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(kOut * K, 1));
  at::parallel_for(0, G, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> panel(panel_elems * blk.nv);
    for (int64_t g = begin; g < end; g += blk.nv) {
      const int nv = static_cast<int>(std::min<int64_t>(blk.nv, end - g));
      if (panel_elems) prepare(g, nv, panel.data());
      for (int64_t r = 0; r < M; r += blk.mr) tile(static_cast<int>(std::min<int64_t>(blk.mr, M - r)), nv, r, g, panel.data());
    }
  });
}

constexpr auto kNoPrepare = [](int64_t, int, uint16_t*) {};

template <int MR, int NV>
struct I8F32 {
  template <typename... A> static void run(const A&... a) { i8_tile_f32<MR, NV>(a...); }
};
template <int MR, int NV>
struct I8Panel {
  template <typename... A> static void run(const A&... a) { i8_panel_tile<MR, NV>(a...); }
};
template <int MR, int NV>
struct I4F32 {
  template <typename... A> static void run(const A&... a) { i4_tile_f32<MR, NV>(a...); }
};
template <int MR, int NV>
struct I4Bf16 {
  template <typename... A> static void run(const A&... a) { i4_tile_bf16<MR, NV>(a...); }
};

// mode: 0 = the faster path for these inputs, 1 = fp32 path, 2 = bf16 path (bf16 x, AVX512-BF16),
// 3 = the AMX path (use_amx_path turns it into 2 for what follows).
bool use_bf16_path(const at::Tensor& x, int64_t rows, int64_t mode, int64_t min_rows, const char* op) {
  TORCH_CHECK(mode >= 0 && mode <= 2, op, ": mode must be 0 (auto), 1 (fp32), 2 (bf16) or 3 (AMX)");
  if (mode == 2) {
    TORCH_CHECK(cpu_has_avx512_bf16(), op, ": the bf16 path needs AVX512-BF16");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": the bf16 path needs bfloat16 activations");
    return true;
  }
  return mode == 0 && cpu_has_avx512_bf16() && x.scalar_type() == at::kBFloat16 && rows >= min_rows;
}

// From this many rows of bf16 activations on AMX CPUs, the AMX paths (mode 3 forces them).
constexpr int64_t kI4AmxMinRows = 2;
// int8: widening its weights to bf16 costs the same at every row count (~12 ms for SmolLM2-135M's linears on
// the Sapphire Rapids-class host), which the fp32 path beats below 8 rows. There the bf16 panel path lost to
// the fp32 path at every row count (5-64), so on AMX CPUs mode 0 goes fp32 -> AMX without it.
constexpr int64_t kI8AmxMinRows = 8;

// tiles_fit: the weights come in whole 32-input tiles (int4: its groups; int8: its padded inputs).
bool use_amx_path(const at::Tensor& x, int64_t rows, bool tiles_fit, int64_t min_rows, int64_t& mode, const char* op) {
  const bool fits = x.scalar_type() == at::kBFloat16 && tiles_fit;
  if (mode == 3) {
    TORCH_CHECK(llmserve::cpu_has_amx_bf16(), op, ": the AMX path needs AMX-BF16 (granted by the OS)");
    TORCH_CHECK(fits, op, ": the AMX path needs bfloat16 activations and inputs in whole tiles of 32 (int4: groups of "
                "a multiple of 32)");
    mode = 2;  // what the rest of the call reads: the bf16 activation layout
    return true;
  }
  return mode == 0 && fits && rows >= min_rows && llmserve::cpu_has_amx_bf16();
}

// The activations as [rows, K] (any leading dims), the output [..., n] and its view for the tiles.
struct Call {
  at::Tensor x;    // [rows, K], contiguous
  at::Tensor out;  // [..., n]
  int64_t rows, K;
  OutView o;
};

Call begin_call(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                const char* op) {
  TORCH_CHECK(cpu_has_avx512(), op, ": this CPU lacks AVX-512 (F, BW, VL, DQ)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., in_features]");
  TORCH_CHECK(packed.is_contiguous(), op, ": the packed weight must be contiguous");
  TORCH_CHECK(n >= 0, op, ": n must be the number of output features");
  const Kind kind = kind_of(x.scalar_type(), op);
  Call c;
  c.K = x.size(-1);
  c.x = x.reshape({-1, c.K}).contiguous();
  c.rows = c.x.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  c.out = at::empty(shape, x.options());
  c.o = OutView{c.out.data_ptr(), n, kind, nullptr, Kind::f32};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->is_contiguous() && bias->device().is_cpu(), op,
                ": bias must be a contiguous [", n, "] CPU tensor");
    c.o.bias = bias->data_ptr();
    c.o.bias_kind = kind_of(bias->scalar_type(), op);
  }
  return c;
}

// Scratch for the per-call activation copies: reused across calls on this thread while small, so a
// decode step's many small linears do not each allocate.
float* scratch(int64_t floats, at::Tensor& holder) {
  constexpr int64_t kKeep = int64_t(1) << 18;  // 1 MiB
  static thread_local std::vector<float> kept;
  if (floats <= kKeep) {
    if (static_cast<int64_t>(kept.size()) < floats) kept.resize(kKeep);
    return kept.data();
  }
  holder = at::empty({floats}, at::TensorOptions().dtype(at::kFloat));
  return holder.data_ptr<float>();
}

// From this many rows bf16 activations take the int8 panel path: below, widening to bf16 and storing
// the panel costs as much as the fp32 path's extra FMAs (measured equal at 2 and 4 rows, fp32 ahead at 3,
// the panel ahead from 5). int4 needs no panel: its nibbles widen in two instructions per 32 weights,
// and re-widening them per block of 4 rows measured faster than a panel at every row count.
constexpr int64_t kI8Bf16MinRows = 5;

// x [..., K] -> [..., n]; packed int8 [G, Kp / 2, 32]; scale fp32 [16 G]; bias [n] or None.
at::Tensor int8_weight_linear_avx512(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                                     int64_t n, const c10::optional<at::Tensor>& bias, int64_t mode) {
  const char* op = "int8_weight_linear_avx512";
  Call c = begin_call(x_in, packed, n, bias, op);
  const int64_t M = c.rows, K = c.K, Kp = (K + 1) / 2 * 2, G = (n + kOut - 1) / kOut;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(0) == G &&
                  packed.size(1) * 2 == Kp && packed.size(2) == kI8PairBytes,
              op, ": packed must be int8 [", G, ", ", Kp / 2, ", 32] for ", n, " outputs and ", K, " features");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == G * kOut, op,
              ": scale must be contiguous float32 [", G * kOut, "] (padded to whole groups of 16)");
  const bool amx_path = use_amx_path(c.x, M, K % llmserve::kAmxTileK == 0, kI8AmxMinRows, mode, op);
  const int64_t panel_min_rows = llmserve::cpu_has_amx_bf16() ? std::numeric_limits<int64_t>::max() : kI8Bf16MinRows;
  const bool bf16_path = amx_path || use_bf16_path(c.x, M, mode, panel_min_rows, op);
  if (M == 0 || n == 0) return c.out;
  const OutView o = c.o;
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t gstride = Kp / 2 * kI8PairBytes, pairs = Kp / 2;
  const Kind x_kind = kind_of(c.x.scalar_type(), op);
  const char* xsrc = static_cast<const char*>(c.x.data_ptr());
  at::Tensor holder;
  if (amx_path) {  // rows padded with zeros to whole 16-row tiles (K == Kp: whole 32-input tiles)
    const int64_t padded_rows = (M + llmserve::kAmxTileRows - 1) / llmserve::kAmxTileRows * llmserve::kAmxTileRows;
    uint16_t* padded = reinterpret_cast<uint16_t*>(scratch(padded_rows * Kp / 2, holder));
    std::memcpy(padded, xsrc, 2 * M * K);
    std::memset(padded + M * K, 0, 2 * (padded_rows - M) * K);
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(padded);
    at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
      struct alignas(64) PanelRow { uint16_t v[kPanelRowElems]; };
      std::vector<PanelRow> panel(4 * pairs);
      i8_amx_groups(begin, end, w, gstride, pairs, sp, xp, M, o, n, reinterpret_cast<uint16_t*>(panel.data()));
    });
    return c.out;
  }
  if (bf16_path) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xsrc);
    if (Kp != K) {  // one zero input appended to each row
      uint16_t* padded = reinterpret_cast<uint16_t*>(scratch(M * Kp / 2, holder));
      for (int64_t m = 0; m < M; ++m) {
        std::memcpy(padded + m * Kp, xsrc + m * K * 2, 2 * K);
        padded[m * Kp + K] = 0;
      }
      xp = reinterpret_cast<const uint32_t*>(padded);
    }
    for_tiles(
        M, G, K, kPanelI8, pairs * 2 * kOut,
        [&](int64_t g, int nv, uint16_t* panel) { i8_build_panel(w + g * gstride, gstride, pairs, nv, panel); },
        [&](int mr, int nv, int64_t r, int64_t g, const uint16_t* panel) {
          Pick<I8Panel, kPanelI8.mr, kPanelI8.nv>::run(mr, nv, xp + r * pairs, pairs, panel, pairs, sp + g * kOut, o, r,
                                                     g * kOut, n - g * kOut);
        });
    return c.out;
  }
  const float* xp = reinterpret_cast<const float*>(xsrc);
  if (Kp != K || x_kind != Kind::f32) {
    float* x32 = scratch(M * Kp, holder);
    for (int64_t m = 0; m < M; ++m) row_to_f32(xsrc + m * K * c.x.element_size(), x_kind, K, Kp, x32 + m * Kp);
    xp = x32;
  }
  for_tiles(M, G, K, M == 1 ? kOneRow : kDirect, 0, kNoPrepare, [&](int mr, int nv, int64_t r, int64_t g, const uint16_t*) {
    if (M == 1)
      Pick<I8F32, kOneRow.mr, kOneRow.nv>::run(mr, nv, xp + r * Kp, Kp, w + g * gstride, gstride, pairs, sp + g * kOut,
                                              o, r, g * kOut, n - g * kOut);
    else
      Pick<I8F32, kDirect.mr, kDirect.nv>::run(mr, nv, xp + r * Kp, Kp, w + g * gstride, gstride, pairs, sp + g * kOut,
                                              o, r, g * kOut, n - g * kOut);
  });
  return c.out;
}

// x [..., K] -> [..., n]; packed uint8 [G, K / group, 32 s + 8 group] (records as in Int4Args, s: the
// size of scale_dtype: float32, bfloat16 or float16); bias [n] or None.
at::Tensor int4_weight_linear_avx512(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, int64_t group,
                                     at::ScalarType scale_dtype, const c10::optional<at::Tensor>& bias, int64_t mode) {
  const char* op = "int4_weight_linear_avx512";
  Call c = begin_call(x_in, packed, n, bias, op);
  const int64_t M = c.rows, K = c.K, G = (n + kOut - 1) / kOut;
  TORCH_CHECK(group > 0 && group % kI4Block == 0 && K % group == 0, op, ": group ", group,
              " must be a multiple of 8 dividing in_features ", K);
  const int64_t groups = K / group;
  const Kind sz_kind = kind_of(scale_dtype, op);
  const int64_t sz_bytes = sz_kind == Kind::f32 ? 4 : 2, sz_head = 2 * kOut * sz_bytes;
  const int64_t qstride = sz_head + group / kI4Block * kOut * 4;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(0) == G &&
                  packed.size(1) == groups && packed.size(2) == qstride,
              op, ": packed must be uint8 [", G, ", ", groups, ", ", qstride, "] for ", n, " outputs, ", K,
              " features, group ", group, " and ", scale_dtype, " scales");
  const bool amx_path = use_amx_path(c.x, M, group % llmserve::kAmxTileK == 0, kI4AmxMinRows, mode, op);
  const bool bf16_path = amx_path || use_bf16_path(c.x, M, mode, 1, op);
  if (M == 0 || n == 0) return c.out;
  const OutView o = c.o;
  const Kind x_kind = kind_of(c.x.scalar_type(), op);
  // The AMX path reads x in whole 16-row tiles: rows up to padded_rows, zero beyond M.
  const int64_t padded_rows = amx_path ? (M + llmserve::kAmxTileRows - 1) / llmserve::kAmxTileRows * llmserve::kAmxTileRows : M;
  // Scratch: per row the sums of x per quantization group, then the fp32 path's fp32 copy of x (unless x
  // is fp32 already) or the bf16 path's pairs of x; then one fp32 row for the bf16 path's sums.
  const bool need_x32 = !bf16_path && x_kind != Kind::f32;
  const int64_t row_words = groups + (bf16_path ? K / 2 : need_x32 ? K : 0);
  at::Tensor holder;
  float* xsum = scratch(padded_rows * row_words + (bf16_path ? K : 0), holder);
  float* row32 = xsum + padded_rows * row_words;
  std::fill(xsum + M * row_words, row32, 0.f);
  const int64_t esize = c.x.element_size();
  for (int64_t m = 0; m < M; ++m) {
    const char* src = static_cast<const char*>(c.x.data_ptr()) + m * K * esize;
    float* dst = xsum + m * row_words + groups;
    const float* x32 = need_x32 ? dst : bf16_path ? row32 : reinterpret_cast<const float*>(src);
    if (need_x32 || bf16_path) row_to_f32(src, x_kind, K, K, const_cast<float*>(x32));
    group_sums(x32, groups, group, xsum + m * row_words);
    if (bf16_path) {  // word 4b + t = (x[8b + t], x[8b + 4 + t])
      uint32_t* pairs = reinterpret_cast<uint32_t*>(dst);
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(src);
      for (int64_t b = 0; b < K / kI4Block; ++b) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + b * kI4Block));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 4 * b), _mm_unpacklo_epi16(v, _mm_srli_si128(v, 8)));
      }
    }
  }
  const Int4Args a{packed.data_ptr<uint8_t>(), groups * qstride, qstride, sz_head, sz_kind, sz_bytes, xsum, row_words,
                   groups, group / kI4Block};
  auto at_tile = [&](int64_t r, int64_t g) {
    Int4Args t = a;
    t.w += g * a.gstride;
    t.xsum += r * row_words;
    return t;
  };
  if (amx_path) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xsum + groups);
    at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
      // 64-byte aligned B rows for two output groups over one quantization group, and the fp32 totals.
      struct alignas(64) BRow { uint16_t v[kPanelRowElems]; };
      std::vector<BRow> b_rows(2 * group / llmserve::kAmxTileK * 16);
      std::vector<float> total(M * 2 * kOut);
      i4_amx_groups(begin, end, a, xp, row_words, M, o, n, reinterpret_cast<uint16_t*>(b_rows.data()), total.data());
    });
  } else if (bf16_path) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xsum + groups);
    const Blocking blk = M == 1 ? kOneRow : kDirect;
    for_tiles(M, G, K, blk, 0, kNoPrepare, [&](int mr, int nv, int64_t r, int64_t g, const uint16_t*) {
      if (M == 1)
        Pick<I4Bf16, kOneRow.mr, kOneRow.nv>::run(mr, nv, xp + r * row_words, row_words, at_tile(r, g), o, r, g * kOut,
                                                 n - g * kOut);
      else
        Pick<I4Bf16, kDirect.mr, kDirect.nv>::run(mr, nv, xp + r * row_words, row_words, at_tile(r, g), o, r, g * kOut,
                                                 n - g * kOut);
    });
  } else {
    const float* xp = need_x32 ? xsum + groups : c.x.data_ptr<float>();
    const int64_t ldx = need_x32 ? row_words : K;
    const Blocking blk = M == 1 ? kOneRow : kDirect;
    for_tiles(M, G, K, blk, 0, kNoPrepare, [&](int mr, int nv, int64_t r, int64_t g, const uint16_t*) {
      if (M == 1)
        Pick<I4F32, kOneRow.mr, kOneRow.nv>::run(mr, nv, xp + r * ldx, ldx, at_tile(r, g), o, r, g * kOut, n - g * kOut);
      else
        Pick<I4F32, kDirect.mr, kDirect.nv>::run(mr, nv, xp + r * ldx, ldx, at_tile(r, g), o, r, g * kOut, n - g * kOut);
    });
  }
  return c.out;
}

bool quant_avx512_available() { return cpu_has_avx512(); }
bool quant_avx512_bf16_available() { return cpu_has_avx512_bf16(); }
bool quant_amx_available() { return llmserve::cpu_has_amx_bf16(); }
int64_t int4_amx_min_rows() { return kI4AmxMinRows; }
int64_t int8_amx_min_rows() { return kI8AmxMinRows; }

}  // namespace

// For C++ callers in this library (ops.h).
namespace llmserve::ops {
at::Tensor int4_weight_linear_avx512(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group,
                                     at::ScalarType scale_dtype, const c10::optional<at::Tensor>& bias, int64_t mode) {
  return ::int4_weight_linear_avx512(x, packed, n, group, scale_dtype, bias, mode);
}
at::Tensor int8_weight_linear_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n,
                                     const c10::optional<at::Tensor>& bias, int64_t mode) {
  return ::int8_weight_linear_avx512(x, packed, scale, n, bias, mode);
}
}  // namespace llmserve::ops

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("quant_avx512_available() -> bool", &quant_avx512_available);
  m.def("quant_avx512_bf16_available() -> bool", &quant_avx512_bf16_available);
  m.def("quant_amx_available() -> bool", &quant_amx_available);
  m.def("int4_amx_min_rows() -> int", &int4_amx_min_rows);
  m.def("int8_amx_min_rows() -> int", &int8_amx_min_rows);
  m.def("int8_weight_linear_avx512(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias=None, int mode=0) -> Tensor");
  m.def("int4_weight_linear_avx512(Tensor x, Tensor packed, int n, int group, ScalarType scale_dtype, Tensor? bias=None, "
        "int mode=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("int8_weight_linear_avx512", &int8_weight_linear_avx512);
  m.impl("int4_weight_linear_avx512", &int4_weight_linear_avx512);
}
