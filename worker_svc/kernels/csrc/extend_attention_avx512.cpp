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

#include "avx512.h"

namespace {

using llmserve::cpu_has_avx512_bf16;
using llmserve::dot_bf16;
using llmserve::exp16;

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

// Keys of kv head h, block b -> packed [Dk / 2][64][2] (as 32-bit words: [Dk / 2][64]).
void pack_key_block(const Source& keys, int64_t h, int64_t b, int64_t C, int64_t Dk, uint32_t* dst) {
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
  const __m512 scale = _mm512_set1_ps(pb.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
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
          const int64_t left = seen[m] - v * kLanes;
          const __mmask16 keep = left >= kLanes ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
          s[m][v] = _mm512_mask_mul_ps(minus_inf, keep, s[m][v], scale);
          peak = _mm512_max_ps(peak, s[m][v]);
        }
        float& row_max = st.max[r0 + m];
        // Every row sees key 0 in block 0, so the new max is finite; the first block's correction is e^-inf = 0.
        const float new_max = std::max(row_max, _mm512_reduce_max_ps(peak));
        shift_by[m] = row_max - new_max;
        row_max = new_max;
      }
      alignas(64) float corr[kLanes];
      _mm512_store_ps(corr, exp16(_mm512_load_ps(shift_by)));
      for (int m = 0; m < kRows; ++m) {
        const __m512 shift = _mm512_set1_ps(st.max[r0 + m]);
        __m512 total = _mm512_setzero_ps();
        for (int v = 0; v < kKeyVecs; ++v) {
          s[m][v] = exp16(_mm512_sub_ps(s[m][v], shift));
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
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / st.sum[r]);
    uint16_t* dst = pb.out + ((t0 + r) * pb.Hq + hq) * pb.Dv;
    for (int64_t d = 0; d < pb.Dv; d += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          llmserve::to_bf16(_mm512_mul_ps(_mm512_loadu_ps(st.o.data() + r * pb.Dv + d), inv)));
  }
}

void check_kv(const at::Tensor& t, const char* name, int64_t heads) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu() && t.dim() == 3, "extend_attention: ", name,
              " must be a bfloat16 CPU tensor [rows, kv_heads, dim]");
  TORCH_CHECK(t.size(1) == heads && t.stride(2) == 1, "extend_attention: ", name, " must have ", heads,
              " heads, each contiguous");
}

// q [T, Hq, Dk]; keys [rows, Hkv, Dk], values [rows, Hkv, Dv] (rows: the context, or the pool with `slots`
// [prefix + T] naming each context position's row); query t attends to context [0, prefix + t]. -> [T, Hq, Dv].
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const c10::optional<at::Tensor>& slots_opt, int64_t prefix, double scale) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "extend_attention: this CPU lacks AVX512-BF16");
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
  at::Tensor out = at::empty({T, Hq, Dv}, q.options());
  if (T == 0) return out;
  const int64_t key_blocks = (C + kKeyBlock - 1) / kKeyBlock;
  const int64_t key_words = key_blocks * (Dk / 2) * kKeyBlock, value_words = key_blocks * (kKeyBlock / 2) * Dv;
  std::vector<uint32_t> packed_keys(Hkv * key_words), packed_values(Hkv * value_words);
  const Source ks{reinterpret_cast<const uint16_t*>(keys.data_ptr()), keys.stride(0), keys.stride(1), slots};
  const Source vs{reinterpret_cast<const uint16_t*>(values.data_ptr()), values.stride(0), values.stride(1), slots};
  at::parallel_for(0, Hkv * key_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / key_blocks, b = i % key_blocks;
      pack_key_block(ks, h, b, C, Dk, packed_keys.data() + h * key_words + b * (Dk / 2) * kKeyBlock);
      pack_value_block(vs, h, b, C, Dv, packed_values.data() + h * value_words + b * (kKeyBlock / 2) * Dv);
    }
  });
  const Problem pb{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1), T, prefix, Hq, Hkv, Dk, Dv,
                   static_cast<float>(scale), packed_keys.data(), packed_values.data(), key_blocks,
                   reinterpret_cast<uint16_t*>(out.data_ptr())};
  const int64_t query_blocks = (T + kQueryBlock - 1) / kQueryBlock, tasks = query_blocks * Hq;
  std::atomic<int64_t> next{0};
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("extend_attention_available() -> bool", &extend_attention_available);
  m.def("extend_attention(Tensor q, Tensor keys, Tensor values, Tensor? slots, int prefix, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("extend_attention", &extend_attention); }
