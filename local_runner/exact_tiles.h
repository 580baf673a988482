// The tile unit exact_attention.cpp's bfloat16 attention runs on: 16 x 16 float32 accumulators C, each
// step C[m][n] += sum_i A[m][2i..2i+1] . B[i][n][0..1] over 16 pairs (A 16 rows of 32 bfloat16, B 16
// pairs' rows of 16 columns x 2). Where the build's CPU has AMX (exact_amx.h) that is TDPBF16PS on the
// tile registers; on AVX-512 BF16 without AMX (AMD Zen 4) the same step is VDPBF16PS row by row, 32
// multiply-adds per instruction (the 8-lane float32 loop does 8): C's rows 16 zmm registers, B's pairs
// loaded once per step, A's pairs broadcast. Either way an output element's sum runs over the same pairs
// in the same order whatever else the tile holds, so a row computed in a tile of any company rounds as
// alone.
//
// The steps are macros because AMX's intrinsics name their tile registers by literal number (GCC
// stringizes it into the instruction): EXACT_TILE_ZERO(unit, 0), EXACT_TILE_LOAD(unit, 4, p, stride),
// EXACT_TILE_DOT(unit, 0, 4, 5, rows), EXACT_TILE_STORE(unit, 0, p, stride). Tiles 0-3 are accumulators,
// 4-7 operands; `rows`: how many of A's rows matter (AMX computes all 16 in the same time, VDPBF16PS
// stops at the next multiple of 4: the rows past `rows` are never read). `stride` in bytes, as AMX takes it.
#pragma once

#include "exact_amx.h"

#if EXACT_AMX
#define EXACT_TILES 1

// The tile registers of the thread: configured for a work share, released after it.
class TileUnit {
 public:
  TileUnit() { exact_amx::configure_tiles(); }
  ~TileUnit() { _tile_release(); }
  TileUnit(const TileUnit&) = delete;
  TileUnit& operator=(const TileUnit&) = delete;
  static bool permitted() { return exact_amx::amx_permitted(); }
};
#define EXACT_TILE_ZERO(unit, t) _tile_zero(t)
#define EXACT_TILE_LOAD(unit, t, p, stride) _tile_loadd(t, p, stride)
#define EXACT_TILE_DOT(unit, c, a, b, rows) _tile_dpbf16ps(c, a, b)
#define EXACT_TILE_STORE(unit, t, p, stride) _tile_stored(t, p, stride)

#elif defined(__AVX512BF16__) && defined(__AVX512BW__)
#define EXACT_TILES 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// TDPBF16PS's step on AVX-512 BF16: the accumulators in memory between steps (a step's 256
// multiply-adds run on registers), an operand "loaded" as where it lies (its rows are read by the step).
class TileUnit {
 public:
  static constexpr int64_t kRows = 16;
  static bool permitted() { return true; }

  void zero(int t) { std::memset(acc_[t], 0, sizeof(acc_[t])); }
  void load(int t, const void* p, int64_t stride) {
    operand_[t - 4] = static_cast<const uint8_t*>(p);
    stride_[t - 4] = stride;
  }
  void store(int t, float* p, int64_t stride) const {
    for (int64_t m = 0; m < kRows; ++m) std::memcpy(reinterpret_cast<uint8_t*>(p) + m * stride, acc_[t][m], 64);
  }
  // C[c] += A[a] x B[b] for A's first `rows` rows, rounded up to a multiple of 4 (the others' sums are
  // left as they were).
  void dot(int c, int a, int b, int64_t rows) {
    const uint8_t* left = operand_[a - 4];
    const uint8_t* right = operand_[b - 4];
    const int64_t left_stride = stride_[a - 4], right_stride = stride_[b - 4];
    float(*out)[16] = acc_[c];
    if (rows == kRows) {
      step<kRows>(out, left, left_stride, right, right_stride);
    } else {
      for (int64_t m0 = 0; m0 < rows; m0 += 4) step<4>(out + m0, left + m0 * left_stride, left_stride, right, right_stride);
    }
  }

 private:
  // M rows of C, each lane n: += the 16 pairs of A's row and B's column n, pair 0 first.
  template <int M>
  static void step(float (*out)[16], const uint8_t* left, int64_t left_stride, const uint8_t* right,
                   int64_t right_stride) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_load_ps(out[m]);
    for (int i = 0; i < 16; ++i) {
      const __m512bh pairs = (__m512bh)_mm512_loadu_si512(right + i * right_stride);
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, left + m * left_stride + 4 * i, sizeof(pair));
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(pair), pairs);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_store_ps(out[m], acc[m]);
  }

  alignas(64) float acc_[4][kRows][16];
  const uint8_t* operand_[4] = {};
  int64_t stride_[4] = {};
};
#define EXACT_TILE_ZERO(unit, t) (unit).zero(t)
#define EXACT_TILE_LOAD(unit, t, p, stride) (unit).load(t, p, stride)
#define EXACT_TILE_DOT(unit, c, a, b, rows) (unit).dot(c, a, b, rows)
#define EXACT_TILE_STORE(unit, t, p, stride) (unit).store(t, p, stride)

#else
#define EXACT_TILES 0
#endif
