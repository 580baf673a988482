// Row-invariant attention on the CPU: every query row is computed by the same loops over exactly its own
// keys, so its bits depend on its query and keys only: never on the other rows of the call, the chunk it
// arrives in, or the padding of anyone else (local_runner/exact_kernel.py builds and loads this file).
//
// One call per layer for every token of a step (decoding tokens and prompt chunks alike): token t, in
// slot slots[t], attends to that slot's first lengths[t] keys. The query heads that share a K/V head are
// computed together (each K and V row read once for them). Per row and head:
//   scores[j] = dot(q, k_j) * scale   (8 lanes over head_dim in order, summed in a fixed tree)
//   weights   = exp(scores - max)     (one polynomial for every lane; blocks of 8, the tail padded
//                                      with -inf, whose weight is exactly 0)
//   out       = sum_j weights[j] * v_j / sum_j weights[j]   (j in order; the weights' sum in 8 lanes)
// Arithmetic in float32 whatever the storage type.

// Registered as the operator torch.ops.attnstore.exact_attend (TORCH_LIBRARY, below) with the lightest
// headers that declare it: torch/extension.h (pybind11 and torch's whole C++ API) alone took 25 of a
// 38 s build on 2 cores.
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

namespace {

constexpr int64_t kLanes = 8;
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

// Eight consecutive stored values as float32 lanes.
inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline v8f load8(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  v8u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  v8i bits = __builtin_convertvector(raw, v8i) << 16;
  v8f x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline v8f load8(const at::Half* p) {
  v8f x;
  for (int l = 0; l < kLanes; ++l) x[l] = static_cast<float>(p[l]);
  return x;
}

// The lanes' sum in one fixed tree.
inline float sum8(v8f x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// exp(x) for x <= 0 (scores minus their max), exactly 0 below -87 (and for -inf): Cody-Waite reduction
// and Cephes' degree-6 polynomial (rel. error ~2e-7). The same operations for every lane, so an
// element's value never depends on its neighbours.
inline v8f exp8(v8f x) {
  const v8i tiny = x < splat(-87.0f);
  const v8f v = tiny ? splat(-87.0f) : x;
  const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const v8f n = (v * splat(1.44269504088896341f) + magic) - magic;
  v8f r = v - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? splat(0.0f) : p * scale;
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

// Consecutive tokens of one slot are computed together (a prompt chunk's), so each key and value read
// serves every query row of the tile; a row's arithmetic is the same in a tile of any size.
constexpr int64_t kTileTokens = 4;

// scores[r][j] = dot(query_r, k_j) * scale for the tile's rows, j < length (the tile's longest row):
// eight keys at a time (independent sums, one transposed tree), the rest one by one; either way each
// dot is the same lane-wise sum in sum8's tree.
template <typename T, int C>
void score_keys(const v8f* query, int64_t rows, const T* keys, int64_t length, float scale, float* scores,
                int64_t stride) {
  constexpr int64_t dim = C * kLanes;
  v8f key[kLanes][C];
  int64_t j = 0;
  for (; j + kLanes <= length; j += kLanes) {
    for (int64_t r = 0; r < kLanes; ++r)
      for (int c = 0; c < C; ++c) key[r][c] = load8(keys + (j + r) * dim + c * kLanes);
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
    for (int c = 0; c < C; ++c) key[0][c] = load8(keys + j * dim + c * kLanes);
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
void score_keys_one(const v8f* query, const T* keys, int64_t length, float scale, float* scores) {
  constexpr int64_t dim = C * kLanes;
  int64_t j = 0;
  for (; j + kLanes <= length; j += kLanes) {
    v8f lane[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) {
      const T* key = keys + (j + r) * dim;
      lane[r] = query[0] * load8(key);
      for (int c = 1; c < C; ++c) lane[r] += query[c] * load8(key + c * kLanes);
    }
    const v8f s = sum8x8(lane) * splat(scale);
    std::memcpy(scores + j, &s, sizeof(s));
  }
  for (; j < length; ++j) {
    const T* key = keys + j * dim;
    v8f lane = query[0] * load8(key);
    for (int c = 1; c < C; ++c) lane += query[c] * load8(key + c * kLanes);
    scores[j] = sum8(lane) * scale;
  }
}

// weigh_values for one row, all its sums in registers; the same sums as weigh_values.
template <typename T, int C>
void weigh_values_one(const float* weights, const T* values, int64_t length, v8f* out) {
  constexpr int64_t dim = C * kLanes;
  v8f acc[C];
  for (int c = 0; c < C; ++c) acc[c] = splat(0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const v8f w = splat(weights[j]);
    for (int c = 0; c < C; ++c) acc[c] += w * load8(values + j * dim + c * kLanes);
  }
  for (int c = 0; c < C; ++c) out[c] = acc[c];
}

// out_r = sum_j weights_r[j] * v_j (j in order) for the tile's rows, j < length; a row's weights past
// its own keys are 0, and adding 0 * v leaves its sums as they are. Four rows' sums in registers.
template <typename T, int C>
void weigh_values(const float* weights, int64_t rows, int64_t stride, const T* values, int64_t length,
                  v8f* out) {
  constexpr int64_t dim = C * kLanes;
  constexpr int kPart = C < 2 ? C : 2;  // head_dim chunks per pass: 4 rows x 2 chunks in registers
  for (int64_t first = 0; first < rows; first += 4) {
    const int64_t n = rows - first < 4 ? rows - first : 4;
    for (int c0 = 0; c0 < C; c0 += kPart) {
      v8f acc[4][kPart];
      for (int64_t r = 0; r < 4; ++r)
        for (int c = 0; c < kPart; ++c) acc[r][c] = splat(0.0f);
      for (int64_t j = 0; j < length; ++j) {
        v8f value[kPart];
        for (int c = 0; c < kPart; ++c) value[c] = load8(values + j * dim + (c0 + c) * kLanes);
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

template <typename T, int C>
void attend_rows(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths, T* out,
                 int64_t tokens, int64_t heads, int64_t kv_heads, int64_t capacity, float scale) {
  constexpr int64_t dim = C * kLanes;
  const int64_t group = heads / kv_heads;
  // tiles: runs of up to kTileTokens consecutive tokens of one slot
  std::vector<int64_t> tiles;
  for (int64_t t = 0; t < tokens;) {
    int64_t n = 1;
    while (n < kTileTokens && t + n < tokens && slots[t + n] == slots[t]) ++n;
    tiles.push_back(t);
    t += n;
  }
  tiles.push_back(tokens);
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
      const T* keys = k + (slots[t0] * kv_heads + kvh) * capacity * dim;
      const T* values = v + (slots[t0] * kv_heads + kvh) * capacity * dim;
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
          const v8f e = exp8(load8(line + j) - splat(top));
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

}  // namespace

// q [tokens, heads, dim]; k_pool, v_pool [slots, kv_heads, capacity, dim]; slots, lengths [tokens] int64.
at::Tensor exact_attend(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots, at::Tensor lengths,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "exact_attend: shapes");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type(),
              "exact_attend: one dtype for q, k and v");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "exact_attend: contiguous pools");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) == k_pool.size(3), "exact_attend: head_dim");
  auto qc = q.contiguous();
  auto sc = slots.to(at::kLong).contiguous();
  auto lc = lengths.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  const int64_t tokens = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t kv_heads = k_pool.size(1), capacity = k_pool.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "exact_attend: heads");
  auto by_dim = [&](auto type) {
    using scalar_t = typename decltype(type)::type;
    auto run = [&](auto chunks) {
      attend_rows<scalar_t, decltype(chunks)::value>(
          qc.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
          sc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), tokens, heads, kv_heads,
          capacity, static_cast<float>(scale));
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
  m.def("exact_attend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnstore, CPU, m) { m.impl("exact_attend", &exact_attend); }
