// The AMX helpers shared by exact_attention.cpp and exact_linear.cpp: compiled where the build's CPU has
// AMX with bfloat16 (-march=native on such a CPU defines __AMX_TILE__ and __AMX_BF16__; elsewhere this
// header declares nothing and EXACT_AMX is 0).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define EXACT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "exact_lanes.h"

namespace exact_amx {

constexpr int64_t kTileRows = 16;  // AMX: 16 rows of 64 bytes per tile

// Linux lends the tile registers to a process that asks (oneDNN asks too); once per process.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

// Every tile (all 8) 16 rows of 64 bytes. The configuration is per thread, and oneDNN's kernels load
// their own on the same threads: loaded at each work share.
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

}  // namespace exact_amx
#else
#define EXACT_AMX 0
#endif
