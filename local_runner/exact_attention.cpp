// Row-invariant attention on the CPU: every query row is computed by the same loops over exactly its own
// keys, so its bits depend on its query and keys only: never on the other rows of the call, the chunk it
// arrives in, or the padding of anyone else (local_runner/exact_kernel.py builds and loads this file).
//
// One call per layer for every token of a step (decoding tokens and prompt chunks alike): token t, of
// job jobs[t], attends to that job's first lengths[t] keys, which lie in the pages its row of `tables`
// names (kv_pages.py: page p holds keys [p * page_tokens, (p + 1) * page_tokens) of a job, each K/V
// head's rows contiguous). The query heads that share a K/V head are computed together (each K and V row
// read once for them). Per row and head:
//   scores[j] = dot(q, k_j) * scale   (8 lanes over head_dim in order, summed in a fixed tree)
//   weights   = exp(scores - max)     (one polynomial for every lane; blocks of 8, the tail padded
//                                      with -inf, whose weight is exactly 0)
//   out       = sum_j weights[j] * v_j / sum_j weights[j]   (j in order; the weights' sum in 8 lanes)
// Arithmetic in float32 whatever the storage type.

// Registered as the operator torch.ops.attnstore.exact_attend (TORCH_LIBRARY, below) with the lightest
// headers that declare it: torch/extension.h (pybind11 and torch's whole C++ API) would take most of the
// build's time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "exact_lanes.h"
#include "exact_tiles.h"

namespace {

constexpr int64_t kLanes = 8;

// Eight consecutive stored values as float32 lanes.
template <typename T>
inline v8f load8(const T* p) {
  return load_lanes<v8f>(p);
}

// The lanes' sums of eight vectors at once, each in sum8's tree: out[r] == sum8(x[r]) bit for bit.
inline v8f sum8x8(const v8f* x) {
  const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  const v8i low = {0, 1, 2, 3, 8, 9, 10, 11}, high = {4, 5, 6, 7, 12, 13, 14, 15};
  v8f pair[4], quad[2];
  for (int r = 0; r < 4; ++r)  // rows 2r, 2r+1: (0+1), (2+3), ..., (6+7)
    pair[r] = __builtin_shuffle(x[2 * r], x[2 * r + 1], even) + __builtin_shuffle(x[2 * r], x[2 * r + 1], odd);
  for (int r = 0; r < 2; ++r)  // ((0+1)+(2+3)) and ((4+5)+(6+7)) of four rows
    quad[r] = __builtin_shuffle(pair[2 * r], pair[2 * r + 1], even) +
              __builtin_shuffle(pair[2 * r], pair[2 * r + 1], odd);
  return __builtin_shuffle(quad[0], quad[1], low) + __builtin_shuffle(quad[0], quad[1], high);
}

// The starts of the runs of up to `most` consecutive tokens of one job (a work item's tokens), then
// `tokens`: run i is [starts[i], starts[i + 1]).
std::vector<int64_t> job_runs(const int64_t* jobs, int64_t tokens, int64_t most) {
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < tokens;) {
    int64_t n = 1;
    while (n < most && t + n < tokens && jobs[t + n] == jobs[t]) ++n;
    starts.push_back(t);
    t += n;
  }
  starts.push_back(tokens);
  return starts;
}

// One job's keys (or values) of one K/V head, key j at row(j): in its page, behind the pages before it.
// Keys are read in blocks of up to 16 that start at a multiple of the block size, and a page holds a
// multiple of 64 keys, so a block's keys are consecutive rows of one page.
template <typename T>
struct PagedRows {
  const T* base;        // the layer's pages, offset to this K/V head's rows
  int64_t page_stride;  // elements from one page to the next
  const int64_t* pages;  // the job's page table
  int64_t page_tokens;
  int64_t dim;
  int shift;  // log2(page_tokens) where it is a power of two (a shift, not a division, per key), else -1
  const T* row(int64_t j) const {
    if (shift >= 0) return base + pages[j >> shift] * page_stride + (j & (page_tokens - 1)) * dim;
    return base + pages[j / page_tokens] * page_stride + (j % page_tokens) * dim;
  }
};

inline int log2_exact(int64_t n) {
  int s = 0;
  while ((int64_t{1} << s) < n) ++s;
  return (int64_t{1} << s) == n ? s : -1;
}

// Consecutive tokens of one job are computed together (a prompt chunk's), so each key and value read
// serves every query row of the tile; a row's arithmetic is the same in a tile of any size.
constexpr int64_t kTileTokens = 4;

// scores[r][j] = dot(query_r, k_j) * scale for the tile's rows, j < length (the tile's longest row):
// eight keys at a time (independent sums, one transposed tree), the rest one by one; either way each
// dot is the same lane-wise sum in sum8's tree.
template <typename T, int C>
void score_keys(const v8f* query, int64_t rows, const PagedRows<T>& keys, int64_t length, float scale, float* scores,
                int64_t stride) {
  constexpr int64_t dim = C * kLanes;
  v8f key[kLanes][C];
  int64_t j = 0;
  for (; j + kLanes <= length; j += kLanes) {
    const T* block = keys.row(j);
    for (int64_t r = 0; r < kLanes; ++r)
      for (int c = 0; c < C; ++c) key[r][c] = load8(block + r * dim + c * kLanes);
    for (int64_t row = 0; row < rows; ++row) {
      const v8f* q = query + row * C;
      v8f lane[kLanes];
      for (int64_t r = 0; r < kLanes; ++r) {
        lane[r] = q[0] * key[r][0];
        for (int c = 1; c < C; ++c) lane[r] += q[c] * key[r][c];
      }
      const v8f s = sum8x8(lane) * splat(scale);
      std::memcpy(scores + row * stride + j, &s, sizeof(s));
    }
  }
  for (; j < length; ++j) {
    const T* one = keys.row(j);
    for (int c = 0; c < C; ++c) key[0][c] = load8(one + c * kLanes);
    for (int64_t row = 0; row < rows; ++row) {
      const v8f* q = query + row * C;
      v8f lane = q[0] * key[0][0];
      for (int c = 1; c < C; ++c) lane += q[c] * key[0][c];
      scores[row * stride + j] = sum8(lane) * scale;
    }
  }
}

// score_keys for one row, its keys read straight from memory (a decoding token: nothing to share them
// with); the same sums as score_keys.
template <typename T, int C>
void score_keys_one(const v8f* query, const PagedRows<T>& keys, int64_t length, float scale, float* scores) {
  constexpr int64_t dim = C * kLanes;
  int64_t j = 0;
  for (; j + kLanes <= length; j += kLanes) {
    v8f lane[kLanes];
    const T* block = keys.row(j);
    for (int64_t r = 0; r < kLanes; ++r) {
      const T* key = block + r * dim;
      lane[r] = query[0] * load8(key);
      for (int c = 1; c < C; ++c) lane[r] += query[c] * load8(key + c * kLanes);
    }
    const v8f s = sum8x8(lane) * splat(scale);
    std::memcpy(scores + j, &s, sizeof(s));
  }
  for (; j < length; ++j) {
    const T* key = keys.row(j);
    v8f lane = query[0] * load8(key);
    for (int c = 1; c < C; ++c) lane += query[c] * load8(key + c * kLanes);
    scores[j] = sum8(lane) * scale;
  }
}

// weigh_values for one row, all its sums in registers; the same sums as weigh_values.
template <typename T, int C>
void weigh_values_one(const float* weights, const PagedRows<T>& values, int64_t length, v8f* out) {
  v8f acc[C];
  for (int c = 0; c < C; ++c) acc[c] = splat(0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const v8f w = splat(weights[j]);
    const T* value = values.row(j);
    for (int c = 0; c < C; ++c) acc[c] += w * load8(value + c * kLanes);
  }
  for (int c = 0; c < C; ++c) out[c] = acc[c];
}

// out_r = sum_j weights_r[j] * v_j (j in order) for the tile's rows, j < length; a row's weights past
// its own keys are 0, and adding 0 * v leaves its sums as they are. Four rows' sums in registers.
template <typename T, int C>
void weigh_values(const float* weights, int64_t rows, int64_t stride, const PagedRows<T>& values, int64_t length,
                  v8f* out) {
  constexpr int kPart = C < 2 ? C : 2;  // head_dim chunks per pass: 4 rows x 2 chunks in registers
  for (int64_t first = 0; first < rows; first += 4) {
    const int64_t n = rows - first < 4 ? rows - first : 4;
    for (int c0 = 0; c0 < C; c0 += kPart) {
      v8f acc[4][kPart];
      for (int64_t r = 0; r < 4; ++r)
        for (int c = 0; c < kPart; ++c) acc[r][c] = splat(0.0f);
      for (int64_t j = 0; j < length; ++j) {
        v8f value[kPart];
        const T* row = values.row(j);
        for (int c = 0; c < kPart; ++c) value[c] = load8(row + (c0 + c) * kLanes);
        for (int64_t r = 0; r < n; ++r) {
          const v8f w = splat(weights[(first + r) * stride + j]);
          for (int c = 0; c < kPart; ++c) acc[r][c] += w * value[c];
        }
      }
      for (int64_t r = 0; r < n; ++r)
        for (int c = 0; c < kPart; ++c) out[(first + r) * C + c0 + c] = acc[r][c];
    }
  }
}

// Where a call's pages are: the layer's K and V pages (each [pages, kv_heads, page_tokens, dim], pages
// `page_stride` elements apart) and each job's page table (a row of `tables`, `table_width` wide).
template <typename T>
struct Pages {
  const T* k;
  const T* v;
  int64_t page_stride;
  int64_t page_tokens;
  const int64_t* tables;
  int64_t table_width;
  PagedRows<T> rows(const T* base, int64_t job, int64_t kvh, int64_t dim) const {
    return {base + kvh * page_tokens * dim, page_stride, tables + job * table_width, page_tokens, dim,
            log2_exact(page_tokens)};
  }
};

template <typename T, int C>
void attend_rows(const T* q, const Pages<T>& pages, const int64_t* jobs, const int64_t* lengths, T* out,
                 int64_t tokens, int64_t heads, int64_t kv_heads, float scale) {
  constexpr int64_t dim = C * kLanes;
  const int64_t group = heads / kv_heads;
  const std::vector<int64_t> tiles = job_runs(jobs, tokens, kTileTokens);
  const int64_t count = static_cast<int64_t>(tiles.size()) - 1;
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<v8f> query, acc;
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      // K/V head-major: neighbouring items (a prompt chunk's tiles) read the same keys, still cached
      const int64_t kvh = item / count, tile = item % count;
      const int64_t t0 = tiles[tile], n = tiles[tile + 1] - t0, rows = n * group;
      int64_t longest = 0;
      for (int64_t i = 0; i < n; ++i) longest = lengths[t0 + i] > longest ? lengths[t0 + i] : longest;
      const int64_t stride = (longest + kLanes - 1) / kLanes * kLanes;
      const PagedRows<T> keys = pages.rows(pages.k, jobs[t0], kvh, dim);
      const PagedRows<T> values = pages.rows(pages.v, jobs[t0], kvh, dim);
      query.resize(rows * C);
      acc.resize(rows * C);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < group; ++h)
          for (int c = 0; c < C; ++c)
            query[(i * group + h) * C + c] = load8(q + ((t0 + i) * heads + kvh * group + h) * dim + c * kLanes);
      scores.assign(rows * stride, -std::numeric_limits<float>::infinity());
      if (n == 1) {  // a decoding token: its query heads one by one, keys straight from memory
        for (int64_t h = 0; h < group; ++h)
          score_keys_one<T, C>(query.data() + h * C, keys, longest, scale, scores.data() + h * stride);
      } else {
        score_keys<T, C>(query.data(), rows, keys, longest, scale, scores.data(), stride);
      }
      std::vector<float> total(rows);
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t length = lengths[t0 + row / group];
        const int64_t padded = (length + kLanes - 1) / kLanes * kLanes;
        float* line = scores.data() + row * stride;
        std::fill(line + length, line + stride, -std::numeric_limits<float>::infinity());
        float top = line[0];
        for (int64_t j = 1; j < length; ++j) top = line[j] > top ? line[j] : top;
        v8f sums = splat(0.0f);
        for (int64_t j = 0; j < padded; j += kLanes) {
          const v8f e = exp_lanes(load8(line + j) - splat(top));
          std::memcpy(line + j, &e, sizeof(e));
          sums += e;
        }
        for (int64_t j = padded; j < stride; ++j) line[j] = 0.0f;
        total[row] = sum8(sums);
      }
      if (n == 1) {
        for (int64_t h = 0; h < group; ++h)
          weigh_values_one<T, C>(scores.data() + h * stride, values, longest, acc.data() + h * C);
      } else {
        weigh_values<T, C>(scores.data(), rows, stride, values, longest, acc.data());
      }
      for (int64_t row = 0; row < rows; ++row) {
        const v8f inv = splat(1.0f / total[row]);
        T* dst = out + ((t0 + row / group) * heads + kvh * group + row % group) * dim;
        for (int c = 0; c < C; ++c) {
          const v8f o = acc[row * C + c] * inv;
          for (int64_t l = 0; l < kLanes; ++l) dst[c * kLanes + l] = static_cast<T>(o[l]);
        }
      }
    }
  });
}

#if EXACT_TILES
// bfloat16 on a CPU with AMX or AVX-512 BF16 (built with -march=native on such a CPU): the same
// contract, on the tile unit (exact_tiles.h: AMX's tiles, or their step in VDPBF16PS instructions). Per
// work item (up to 16 query rows of one slot and K/V head: a decoding token's heads, or a few consecutive
// prompt tokens'):
//   scores^T = K Q^T   16 keys at a time, K's rows loaded as they are stored, Q^T once per item;
//                      each score a dot over head_dim in the tile step's order, 32 dims a step, in order
//   weights  = exp(scores * scale - max)   the 16 rows as 16 lanes, keys in order; past a row's own
//                      keys -inf, whose weight is exactly 0; the sum in key order, one lane per row
//   out      = (weights in bfloat16) V / sum   32 keys at a time from key 0, V's key pairs interleaved
// A row's bits depend on its query, its keys and this fixed split (never on the other rows of the item,
// whose extra keys add exact zeros to its sums), and a decoding token is computed by the same
// instructions as a prompt token: reuse equals recompute. The weights are rounded to bfloat16 for the
// second product (as torch's flash attention does in bfloat16). Against the 8-lane loop and torch's
// flash attention: docs/benchmarks.md, "bfloat16 on AMX".
constexpr int64_t kTileRows = 16;  // query rows per work item: the tile's rows

// out tiles 0..n-1 (n <= 4, 16 dims each) += A (tile 4: the first `rows` rows matter) x the interleaved
// values in `pairs`.
inline void weigh_tiles([[maybe_unused]] TileUnit& unit, const uint16_t* pairs, int n, [[maybe_unused]] int64_t rows) {
  EXACT_TILE_LOAD(unit, 5, pairs, 64);
  EXACT_TILE_DOT(unit, 0, 4, 5, rows);
  if (n > 1) {
    EXACT_TILE_LOAD(unit, 5, pairs + 512, 64);
    EXACT_TILE_DOT(unit, 1, 4, 5, rows);
  }
  if (n > 2) {
    EXACT_TILE_LOAD(unit, 5, pairs + 1024, 64);
    EXACT_TILE_DOT(unit, 2, 4, 5, rows);
  }
  if (n > 3) {
    EXACT_TILE_LOAD(unit, 5, pairs + 1536, 64);
    EXACT_TILE_DOT(unit, 3, 4, 5, rows);
  }
}

inline void store_tile([[maybe_unused]] TileUnit& unit, int t, float* dst) {
  switch (t) {
    case 0: EXACT_TILE_STORE(unit, 0, dst, 64); break;
    case 1: EXACT_TILE_STORE(unit, 1, dst, 64); break;
    case 2: EXACT_TILE_STORE(unit, 2, dst, 64); break;
    default: EXACT_TILE_STORE(unit, 3, dst, 64); break;
  }
}

template <int C>
void attend_rows_tiles(const at::BFloat16* q, const Pages<at::BFloat16>& pages, const int64_t* jobs,
                       const int64_t* lengths, at::BFloat16* out, int64_t tokens, int64_t heads, int64_t kv_heads,
                       float scale) {
  constexpr int64_t dim = C * kLanes, chunks = dim / 32;
  const int64_t group = heads / kv_heads;
  const std::vector<int64_t> items_start = job_runs(jobs, tokens, kTileRows / group);
  const int64_t count = static_cast<int64_t>(items_start.size()) - 1;
  const Pages<uint16_t> bits{reinterpret_cast<const uint16_t*>(pages.k), reinterpret_cast<const uint16_t*>(pages.v),
                             pages.page_stride, pages.page_tokens, pages.tables, pages.table_width};
  const auto* qbits = reinterpret_cast<const uint16_t*>(q);
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] TileUnit unit;
    alignas(64) uint16_t query_t[chunks][16][32];  // Q^T, dims in pairs: [dim / 2][row][2]
    alignas(64) uint16_t tail[16 * dim];           // a last block of fewer than 16 keys, zero-padded
    alignas(64) uint16_t pairs[4][16][32];         // 32 keys' values, key pairs interleaved, 16 dims a tile
    alignas(64) float result[kTileRows * 16];
    alignas(64) uint32_t interleaved[16][kTileRows];  // 32 keys' weights, [key pair][row]
    // the words of two keys' rows (16 each) as pairs row by row; the pairs of one row 16 words apart
    const __m512i pair_rows = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                               22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i row_stride = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    std::vector<float> scores;     // [key][row]
    std::vector<uint16_t> by_key, weights;  // bfloat16 weights [key][row], [row][key]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / count, index = item % count;
      const int64_t t0 = items_start[index], n = items_start[index + 1] - t0, rows = n * group;
      v16i own{};  // each row's key count; padding rows 1 (their results are dropped)
      int64_t longest = 1;
      for (int64_t r = 0; r < kTileRows; ++r) {
        own[r] = r < rows ? static_cast<int32_t>(lengths[t0 + r / group]) : 1;
        longest = own[r] > longest ? own[r] : longest;
      }
      const PagedRows<uint16_t> keys = bits.rows(bits.k, jobs[t0], kvh, dim);
      const PagedRows<uint16_t> values = bits.rows(bits.v, jobs[t0], kvh, dim);
      std::memset(query_t, 0, sizeof(query_t));
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = qbits + ((t0 + r / group) * heads + kvh * group + r % group) * dim;
        for (int64_t d = 0; d < dim; ++d) query_t[d / 32][(d % 32) / 2][2 * r + d % 2] = row[d];
      }
      // scores^T, 16 keys per tile
      const int64_t blocks = (longest + 15) / 16;
      scores.resize(blocks * 16 * kTileRows);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* block = keys.row(b * 16);
        if ((b + 1) * 16 > longest) {
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, block, (longest - b * 16) * dim * sizeof(uint16_t));
          block = tail;
        }
        EXACT_TILE_ZERO(unit, 0);
        for (int64_t c = 0; c < chunks; ++c) {
          EXACT_TILE_LOAD(unit, 4, block + c * 32, dim * sizeof(uint16_t));
          EXACT_TILE_LOAD(unit, 5, query_t[c], 64);
          EXACT_TILE_DOT(unit, 0, 4, 5, 16);
        }
        EXACT_TILE_STORE(unit, 0, scores.data() + b * 16 * kTileRows, 64);
      }
      // the 16 rows' softmax as 16 lanes
      const v16f none = v16f{} - std::numeric_limits<float>::infinity();
      v16f top = none;
      for (int64_t j = 0; j < longest; ++j) {
        v16f s;
        std::memcpy(&s, scores.data() + j * kTileRows, sizeof(s));
        s = (v16i{} + static_cast<int32_t>(j) < own) ? s * scale : none;
        std::memcpy(scores.data() + j * kTileRows, &s, sizeof(s));
        top = s > top ? s : top;
      }
      const int64_t span = (longest + 31) / 32 * 32;
      by_key.resize(span * kTileRows);
      std::fill(by_key.begin() + longest * kTileRows, by_key.end(), 0);
      v16f total{};
      for (int64_t j = 0; j < longest; ++j) {
        v16f s;
        std::memcpy(&s, scores.data() + j * kTileRows, sizeof(s));
        const v16f e = exp_lanes(s - top);
        total += e;
        const v16u16 narrow = bf16_bits(e);
        std::memcpy(by_key.data() + j * kTileRows, &narrow, sizeof(narrow));
      }
      // [key][row] to [row][key], 32 keys at a time: each pair of keys' rows interleaved (a row's two
      // weights side by side, as the product reads them), then each row's 16 pairs gathered. A padding
      // row's weights are left as they are: its results are dropped, and no row reads another's.
      weights.resize(kTileRows * span);
      for (int64_t k0 = 0; k0 < span; k0 += 32) {
        for (int64_t i = 0; i < 16; ++i)
          _mm512_store_si512(interleaved[i],
                             _mm512_permutexvar_epi16(pair_rows, _mm512_loadu_si512(by_key.data() + (k0 + 2 * i) * kTileRows)));
        for (int64_t r = 0; r < rows; ++r)
          _mm512_storeu_si512(weights.data() + r * span + k0,
                              _mm512_i32gather_epi32(row_stride, &interleaved[0][r], sizeof(uint32_t)));
      }
      // out = weights V, 32 keys per step, up to 64 dims (4 tiles) per pass
      const __m512i interleave_low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i interleave_high = _mm512_add_epi16(interleave_low, _mm512_set1_epi16(16));
      for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int tiles = static_cast<int>((dim - d0 < 64 ? dim - d0 : 64) / 16);
        EXACT_TILE_ZERO(unit, 0);
        EXACT_TILE_ZERO(unit, 1);
        EXACT_TILE_ZERO(unit, 2);
        EXACT_TILE_ZERO(unit, 3);
        for (int64_t k0 = 0; k0 < span; k0 += 32) {
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t j = k0 + 2 * i;
            for (int h = 0; h < tiles / 2; ++h) {  // 32 dims of keys j and j + 1, interleaved
              const __m512i a = j < longest ? _mm512_loadu_si512(values.row(j) + d0 + 32 * h) : _mm512_setzero_si512();
              const __m512i b =
                  j + 1 < longest ? _mm512_loadu_si512(values.row(j + 1) + d0 + 32 * h) : _mm512_setzero_si512();
              _mm512_store_si512(pairs[2 * h][i], _mm512_permutex2var_epi16(a, interleave_low, b));
              _mm512_store_si512(pairs[2 * h + 1][i], _mm512_permutex2var_epi16(a, interleave_high, b));
            }
          }
          EXACT_TILE_LOAD(unit, 4, weights.data() + k0, span * sizeof(uint16_t));
          weigh_tiles(unit, &pairs[0][0][0], tiles, rows);
        }
        for (int t = 0; t < tiles; ++t) {
          store_tile(unit, t, result);
          for (int64_t r = 0; r < rows; ++r) {
            const float inv = 1.0f / total[r];
            at::BFloat16* dst = out + ((t0 + r / group) * heads + kvh * group + r % group) * dim + d0 + t * 16;
            for (int64_t m = 0; m < 16; ++m) dst[m] = static_cast<at::BFloat16>(result[r * 16 + m] * inv);
          }
        }
      }
    }
  });
}

// Whether attend_rows_tiles serves this call's shape here.
bool tiles_serve(int64_t dim, int64_t heads, int64_t kv_heads) {
  return dim % 32 == 0 && heads / kv_heads <= kTileRows && TileUnit::permitted();
}
#else
bool tiles_serve(int64_t, int64_t, int64_t) { return false; }
template <int C>
void attend_rows_tiles(const at::BFloat16*, const Pages<at::BFloat16>&, const int64_t*, const int64_t*, at::BFloat16*,
                       int64_t, int64_t, int64_t, float) {}
#endif

}  // namespace

// q [tokens, heads, dim]; k_pages, v_pages [pages, kv_heads, page_tokens, dim] (pages may lie apart: a
// paged pool's layer view); tables [jobs, width] int64, each job's pages in order; jobs, lengths [tokens]
// int64: each token's row of `tables` and its key count.
at::Tensor exact_attend(at::Tensor q, at::Tensor k_pages, at::Tensor v_pages, at::Tensor tables, at::Tensor jobs,
                        at::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(), "exact_attend: shapes");
  TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() && v_pages.scalar_type() == k_pages.scalar_type(),
              "exact_attend: one dtype for q, k and v");
  const int64_t kv_heads = k_pages.size(1), page_tokens = k_pages.size(2), dim = q.size(2);
  for (const auto& p : {k_pages, v_pages})
    TORCH_CHECK(p.stride(3) == 1 && p.stride(2) == dim && p.stride(1) == page_tokens * dim &&
                    p.stride(0) == k_pages.stride(0),
                "exact_attend: each page's rows contiguous, pages one stride apart");
  TORCH_CHECK(page_tokens % 16 == 0, "exact_attend: a page holds a multiple of 16 keys");
  TORCH_CHECK(dim % kLanes == 0 && dim == k_pages.size(3), "exact_attend: head_dim");
  TORCH_CHECK(tables.dim() == 2, "exact_attend: tables [jobs, pages]");
  auto qc = q.contiguous();
  auto tc = tables.to(at::kLong).contiguous();
  auto jc = jobs.to(at::kLong).contiguous();
  auto lc = lengths.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  const int64_t tokens = qc.size(0), heads = qc.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "exact_attend: heads");
  auto by_dim = [&](auto type) {
    using scalar_t = typename decltype(type)::type;
    const Pages<scalar_t> pages{k_pages.data_ptr<scalar_t>(), v_pages.data_ptr<scalar_t>(), k_pages.stride(0),
                                page_tokens, tc.data_ptr<int64_t>(), tc.size(1)};
    auto run = [&](auto chunks) {
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> && decltype(chunks)::value % 4 == 0) {
        if (tiles_serve(dim, heads, kv_heads)) {
          attend_rows_tiles<decltype(chunks)::value>(qc.data_ptr<scalar_t>(), pages, jc.data_ptr<int64_t>(),
                                                     lc.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), tokens, heads,
                                                     kv_heads, static_cast<float>(scale));
          return;
        }
      }
      attend_rows<scalar_t, decltype(chunks)::value>(qc.data_ptr<scalar_t>(), pages, jc.data_ptr<int64_t>(),
                                                     lc.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), tokens, heads,
                                                     kv_heads, static_cast<float>(scale));
    };
    switch (dim) {  // the head sizes of today's models (exact_kernel.HEAD_DIMS); others are refused
      case 16: run(std::integral_constant<int, 2>{}); break;
      case 32: run(std::integral_constant<int, 4>{}); break;
      case 48: run(std::integral_constant<int, 6>{}); break;
      case 64: run(std::integral_constant<int, 8>{}); break;
      case 80: run(std::integral_constant<int, 10>{}); break;
      case 96: run(std::integral_constant<int, 12>{}); break;
      case 128: run(std::integral_constant<int, 16>{}); break;
      case 256: run(std::integral_constant<int, 32>{}); break;
      default: TORCH_CHECK(false, "exact_attend: head_dim ", dim, " is not one the kernel was built for");
    }
  };
  switch (qc.scalar_type()) {
    case at::kFloat: by_dim(std::type_identity<float>{}); break;
    case at::kBFloat16: by_dim(std::type_identity<at::BFloat16>{}); break;
    case at::kHalf: by_dim(std::type_identity<at::Half>{}); break;
    default: TORCH_CHECK(false, "exact_attend: dtype ", qc.scalar_type(), " is not float32, bfloat16 or float16");
  }
  return out;
}

TORCH_LIBRARY(attnstore, m) {
  m.def(
      "exact_attend(Tensor q, Tensor k_pages, Tensor v_pages, Tensor tables, Tensor jobs, Tensor lengths, float scale) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(attnstore, CPU, m) { m.impl("exact_attend", &exact_attend); }
