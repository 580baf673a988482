// What exact_attention.cpp, exact_elementwise.cpp and exact_linear.cpp compute alike, lane by lane, on
// GCC's vector types of any width (8 or 16 float32 lanes): the same operations for every lane, so a
// lane's value never depends on its neighbours. One template per operation whatever the width, so the
// 8-lane and 16-lane loops of a kernel round alike by construction.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// W float32 lanes, and the integer and bfloat16-bit vectors of the same lane count.
template <int W>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
  typedef uint32_t U __attribute__((vector_size(4 * W)));
  typedef uint16_t U16 __attribute__((vector_size(2 * W)));
};
typedef Lanes<8>::F v8f;
typedef Lanes<8>::I v8i;
typedef Lanes<16>::F v16f;
typedef Lanes<16>::I v16i;
typedef Lanes<16>::U16 v16u16;

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// Eight lanes' sum in one fixed tree.
inline float sum8(v8f x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

template <typename VF>
using LanesOf = Lanes<static_cast<int>(sizeof(VF) / sizeof(float))>;

// Consecutive stored values as float32 lanes (bfloat16 is float32's upper half).
template <typename VF>
inline VF load_lanes(const float* p) {
  VF x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename VF>
inline VF load_lanes(const at::BFloat16* p) {
  typename LanesOf<VF>::U16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const typename LanesOf<VF>::I bits = __builtin_convertvector(raw, typename LanesOf<VF>::I) << 16;
  VF x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
template <typename VF>
inline VF load_lanes(const at::Half* p) {
  VF x;
  for (size_t l = 0; l < sizeof(VF) / sizeof(float); ++l) x[l] = static_cast<float>(p[l]);
  return x;
}

// The lanes' bfloat16 bits, rounded to nearest even as torch converts (NaN stays NaN: rounding could
// carry it into infinity).
template <typename VF>
inline typename LanesOf<VF>::U16 bf16_bits(VF x) {
  using U = typename LanesOf<VF>::U;
  U bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const U rounded = (bits + ((bits >> 16) & 1) + 0x7fff) >> 16;
  const U quiet = (bits >> 16) | 0x40;
  const U out = (x != x) ? quiet : rounded;
  return __builtin_convertvector(out, typename LanesOf<VF>::U16);
}

// The lanes stored in the storage type, rounded to nearest even (torch's conversions).
template <typename VF>
inline void store_lanes(float* p, VF x) {
  std::memcpy(p, &x, sizeof(x));
}
template <typename VF>
inline void store_lanes(at::BFloat16* p, VF x) {
  const auto narrow = bf16_bits(x);
  std::memcpy(p, &narrow, sizeof(narrow));
}
template <typename VF>
inline void store_lanes(at::Half* p, VF x) {
  for (size_t l = 0; l < sizeof(VF) / sizeof(float); ++l) p[l] = static_cast<at::Half>(x[l]);
}

// A float32 value rounded to the storage type and back: torch's result of an operation in that type.
template <typename T, typename VF>
inline VF round_lanes(VF x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[sizeof(VF) / sizeof(float)];
    store_lanes(tmp, x);
    return load_lanes<VF>(tmp);
  }
}

// exp(x) for x <= 0 (scores minus their max; -|g| for a sigmoid), exactly 0 below -87 (and for -inf):
// Cody-Waite reduction and Cephes' degree-6 polynomial (rel. error ~2e-7).
template <typename VF>
inline VF exp_lanes(VF x) {
  using VI = typename LanesOf<VF>::I;
  const VF zero = VF{};
  auto c = [&](float value) { return zero + value; };
  const VI tiny = x < c(-87.0f);
  const VF v = tiny ? c(-87.0f) : x;
  const VF magic = c(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const VF n = (v * c(1.44269504088896341f) + magic) - magic;
  VF r = v - n * c(0.693359375f);
  r = r - n * c(-2.12194440e-4f);
  VF p = c(1.9875691500e-4f);
  p = p * r + c(1.3981999507e-3f);
  p = p * r + c(8.3334519073e-3f);
  p = p * r + c(4.1665795894e-2f);
  p = p * r + c(1.6666665459e-1f);
  p = p * r + c(5.0000001201e-1f);
  p = p * (r * r) + r + c(1.0f);
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? zero : p * scale;
}
