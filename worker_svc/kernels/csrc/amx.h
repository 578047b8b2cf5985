// Shared by the AMX kernels (bf16_linear_amx.cpp, quant_linear_avx512.cpp): whether the CPU and the OS
// let this process use AMX-BF16, and the one tile configuration they use.
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "avx512.h"

namespace llmserve {

#define LLMSERVE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int64_t kAmxTileRows = 16;  // rows of an A / C tile
constexpr int64_t kAmxTileK = 32;     // bf16 inputs per A row / B tile (16 pairs)
constexpr int64_t kAmxTileFloats = kAmxTileRows * 16;  // one C tile: 16 rows of 16 fp32

// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); without it the
// first tile instruction raises SIGILL. The grant is per process and lasts; asking again is harmless.
inline bool request_amx_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// AMX-TILE + AMX-BF16 (CPUID 7.0 EDX bits 24, 22), AVX512-BF16 for the epilogues, and the OS's grant.
inline bool cpu_has_amx_bf16() {
  static const bool has = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    const bool avx512_bf16 = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
    return amx_bf16 && amx_tile && avx512_bf16 && request_amx_permission();
  }();
  return has;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-7 all 16 rows of 64 bytes. Tile state is per thread: load it in each thread before its tiles,
// _tile_release() after. The configuration is one static object, not a local: GCC dropped the column-width
// stores of a local one as dead (LDTILECFG's read of it unseen) in one caller, and a configuration with rows
// but no columns faults (#GP).
inline const AmxTileConfig& all_tiles_16x64() {
  static const AmxTileConfig config = [] {
    AmxTileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = kAmxTileRows;
    }
    return c;
  }();
  return config;
}

LLMSERVE_AMX inline void load_amx_tile_config() { _tile_loadconfig(&all_tiles_16x64()); }

// The tile step every AMX kernel here takes: C tiles tmm0-3 (row block i, output group j at tmm i * 2 + j)
// for MB row blocks (1..2) x NB output groups (1..2), A in tmm4-5, B in tmm6-7.
template <int MB, int NB>
LLMSERVE_AMX inline void amx_zero() {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MB == 2) _tile_zero(2);
  if constexpr (MB == 2 && NB == 2) _tile_zero(3);
}

// C += A . B for one 32-input tile: a0 / a1 the row blocks' A rows (a_stride bytes apart), b0 / b1 the output
// groups' B tiles (16 rows of 64 bytes).
template <int MB, int NB>
LLMSERVE_AMX inline void amx_step(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1) {
  _tile_loadd(4, a0, a_stride);
  if constexpr (MB == 2) _tile_loadd(5, a1, a_stride);
  _tile_loadd(6, b0, 64);
  if constexpr (NB == 2) _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
  if constexpr (MB == 2) _tile_dpbf16ps(2, 5, 6);
  if constexpr (MB == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
}

// The C tiles to c: tile i * 2 + j at c + (i * 2 + j) * kAmxTileFloats.
template <int MB, int NB>
LLMSERVE_AMX inline void amx_store(float* c) {
  _tile_stored(0, c, 64);
  if constexpr (NB == 2) _tile_stored(1, c + kAmxTileFloats, 64);
  if constexpr (MB == 2) _tile_stored(2, c + 2 * kAmxTileFloats, 64);
  if constexpr (MB == 2 && NB == 2) _tile_stored(3, c + 3 * kAmxTileFloats, 64);
}

}  // namespace llmserve
