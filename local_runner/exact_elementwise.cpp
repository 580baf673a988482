// The exact step's elementwise work fused, on the CPU: RMSNorm (with the residual add before it), the
// rotary embedding and SiLU-times-up, each one call per layer instead of five to ten torch operations
// (decoder.py's eager loop; torch.compile fuses the same work on the rounding-dependent path). Built
// with exact_attention.cpp into one library (local_runner/exact_kernel.py).
//
// Row-invariant by construction: every row is computed by the same loop over its own elements (a row's
// reduction in 8 lanes summed in a fixed tree), never split by how many rows share the call. The
// roundings are transformers' (decoder.py's torch operations), operation for operation: statistics in
// float32, each result rounded to the storage type where torch rounds it; only the order of the mean's
// sum and the exponential's polynomial differ.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "exact_lanes.h"

namespace {

constexpr int64_t kLanes = 8;
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline float sum8(v8f x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline v8f load8(const at::BFloat16* p) {
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

// Eight float32 lanes stored in the storage type, rounded to nearest even (torch's conversions).
inline void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }
inline void store8(at::BFloat16* p, v8f x) {
  v8u bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const v8u rounded = (bits + ((bits >> 16) & 1) + 0x7fff) >> 16;
  const v8u quiet = (bits >> 16) | 0x40;  // NaN stays NaN (rounding could carry it into infinity)
  const v8u out = (x != x) ? quiet : rounded;
  const v8u16 narrow = __builtin_convertvector(out, v8u16);
  std::memcpy(p, &narrow, sizeof(narrow));
}
inline void store8(at::Half* p, v8f x) {
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<at::Half>(x[l]);
}

// A float32 value rounded to the storage type and back: torch's result of an operation in that type.
template <typename T>
inline v8f round8(v8f x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[kLanes];
    store8(tmp, x);
    return load8(tmp);
  }
}

#if defined(__AVX512F__)
// 16 lanes of float32 or bfloat16 (SiLU's loop, where the vector's width is most of its time)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

inline v16f load16(const float* p) {
  v16f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline v16f load16(const at::BFloat16* p) {
  v16u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  v16i bits = __builtin_convertvector(raw, v16i) << 16;
  v16f x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline void store16(float* p, v16f x) { std::memcpy(p, &x, sizeof(x)); }
inline void store16(at::BFloat16* p, v16f x) {  // store8's rounding, 16 lanes
  v16u bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const v16u rounded = (bits + ((bits >> 16) & 1) + 0x7fff) >> 16;
  const v16u quiet = (bits >> 16) | 0x40;
  const v16u out = (x != x) ? quiet : rounded;
  const v16u16 narrow = __builtin_convertvector(out, v16u16);
  std::memcpy(p, &narrow, sizeof(narrow));
}
template <typename T>
inline v16f round16(v16f x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[16];
    store16(tmp, x);
    return load16(tmp);
  }
}
#endif

template <typename T>
inline float load1(const T* p) { return static_cast<float>(*p); }
template <typename T>
inline float round1(float x) { return static_cast<float>(static_cast<T>(x)); }

inline v8f exp8(v8f x) { return exp_lanes<v8f, v8i>(x); }

// Rows per thread's share: a step's few decoding rows run inline (a parallel region costs more).
inline int64_t grain(int64_t width) { return width >= 16384 ? 1 : 16384 / width; }

// h = weight * round(x * rsqrt(mean(x^2) + eps)) per row (LlamaRMSNorm); x first becomes
// round(x + delta) in place where delta is given (the residual add before the norm).
template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  const int64_t body = width / kLanes * kLanes;
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* line = x + row * width;
      if (delta != nullptr) {
        const T* add = delta + row * width;
        for (int64_t i = 0; i < body; i += kLanes) store8(line + i, load8(line + i) + load8(add + i));
        for (int64_t i = body; i < width; ++i) line[i] = static_cast<T>(load1(line + i) + load1(add + i));
      }
      v8f lanes = splat(0.0f);
      for (int64_t i = 0; i < body; i += kLanes) {
        const v8f v = load8(line + i);
        lanes += v * v;
      }
      float sum = sum8(lanes);
      for (int64_t i = body; i < width; ++i) sum += load1(line + i) * load1(line + i);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
      T* dst = out + row * width;
      for (int64_t i = 0; i < body; i += kLanes)
        store8(dst + i, load8(weight + i) * round8<T>(load8(line + i) * splat(inv)));
      for (int64_t i = body; i < width; ++i)
        dst[i] = static_cast<T>(load1(weight + i) * round1<T>(load1(line + i) * inv));
    }
  });
}

// In place over the first `heads` heads of each token of x [tokens, >= heads, dim] (a head's dim
// contiguous, tokens at `stride`): x = round(round(x * cos) + round(rotate_half(x) * sin)), with cos
// and sin [tokens, dim] (transformers' apply_rotary_pos_emb in the storage type).
template <typename T>
void rotate_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim, int64_t stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* head = x + t * stride + h * dim;
        for (int64_t i = 0; i < half; i += kLanes) {
          const v8f lo = load8(head + i), hi = load8(head + half + i);
          const v8f new_lo = round8<T>(lo * load8(c + i)) + round8<T>(-hi * load8(s + i));
          const v8f new_hi = round8<T>(hi * load8(c + half + i)) + round8<T>(lo * load8(s + half + i));
          store8(head + i, new_lo);
          store8(head + half + i, new_hi);
        }
      }
    }
  });
}

// out = round(silu(gate)) * up per row of gate_up [rows, 2 * width] (gate first): torch's F.silu then
// the product, each rounded to the storage type. silu(g) = g * sigmoid(g), the sigmoid from
// e = exp(-|g|) (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below.
template <typename T>
void silu_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  const int64_t body = width / kLanes * kLanes;
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = gate_up + row * 2 * width;
      const T* up = gate + width;
      T* dst = out + row * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<T, at::Half>)  // the same operations 16 lanes at a time
        for (; i + 16 <= body; i += 16) {
          const v16f g = load16(gate + i);
          const v16i negative = g < v16f{};
          const v16f e = exp_lanes<v16f, v16i>(negative ? g : -g);
          const v16f one = v16f{} + 1.0f;
          const v16f sigmoid = (negative ? e : one) / (one + e);
          store16(dst + i, round16<T>(g * sigmoid) * load16(up + i));
        }
#endif
      for (; i < body; i += kLanes) {
        const v8f g = load8(gate + i);
        const v8i negative = g < splat(0.0f);
        const v8f e = exp8(negative ? g : -g);
        const v8f sigmoid = (negative ? e : splat(1.0f)) / (splat(1.0f) + e);
        store8(dst + i, round8<T>(g * sigmoid) * load8(up + i));
      }
      for (int64_t i = body; i < width; ++i) {
        const float g = load1(gate + i);
        const float e = std::exp(-std::fabs(g));
        const float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);
        dst[i] = static_cast<T>(round1<T>(g * sigmoid) * load1(up + i));
      }
    }
  });
}

template <typename F>
void by_dtype(const at::Tensor& t, const char* name, F&& run) {
  switch (t.scalar_type()) {
    case at::kFloat: run(std::type_identity<float>{}); break;
    case at::kBFloat16: run(std::type_identity<at::BFloat16>{}); break;
    case at::kHalf: run(std::type_identity<at::Half>{}); break;
    default: TORCH_CHECK(false, name, ": dtype ", t.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

at::Tensor norm(at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x [rows, width], contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight [width] of x's dtype");
  at::Tensor add;
  if (delta.has_value()) {
    add = delta->contiguous();
    TORCH_CHECK(add.sizes() == x.sizes() && add.scalar_type() == x.scalar_type(), name, ": delta as x");
  }
  auto out = at::empty(x.sizes(), x.options());
  by_dtype(x, name, [&](auto type) {
    using T = typename decltype(type)::type;
    norm_rows<T>(x.data_ptr<T>(), add.defined() ? add.data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                 out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// rms_norm(x, weight, eps) -> the norm of x's rows.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  auto xc = x.contiguous();
  return norm(xc, c10::nullopt, weight, eps, "rms_norm");
}

// add_rms_norm_(x, delta, weight, eps): x += delta (in place), then the norm of x's rows.
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor delta, at::Tensor weight, double eps) {
  return norm(x, delta, weight, eps, "add_rms_norm_");
}

// rotary_(x, cos, sin, heads): x [tokens, >= heads, dim] rotated in place over its first `heads` heads.
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && heads <= x.size(1),
              "rotary_: x [tokens, heads, dim], each token's heads contiguous");
  const int64_t tokens = x.size(0), dim = x.size(2);
  TORCH_CHECK(dim % (2 * kLanes) == 0, "rotary_: head_dim a multiple of 16");
  auto c = cos.reshape({tokens, dim}).contiguous(), s = sin.reshape({tokens, dim}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type(), "rotary_: one dtype");
  by_dtype(x, "rotary_", [&](auto type) {
    using T = typename decltype(type)::type;
    rotate_rows<T>(x.data_ptr<T>(), c.data_ptr<T>(), s.data_ptr<T>(), tokens, heads, dim, x.stride(0));
  });
}

// silu_mul(gate_up) -> silu(gate) * up, gate_up [rows, 2 * width] with gate first.
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [rows, 2 * width]");
  auto gu = gate_up.contiguous();
  const int64_t rows = gu.size(0), width = gu.size(1) / 2;
  auto out = at::empty({rows, width}, gu.options());
  by_dtype(gu, "silu_mul", [&](auto type) {
    using T = typename decltype(type)::type;
    silu_rows<T>(gu.data_ptr<T>(), out.data_ptr<T>(), rows, width);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnstore, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnstore, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
}
