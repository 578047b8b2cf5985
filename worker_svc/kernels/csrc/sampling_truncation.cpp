// The sampler's truncation as one logit threshold per row (sampling/sampler.py defines it; the fused race in
// sampling_race.cpp then keeps the columns at or above it):
//
//   truncation_threshold(x [R, >= V] f32 / bf16 / f16, inv_temperature [R] f32, top_k [R] i64, top_p [R] f32,
//                        log_min_p [R] f32, V) -> [R] f32
//
// per row, over the columns v < V of the processed logits s = x * inv_temperature (float32, as the sampler's
// tensor path scales them; a row with nothing to truncate is not read and gets -inf):
//   kth  = the k-th largest value, counting duplicates (-inf when top_k is 0 or >= V);
//   cut  = for top_p < 1, the value at which the descending cumulative probability of the columns >= kth,
//          renormalized over them, first reaches top_p (-inf for top_p >= 1);
//   min  = max(x) + log_min_p (min-p: p >= min_p * p_max);
//   threshold = max(kth, cut, min).
// A column is kept iff its value is >= the threshold, so ties with the last kept value are kept, whatever order
// a sort would have put them in.
//
// Why: torch.topk over 49,152 columns, the view's exp / cumsum and the full-vocabulary fallback when a bf16
// tie straddles the k-th value made a 64-row top-p step take ~20 ms against ~2.6 ms for the race itself.
// Here a row is one vector pass (max, then the count and probability mass at or above a few distances from
// the max) and a sort of only the columns within the distance that holds the answer: the top k, or enough
// mass to reach top_p (and when those are many, of only the bin of them where the cumulative sum crosses). Sums are in double, against torch's float cumsum: the cut can differ from the tensor
// path's only where the cumulative probability lies within float rounding (~1e-6) of top_p.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Distances below the row's max inside which candidates are gathered, narrowest first; the last takes all.
constexpr std::array<float, 7> kWindows = {1.f, 2.f, 4.f, 8.f, 16.f, 32.f, std::numeric_limits<float>::infinity()};
constexpr int kNumWindows = static_cast<int>(kWindows.size());
// Candidates beyond this many are binned before the sort (nucleus_cut), into this many bins.
constexpr size_t kSortAtMost = 256;
constexpr int kBins = 1024;

float row_max(const float* x, int64_t V) {
  __m256 m = _mm256_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float out = *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) out = std::max(out, x[i]);
  return out;
}

struct WindowStats {
  std::array<int64_t, kNumWindows> count{};
  std::array<double, kNumWindows> mass{};  // sum of exp(x - max) of the columns in the window
};

// Counts (and, when asked, the probability mass) of the columns >= max - window for every window, in one pass.
WindowStats window_stats(const float* x, int64_t V, float m, bool with_mass) {
  WindowStats stats;
  std::array<__m256, kNumWindows> floors, mass;
  std::array<__m256i, kNumWindows> counts;
  for (int w = 0; w < kNumWindows; ++w) {
    floors[w] = _mm256_set1_ps(m - kWindows[w]);
    mass[w] = _mm256_setzero_ps();
    counts[w] = _mm256_setzero_si256();
  }
  const __m256 max_v = _mm256_set1_ps(m);
  auto add = [&](__m256 v) {
    const __m256 e = with_mass ? llmserve::exp8(_mm256_sub_ps(v, max_v)) : _mm256_setzero_ps();
    for (int w = 0; w < kNumWindows; ++w) {
      const __m256 in = _mm256_cmp_ps(v, floors[w], _CMP_GE_OQ);
      counts[w] = _mm256_sub_epi32(counts[w], _mm256_castps_si256(in));  // a true lane is -1
      if (with_mass) mass[w] = _mm256_add_ps(mass[w], _mm256_and_ps(in, e));
    }
  };
  int64_t i = 0;
  // Float lanes sum at most 1024 values of <= 1 between flushes to double (rounding ~1e-7 of the sum).
  alignas(32) float mass_lanes[8];
  auto flush = [&]() {
    for (int w = 0; w < kNumWindows; ++w) {
      _mm256_store_ps(mass_lanes, mass[w]);
      for (float lane : mass_lanes) stats.mass[w] += lane;
      stats.count[w] += llmserve::hsum(counts[w]);
      mass[w] = _mm256_setzero_ps();
      counts[w] = _mm256_setzero_si256();
    }
  };
  while (i + 8 <= V) {
    const int64_t stop = std::min(V - V % 8, i + 8 * 128);
    for (; i < stop; i += 8) add(_mm256_loadu_ps(x + i));
    flush();
  }
  if (i < V) {
    alignas(32) float tail[8];  // NaN past the end: in no window (an ordered compare)
    for (int l = 0; l < 8; ++l) tail[l] = i + l < V ? x[i + l] : std::numeric_limits<float>::quiet_NaN();
    add(_mm256_load_ps(tail));
    flush();
  }
  return stats;
}

// The columns >= floor, gathered with a vector compare per 8 (few pass: the windows are chosen so).
void gather_at_least(const float* x, int64_t V, float floor, std::vector<float>& out) {
  out.clear();
  const __m256 f = _mm256_set1_ps(floor);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), f, _CMP_GE_OQ));
    while (bits) {
      const int lane = __builtin_ctz(bits);
      out.push_back(x[i + lane]);
      bits &= bits - 1;
    }
  }
  for (; i < V; ++i)
    if (x[i] >= floor) out.push_back(x[i]);
}

struct Scratch {
  std::vector<float> row;  // the processed logits of a row read from bf16 / f16 or scaled
  std::vector<float> candidates, weights;
  std::vector<double> bin_mass;
  std::vector<std::pair<float, float>> tail;  // (value, weight) of the bin where the sum crosses
};

// weights[i] = exp(values[i] - m), 8 at a time.
void exp_below(const std::vector<float>& values, float m, std::vector<float>& weights) {
  const int64_t n = static_cast<int64_t>(values.size());
  weights.resize(n);
  const __m256 max_v = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(weights.data() + i, llmserve::exp8(_mm256_sub_ps(_mm256_loadu_ps(values.data() + i), max_v)));
  for (; i < n; ++i) weights[i] = std::exp(values[i] - m);
}

// The value at which the descending cumulative weight of the candidates (m: the row's max, one of them) first
// reaches target (the smallest candidate where rounding kept the sum short). Many candidates are binned first by their distance below the
// max (a monotone map: a lower bin holds only larger values), and only the bin where the sum crosses is sorted.
float nucleus_cut(const std::vector<float>& values, const std::vector<float>& weights, float m, double target,
                  Scratch& s) {
  const float lowest = *std::min_element(values.begin(), values.end());
  double cum = 0.0;
  auto& tail = s.tail;
  tail.clear();
  if (values.size() > kSortAtMost && m > lowest && std::isfinite(m - lowest)) {
    const float scale = static_cast<float>(kBins - 1) / (m - lowest);
    auto bin = [&](float v) { return std::min(kBins - 1, static_cast<int>((m - v) * scale)); };
    s.bin_mass.assign(kBins, 0.0);
    for (size_t i = 0; i < values.size(); ++i) s.bin_mass[bin(values[i])] += weights[i];
    int crossing = 0;
    while (crossing < kBins && cum + s.bin_mass[crossing] < target) cum += s.bin_mass[crossing++];
    if (crossing == kBins) return lowest;
    for (size_t i = 0; i < values.size(); ++i)
      if (bin(values[i]) == crossing) tail.emplace_back(values[i], weights[i]);
  } else {
    for (size_t i = 0; i < values.size(); ++i) tail.emplace_back(values[i], weights[i]);
  }
  std::sort(tail.begin(), tail.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [value, weight] : tail) {
    cum += weight;
    if (cum >= target) return value;
  }
  return lowest;
}

float row_threshold(const float* x, int64_t V, int64_t k, float p, float log_min_p, Scratch& scratch) {
  std::vector<float>& candidates = scratch.candidates;
  const bool top_k = k > 0 && k < V, top_p = p < 1.f;
  const float m = row_max(x, V);
  float threshold = m + log_min_p;  // -inf without min-p
  if (!top_k && !top_p) return threshold;
  const WindowStats stats = window_stats(x, V, m, top_p && !top_k);
  float kth = kNegInf;
  int w = 0;
  if (top_k) {
    while (w < kNumWindows - 1 && stats.count[w] < k) ++w;  // the last window holds all V > k columns
    gather_at_least(x, V, m - kWindows[w], candidates);
    // Fewer only where NaN logits hide columns from every compare: leave such a row untruncated.
    if (static_cast<int64_t>(candidates.size()) < k) return threshold;
    std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), std::greater<float>());
    kth = candidates[k - 1];
    threshold = std::max(threshold, kth);
    if (!top_p) return threshold;
    // The top-k set, ties with the k-th included: its own mass renormalizes top-p.
    candidates.erase(std::remove_if(candidates.begin(), candidates.end(), [&](float v) { return v < kth; }),
                     candidates.end());
  } else {
    // The narrowest window whose mass reaches top_p of the row's: the nucleus lies inside it.
    const double target = static_cast<double>(p) * stats.mass[kNumWindows - 1];
    while (w < kNumWindows - 1 && stats.mass[w] < target) ++w;
    gather_at_least(x, V, m - kWindows[w], candidates);
    if (candidates.empty()) return threshold;  // a NaN max: nothing compares
  }
  std::vector<float>& weights = scratch.weights;
  exp_below(candidates, m, weights);
  double z = 0.0;
  if (top_k) {
    for (float e : weights) z += e;
  } else {
    z = stats.mass[kNumWindows - 1];
  }
  return std::max(threshold, nucleus_cut(candidates, weights, m, static_cast<double>(p) * z, scratch));
}

// The row's processed logits: x itself when it is float32 and unscaled, else widened and scaled into row.
template <typename T>
const float* processed_row(const T* x, int64_t V, float inv_t, std::vector<float>& row) {
  if constexpr (std::is_same_v<T, float>) {
    if (inv_t == 1.f) return x;
  }
  row.resize(V);
  const __m256 scale = _mm256_set1_ps(inv_t);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(row.data() + i, _mm256_mul_ps(llmserve::load8(x + i), scale));
  for (; i < V; ++i) row[i] = static_cast<float>(x[i]) * inv_t;
  return row.data();
}

at::Tensor truncation_threshold(const at::Tensor& x, const at::Tensor& inv_temperature, const at::Tensor& top_k,
                                const at::Tensor& top_p, const at::Tensor& log_min_p, int64_t V) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "truncation_threshold: x must be [R, V'] with contiguous rows");
  const int64_t R = x.size(0);
  TORCH_CHECK(V >= 1 && V <= x.size(1), "truncation_threshold: V must lie in [1, x.size(1)]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.numel() == R, "truncation_threshold: top_k must be int64 [R]");
  for (const at::Tensor* t : {&inv_temperature, &top_p, &log_min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == R,
                "truncation_threshold: inv_temperature, top_p and log_min_p must be float32 [R]");
  const at::Tensor t_c = inv_temperature.contiguous(), k_c = top_k.contiguous(), p_c = top_p.contiguous();
  const at::Tensor mp_c = log_min_p.contiguous();
  at::Tensor out = at::empty({R}, x.options().dtype(at::kFloat));
  const float* tp = t_c.data_ptr<float>();
  const int64_t* kp = k_c.data_ptr<int64_t>();
  const float* pp = p_c.data_ptr<float>();
  const float* mpp = mp_c.data_ptr<float>();
  float* op = out.data_ptr<float>();
  llmserve::dispatch_float(x.scalar_type(), "truncation_threshold", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t first, int64_t last) {
      Scratch scratch;
      for (int64_t r = first; r < last; ++r) {
        if ((kp[r] <= 0 || kp[r] >= V) && !(pp[r] < 1.f) && mpp[r] == kNegInf) {
          op[r] = kNegInf;  // nothing to truncate (a greedy row among them)
          continue;
        }
        const float* row = processed_row(xp + r * x.stride(0), V, tp[r], scratch.row);
        op[r] = row_threshold(row, V, kp[r], pp[r], mpp[r], scratch);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("truncation_threshold(Tensor x, Tensor inv_temperature, Tensor top_k, Tensor top_p, Tensor log_min_p, "
        "int V) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("truncation_threshold", &truncation_threshold); }
