// Shared-memory collectives for the ranks of one tensor-parallel group on one host
// (worker_svc/parallel/shm_communicator.py drives them).
//
// Segment (one per group, mapped by every rank):
//
//   [0, 8192)   header: magic, poisoned, futex word + sleeper count, arrive[16], done[16],
//               consumed[16][2 phases] (every counter on its own 64-byte line)
//   then        slot(rank, phase) of slot_bytes each, phase = seq & 1 (double buffering)
//
// A collective with sequence number `seq` (the same on every rank: each rank issues the same
// collectives in the same order) writes this rank's data into slot(rank, seq & 1) and publishes
// arrive[rank] = seq; once a rank has read all it needs of collective seq it publishes
// consumed[rank][seq & 1] = seq. Before writing, a rank waits for every consumed[j][seq & 1] >= seq - 2
// (the last collective that used this phase), so consecutive collectives need no trailing barrier,
// and two may be in flight at once and finish in either order (split-phase: post one, post the
// next, finish either). A third waits for the first: the caller finishes it first.
//
// All-reduce: one-shot (every rank sums every slot) for small messages; above the caller's threshold,
// reduce-scatter (rank r sums chunk r into its own slot, publishes done[r]) + all-gather (every rank
// copies chunk j from slot j). Sums run in float32 in rank order, then round once to the dtype, so
// every rank gets bit-identical results.
//
// Waiting: a bounded spin with pause, then sched_yield, then a futex sleep on the header's word (a
// poster wakes sleepers only when there are some); never past the caller's slice (timeout_ns), and a
// poisoned segment (a rank gave up on the group) ends every wait at once. The caller loops on the
// returned status, checking the group's fault state and its own deadline between slices.
//
// ISA: AVX2 (+F16C) everywhere this library builds; AVX-512 (and AVX512-BF16 for the bf16 rounding)
// when the CPU has it, chosen at run time; `isa` forces one for tests (0 auto, 1 AVX2, 2 AVX-512).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>

namespace {

constexpr uint64_t kMagic = 0x6c6c6d73686d3031ULL;  // "llmshm01"
constexpr int64_t kHeaderBytes = 8192;
constexpr int64_t kMaxRanks = 16;
constexpr int64_t kLine = 64;
constexpr int64_t kPoisonedOff = 64;
constexpr int64_t kWakeOff = 128;
constexpr int64_t kSleepersOff = 192;
constexpr int64_t kArriveOff = 256;
constexpr int64_t kDoneOff = kArriveOff + kMaxRanks * kLine;
constexpr int64_t kConsumedOff = kDoneOff + kMaxRanks * kLine;
static_assert(kConsumedOff + 2 * kMaxRanks * kLine <= kHeaderBytes, "header overflow");

// The ops wait for other processes: let this process's other Python threads (the gRPC server, the
// heartbeat) run meanwhile. Called from Python, these ops hold the GIL; from C++, they may not.
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

enum Status : int64_t { kOk = 0, kTimeoutFirst = 1, kTimeoutSecond = 2, kPoisoned = 3 };

constexpr int kSpins = 2000;             // ~20-60 us of pause before yielding
constexpr int64_t kYieldNs = 200000;     // then yield for up to 200 us before sleeping
constexpr int64_t kFutexMaxNs = 5000000; // sleep at most 5 ms at a time

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Segment {
  char* base;
  int64_t slot_bytes;

  uint64_t* arrive(int64_t r) const { return reinterpret_cast<uint64_t*>(base + kArriveOff + r * kLine); }
  uint64_t* done(int64_t r) const { return reinterpret_cast<uint64_t*>(base + kDoneOff + r * kLine); }
  uint64_t* consumed(int64_t r, int64_t seq) const {
    return reinterpret_cast<uint64_t*>(base + kConsumedOff + (2 * r + (seq & 1)) * kLine);
  }
  uint32_t* poisoned() const { return reinterpret_cast<uint32_t*>(base + kPoisonedOff); }
  uint32_t* wake() const { return reinterpret_cast<uint32_t*>(base + kWakeOff); }
  uint32_t* sleepers() const { return reinterpret_cast<uint32_t*>(base + kSleepersOff); }
  char* slot(int64_t r, int64_t seq) const { return base + kHeaderBytes + (2 * r + (seq & 1)) * slot_bytes; }
};

Segment segment_of(const at::Tensor& seg, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(seg.scalar_type() == at::kByte && seg.is_contiguous() && seg.device().is_cpu(),
              "shm segment: a contiguous uint8 CPU tensor");
  TORCH_CHECK(world >= 1 && world <= kMaxRanks, "shm segment: world size 1..", kMaxRanks);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kLine == 0, "shm segment: slot bytes a positive multiple of 64");
  TORCH_CHECK(seg.numel() >= kHeaderBytes + 2 * world * slot_bytes, "shm segment: too small");
  Segment s{static_cast<char*>(seg.data_ptr()), slot_bytes};
  TORCH_CHECK(*reinterpret_cast<uint64_t*>(s.base) == kMagic, "shm segment: not initialised");
  return s;
}

void wake_all(const Segment& s) {
  __atomic_fetch_add(s.wake(), 1u, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(s.sleepers(), __ATOMIC_SEQ_CST) > 0) {
    syscall(SYS_futex, s.wake(), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void publish(const Segment& s, uint64_t* flag, int64_t seq) {
  __atomic_store_n(flag, static_cast<uint64_t>(seq), __ATOMIC_RELEASE);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  wake_all(s);
}

// Wait until flags(j) >= target for every j in [0, world) (only `only` when >= 0). kOk, kPoisoned,
// or `on_timeout` after timeout_ns.
template <typename Flags>
int64_t wait_for(const Segment& s, Flags flags, int64_t world, int64_t target, int64_t only, int64_t timeout_ns,
                 int64_t on_timeout) {
  auto poisoned = [&]() { return __atomic_load_n(s.poisoned(), __ATOMIC_ACQUIRE) != 0; };
  if (poisoned()) return kPoisoned;  // a failed group stays failed, whatever the flags say
  if (target <= 0) return kOk;  // the first collectives of a segment have nothing before them
  const uint64_t want = static_cast<uint64_t>(target);
  auto ready = [&]() {
    if (only >= 0) return __atomic_load_n(flags(only), __ATOMIC_ACQUIRE) >= want;
    for (int64_t j = 0; j < world; ++j) {
      if (__atomic_load_n(flags(j), __ATOMIC_ACQUIRE) < want) return false;
    }
    return true;
  };
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return kOk;
    _mm_pause();
  }
  const int64_t start = now_ns();
  const int64_t deadline = start + timeout_ns;
  while (now_ns() - start < kYieldNs) {
    if (ready()) return kOk;
    if (poisoned()) return kPoisoned;
    sched_yield();
  }
  while (true) {
    __atomic_fetch_add(s.sleepers(), 1u, __ATOMIC_SEQ_CST);
    const uint32_t seen = __atomic_load_n(s.wake(), __ATOMIC_SEQ_CST);
    if (poisoned()) {
      __atomic_fetch_sub(s.sleepers(), 1u, __ATOMIC_SEQ_CST);
      return kPoisoned;
    }
    if (ready()) {
      __atomic_fetch_sub(s.sleepers(), 1u, __ATOMIC_SEQ_CST);
      return kOk;
    }
    const int64_t left = deadline - now_ns();
    if (left <= 0) {
      __atomic_fetch_sub(s.sleepers(), 1u, __ATOMIC_SEQ_CST);
      return ready() ? kOk : on_timeout;
    }
    const int64_t nap = left < kFutexMaxNs ? left : kFutexMaxNs;
    struct timespec ts{static_cast<time_t>(nap / 1000000000), static_cast<long>(nap % 1000000000)};
    syscall(SYS_futex, s.wake(), FUTEX_WAIT, seen, &ts, nullptr, 0);
    __atomic_fetch_sub(s.sleepers(), 1u, __ATOMIC_SEQ_CST);
  }
}

int64_t wait_arrive(const Segment& s, int64_t world, int64_t target, int64_t only, int64_t timeout_ns,
                    int64_t on_timeout) {
  return wait_for(s, [&](int64_t j) { return s.arrive(j); }, world, target, only, timeout_ns, on_timeout);
}

int64_t wait_done(const Segment& s, int64_t world, int64_t target, int64_t timeout_ns) {
  return wait_for(s, [&](int64_t j) { return s.done(j); }, world, target, -1, timeout_ns, kTimeoutSecond);
}

// ---- sums over the ranks' slots: fp32 accumulation in rank order, one rounding ---------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// Round to nearest even, NaN -> 0x7fc0 (as c10::BFloat16 does).
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <typename T>
void sum_avx2(const T* const* src, int64_t world, T* out, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 acc = load8(src[0] + i);
    for (int64_t r = 1; r < world; ++r) acc = _mm256_add_ps(acc, load8(src[r] + i));
    store8(out + i, acc);
  }
  for (; i < hi; ++i) {
    float acc = static_cast<float>(src[0][i]);
    for (int64_t r = 1; r < world; ++r) acc += static_cast<float>(src[r][i]);
    out[i] = static_cast<T>(acc);
  }
}

#define LLMSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define LLMSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

LLMSERVE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LLMSERVE_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
LLMSERVE_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
LLMSERVE_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
LLMSERVE_AVX512 inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
LLMSERVE_AVX512 inline void store16(c10::BFloat16* p, __m512 v) {  // without AVX512-BF16: by hand
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

template <typename T>
LLMSERVE_AVX512 void sum_avx512(const T* const* src, int64_t world, T* out, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 acc = load16(src[0] + i);
    for (int64_t r = 1; r < world; ++r) acc = _mm512_add_ps(acc, load16(src[r] + i));
    store16(out + i, acc);
  }
  sum_avx2(src, world, out, i, hi);
}

LLMSERVE_AVX512_BF16 void sum_avx512_bf16(const c10::BFloat16* const* src, int64_t world, c10::BFloat16* out,
                                          int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 acc = load16(src[0] + i);
    for (int64_t r = 1; r < world; ++r) acc = _mm512_add_ps(acc, load16(src[r] + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(acc));
  }
  sum_avx2(src, world, out, i, hi);
}

struct Isa {
  bool avx512;
  bool avx512_bf16;
};

Isa isa_for(int64_t requested) {
  static const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  static const bool has512bf16 = has512 && __builtin_cpu_supports("avx512bf16");
  TORCH_CHECK(requested >= 0 && requested <= 2, "shm isa: 0 auto, 1 avx2, 2 avx512");
  TORCH_CHECK(requested != 2 || has512, "shm isa: this CPU has no AVX-512");
  if (requested == 1) return {false, false};
  return {has512, has512bf16};
}

template <typename T>
void sum_range(const T* const* src, int64_t world, T* out, int64_t lo, int64_t hi, Isa isa) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa.avx512_bf16) return sum_avx512_bf16(src, world, out, lo, hi);
  }
  if (isa.avx512) return sum_avx512(src, world, out, lo, hi);
  sum_avx2(src, world, out, lo, hi);
}

// out[lo, hi) = sum of the ranks' slots over [lo, hi); split over the intra-op threads when large.
void reduce_slots(const Segment& s, int64_t world, int64_t seq, at::ScalarType dtype, void* out, int64_t lo,
                  int64_t hi, Isa isa) {
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* src[kMaxRanks];
    for (int64_t r = 0; r < world; ++r) src[r] = reinterpret_cast<const T*>(s.slot(r, seq));
    T* dst = static_cast<T*>(out);
    constexpr int64_t kGrain = 1 << 16;
    if (hi - lo <= kGrain) {
      sum_range(src, world, dst, lo, hi, isa);
    } else {
      at::parallel_for(lo, hi, kGrain, [&](int64_t a, int64_t b) { sum_range(src, world, dst, a, b, isa); });
    }
  };
  switch (dtype) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "shm all-reduce: float32, bfloat16 or float16, got ", dtype);
  }
}

// Rank r's chunk of an n-element two-shot reduce: [lo, hi), cut at multiples of 16 elements.
std::pair<int64_t, int64_t> chunk_of(int64_t n, int64_t world, int64_t r) {
  const int64_t per = ((n + world - 1) / world + 15) / 16 * 16;
  const int64_t lo = std::min(n, r * per);
  return {lo, std::min(n, lo + per)};
}

void check_buffer(const at::Tensor& t, const Segment& s, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), what, ": a contiguous CPU tensor");
  TORCH_CHECK(t.numel() * t.element_size() <= s.slot_bytes, what, ": ", t.numel() * t.element_size(),
              " bytes over the slot's ", s.slot_bytes);
}

// ---- ops -------------------------------------------------------------------------------------

int64_t shm_header_bytes() { return kHeaderBytes; }

void shm_init(const at::Tensor& seg) {
  TORCH_CHECK(seg.scalar_type() == at::kByte && seg.is_contiguous() && seg.numel() >= kHeaderBytes,
              "shm segment: a contiguous uint8 tensor of at least the header");
  char* base = static_cast<char*>(seg.data_ptr());
  std::memset(base, 0, kHeaderBytes);
  __atomic_store_n(reinterpret_cast<uint64_t*>(base), kMagic, __ATOMIC_RELEASE);
}

void shm_poison(const at::Tensor& seg, int64_t world, int64_t slot_bytes) {
  const Segment s = segment_of(seg, world, slot_bytes);
  __atomic_store_n(s.poisoned(), 1u, __ATOMIC_RELEASE);
  wake_all(s);
}

bool shm_poisoned(const at::Tensor& seg, int64_t world, int64_t slot_bytes) {
  return __atomic_load_n(segment_of(seg, world, slot_bytes).poisoned(), __ATOMIC_ACQUIRE) != 0;
}

// Wait until the phase is free (every consumed[j][phase] >= seq - 2), copy `src` into slot(rank, seq), publish
// arrive[rank] = seq. kOk, kPoisoned, or kTimeoutFirst (nothing was written: call again).
int64_t shm_post(const at::Tensor& seg, const at::Tensor& src, int64_t rank, int64_t world, int64_t seq,
                 int64_t slot_bytes, int64_t timeout_ns) {
  const Segment s = segment_of(seg, world, slot_bytes);
  TORCH_CHECK(rank >= 0 && rank < world && seq >= 1, "shm post: bad rank or sequence");
  check_buffer(src, s, "shm post");
  GilRelease unlocked;
  const int64_t status = wait_for(s, [&](int64_t j) { return s.consumed(j, seq); }, world, seq - 2, -1, timeout_ns,
                                  kTimeoutFirst);
  if (status != kOk) return status;
  if (src.numel() > 0) std::memcpy(s.slot(rank, seq), src.data_ptr(), src.numel() * src.element_size());
  publish(s, s.arrive(rank), seq);
  return kOk;
}

// After shm_post of every rank: out = the sum of every rank's `out.numel()` elements. `stage` is
// where a previous call timed out (0 at first). Returns kOk, kPoisoned, or the stage to resume:
// kTimeoutFirst (waiting for the posts) or kTimeoutSecond (two-shot: for the reduced chunks).
int64_t shm_all_reduce_finish(const at::Tensor& seg, at::Tensor out, int64_t rank, int64_t world, int64_t seq,
                              int64_t slot_bytes, int64_t stage, bool two_shot, int64_t timeout_ns, int64_t isa) {
  const Segment s = segment_of(seg, world, slot_bytes);
  check_buffer(out, s, "shm all-reduce");
  const Isa chosen = isa_for(isa);
  const int64_t n = out.numel();
  const int64_t esize = out.element_size();
  GilRelease unlocked;
  if (stage == 0) {
    const int64_t status = wait_arrive(s, world, seq, -1, timeout_ns, kTimeoutFirst);
    if (status != kOk) return status;
    if (!two_shot) {
      reduce_slots(s, world, seq, out.scalar_type(), out.data_ptr(), 0, n, chosen);
      publish(s, s.consumed(rank, seq), seq);
      return kOk;
    }
    const auto [lo, hi] = chunk_of(n, world, rank);
    reduce_slots(s, world, seq, out.scalar_type(), s.slot(rank, seq), lo, hi, chosen);  // into my own slot
    publish(s, s.done(rank), seq);
  }
  const int64_t status = wait_done(s, world, seq, timeout_ns);
  if (status != kOk) return status;
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < world; ++r) {
    const auto [lo, hi] = chunk_of(n, world, r);
    if (hi > lo) std::memcpy(dst + lo * esize, s.slot(r, seq) + lo * esize, (hi - lo) * esize);
  }
  publish(s, s.consumed(rank, seq), seq);
  return kOk;
}

// After shm_post of every rank: out (world * nbytes bytes) = every rank's slot in rank order.
int64_t shm_all_gather_finish(const at::Tensor& seg, at::Tensor out, int64_t rank, int64_t world, int64_t seq,
                              int64_t slot_bytes, int64_t timeout_ns) {
  const Segment s = segment_of(seg, world, slot_bytes);
  TORCH_CHECK(out.is_contiguous() && out.device().is_cpu(), "shm all-gather: a contiguous CPU tensor");
  const int64_t total = out.numel() * out.element_size();
  TORCH_CHECK(total % world == 0 && total / world <= slot_bytes, "shm all-gather: bad output size");
  GilRelease unlocked;
  const int64_t status = wait_arrive(s, world, seq, -1, timeout_ns, kTimeoutFirst);
  if (status != kOk) return status;
  const int64_t part = total / world;
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < world; ++r) std::memcpy(dst + r * part, s.slot(r, seq), part);
  publish(s, s.consumed(rank, seq), seq);
  return kOk;
}

// After shm_post of every rank (src posted the data, the others nothing): out = src's data.
int64_t shm_broadcast_finish(const at::Tensor& seg, at::Tensor out, int64_t rank, int64_t src, int64_t world,
                             int64_t seq, int64_t slot_bytes, int64_t timeout_ns) {
  const Segment s = segment_of(seg, world, slot_bytes);
  check_buffer(out, s, "shm broadcast");
  GilRelease unlocked;
  if (rank != src) {
    const int64_t status = wait_arrive(s, world, seq, src, timeout_ns, kTimeoutFirst);
    if (status != kOk) return status;
    if (out.numel() > 0) std::memcpy(out.data_ptr(), s.slot(src, seq), out.numel() * out.element_size());
  }
  publish(s, s.consumed(rank, seq), seq);
  return kOk;
}

bool shm_has_avx512() { return isa_for(0).avx512; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("shm_header_bytes() -> int", &shm_header_bytes);
  m.def("shm_has_avx512() -> bool", &shm_has_avx512);
  m.def("shm_init(Tensor seg) -> ()", &shm_init);
  m.def("shm_poison(Tensor seg, int world, int slot_bytes) -> ()", &shm_poison);
  m.def("shm_poisoned(Tensor seg, int world, int slot_bytes) -> bool", &shm_poisoned);
  m.def("shm_post(Tensor seg, Tensor src, int rank, int world, int seq, int slot_bytes, int timeout_ns) -> int",
        &shm_post);
  m.def("shm_all_reduce_finish(Tensor seg, Tensor(a!) out, int rank, int world, int seq, int slot_bytes, "
        "int stage, bool two_shot, int timeout_ns, int isa) -> int", &shm_all_reduce_finish);
  m.def("shm_all_gather_finish(Tensor seg, Tensor(a!) out, int rank, int world, int seq, int slot_bytes, "
        "int timeout_ns) -> int",
        &shm_all_gather_finish);
  m.def("shm_broadcast_finish(Tensor seg, Tensor(a!) out, int rank, int src, int world, int seq, int slot_bytes, "
        "int timeout_ns) -> int", &shm_broadcast_finish);
}
