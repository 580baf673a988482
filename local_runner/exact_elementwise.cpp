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

template <typename T>
inline v8f load8(const T* p) {
  return load_lanes<v8f>(p);
}

template <typename T>
inline float load1(const T* p) { return static_cast<float>(*p); }
template <typename T>
inline float round1(float x) { return static_cast<float>(static_cast<T>(x)); }

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
        for (int64_t i = 0; i < body; i += kLanes) store_lanes(line + i, load8(line + i) + load8(add + i));
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
        store_lanes(dst + i, load8(weight + i) * round_lanes<T>(load8(line + i) * splat(inv)));
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
          const v8f new_lo = round_lanes<T>(lo * load8(c + i)) + round_lanes<T>(-hi * load8(s + i));
          const v8f new_hi = round_lanes<T>(hi * load8(c + half + i)) + round_lanes<T>(lo * load8(s + half + i));
          store_lanes(head + i, new_lo);
          store_lanes(head + half + i, new_hi);
        }
      }
    }
  });
}

// One block of silu_rows' lanes (8 or 16, the same operations): round(g * sigmoid(g)) * up.
template <typename VF, typename T>
inline void silu_lanes(const T* gate, const T* up, T* dst) {
  const VF g = load_lanes<VF>(gate);
  const auto negative = g < VF{};
  const VF e = exp_lanes(negative ? g : -g);
  const VF one = VF{} + 1.0f;
  const VF sigmoid = (negative ? e : one) / (one + e);
  store_lanes(dst, round_lanes<T>(g * sigmoid) * load_lanes<VF>(up));
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
      if constexpr (!std::is_same_v<T, at::Half>)  // 16 lanes at a time where the vector is that wide
        for (; i + 16 <= body; i += 16) silu_lanes<v16f>(gate + i, up + i, dst + i);
#endif
      for (; i < body; i += kLanes) silu_lanes<v8f>(gate + i, up + i, dst + i);
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
