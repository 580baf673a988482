// What exact_attention.cpp and exact_elementwise.cpp compute alike, lane by lane, on GCC's vector types
// of any width (8 or 16 float32 lanes): the same operations for every lane, so a lane's value never
// depends on its neighbours.
#pragma once

#include <cstring>

// exp(x) for x <= 0 (scores minus their max; -|g| for a sigmoid), exactly 0 below -87 (and for -inf):
// Cody-Waite reduction and Cephes' degree-6 polynomial (rel. error ~2e-7).
template <typename VF, typename VI>
inline VF exp_lanes(VF x) {
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
