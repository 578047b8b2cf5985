// Shared by the AMX kernels (bf16_linear_amx.cpp, quant_linear_avx512.cpp): whether the CPU and the OS
// let this process use AMX-BF16, and the one tile configuration they use.
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace llmserve {

#define LLMSERVE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int64_t kAmxTileRows = 16;  // rows of an A / C tile
constexpr int64_t kAmxTileK = 32;     // bf16 inputs per A row / B tile (16 pairs)

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
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512bf16");
    return amx_bf16 && amx_tile && avx512 && request_amx_permission();
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
// _tile_release() after.
LLMSERVE_AMX inline void load_amx_tile_config() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kAmxTileRows;
  }
  _tile_loadconfig(&config);
}

}  // namespace llmserve
