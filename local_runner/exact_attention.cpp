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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

template <typename T>
void attend_rows(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths, T* out,
                 int64_t tokens, int64_t heads, int64_t kv_heads, int64_t capacity, int64_t dim,
                 float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t chunks = dim / kLanes;
  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<v8f> query(group * chunks), acc(group * chunks), key(chunks);
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, kvh = item % kv_heads;
      const int64_t length = lengths[t];
      const int64_t padded = (length + kLanes - 1) / kLanes * kLanes;
      const T* keys = k + (slots[t] * kv_heads + kvh) * capacity * dim;
      const T* values = v + (slots[t] * kv_heads + kvh) * capacity * dim;
      const T* qt = q + (t * heads + kvh * group) * dim;
      for (int64_t i = 0; i < group * chunks; ++i) query[i] = load8(qt + i * kLanes);
      scores.assign(group * padded, -std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < length; ++j) {
        for (int64_t c = 0; c < chunks; ++c) key[c] = load8(keys + j * dim + c * kLanes);
        for (int64_t h = 0; h < group; ++h) {
          v8f lane = query[h * chunks] * key[0];
          for (int64_t c = 1; c < chunks; ++c) lane += query[h * chunks + c] * key[c];
          scores[h * padded + j] = sum8(lane) * scale;
        }
      }
      float total[64];
      for (int64_t h = 0; h < group; ++h) {
        float* row = scores.data() + h * padded;
        float top = row[0];
        for (int64_t j = 1; j < length; ++j) top = row[j] > top ? row[j] : top;
        v8f sums = splat(0.0f);
        for (int64_t j = 0; j < padded; j += kLanes) {
          const v8f e = exp8(load8(row + j) - splat(top));
          std::memcpy(row + j, &e, sizeof(e));
          sums += e;
        }
        total[h] = sum8(sums);
      }
      for (int64_t i = 0; i < group * chunks; ++i) acc[i] = splat(0.0f);
      for (int64_t j = 0; j < length; ++j) {
        for (int64_t c = 0; c < chunks; ++c) key[c] = load8(values + j * dim + c * kLanes);  // v_j
        for (int64_t h = 0; h < group; ++h) {
          const v8f w = splat(scores[h * padded + j]);
          for (int64_t c = 0; c < chunks; ++c) acc[h * chunks + c] += w * key[c];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        const v8f inv = splat(1.0f / total[h]);
        T* dst = out + (t * heads + kvh * group + h) * dim;
        for (int64_t c = 0; c < chunks; ++c) {
          const v8f o = acc[h * chunks + c] * inv;
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
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= 64, "exact_attend: heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "exact_attend", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "exact_attend: float64 is not supported");
    } else {
      attend_rows<scalar_t>(qc.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                            sc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), tokens,
                            heads, kv_heads, capacity, dim, static_cast<float>(scale));
    }
  });
  return out;
}
