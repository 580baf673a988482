// Row-invariant bfloat16 linear layers on AMX: y = x W^T (+ b), every output element the same sequence
// of tile instructions over K in blocks of 32 from 0, whatever the number of rows in the call. oneDNN's
// products switch kernels by the row count (on AMX, past 32 rows: another rounding), so the exact step
// had to cut a prompt chunk into calls of 32 rows, each streaming every weight again (docs/engine.md,
// "Batch invariance").
// Here a weight block is read once per call for all its rows, and a decoding row and a prompt row are
// computed by the same instructions. Built with exact_attention.cpp into one library; on a CPU without
// AMX the operators exist but say so (amx_linear_ready) and the layers stay oneDNN's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "exact_amx.h"

namespace {

#if EXACT_AMX
using namespace exact_amx;

// W [N, K] as the right operand's tiles: [N / 16][K / 32][16 pairs of k][16 columns x 2], so one
// column block's tiles lie in K order, read as a stream.
at::Tensor pack(const at::Tensor& weight) {
  const int64_t n_out = weight.size(0), k_in = weight.size(1), blocks = k_in / 32;
  auto w = weight.contiguous();
  auto packed = at::empty({n_out / 16, blocks, 16, 32}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  for (int64_t nb = 0; nb < n_out / 16; ++nb)
    for (int64_t kb = 0; kb < blocks; ++kb)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t n = 0; n < 16; ++n)
          for (int64_t e = 0; e < 2; ++e)
            dst[(((nb * blocks + kb) * 16 + i) * 16 + n) * 2 + e] = src[(nb * 16 + n) * k_in + kb * 32 + 2 * i + e];
  return packed;
}

// Rows [first, first + count) of the 16 x 32 result block `acc` (two tiles side by side) to y, plus the
// bias, rounded to bfloat16 once.
void write_rows(const float (*acc)[16 * 16], int64_t count, const float* bias, int64_t column, uint16_t* y,
                int64_t n_out) {
  for (int64_t r = 0; r < count; ++r)
    for (int t = 0; t < 2; ++t) {
      v16f lanes;
      std::memcpy(&lanes, acc[t] + r * 16, sizeof(lanes));
      if (bias != nullptr) {
        v16f b;
        std::memcpy(&b, bias + column + 16 * t, sizeof(b));
        lanes += b;
      }
      const v16u16 narrow = bf16_bits(lanes);
      std::memcpy(y + r * n_out + column + 16 * t, &narrow, sizeof(narrow));
    }
}

// y [rows, N] = x [rows, K] W^T: each thread takes pairs of 16-column blocks (32 outputs) and runs every
// row past them in tiles of 16 (two at a time: 4 accumulators, 2 left, 2 right operands), K in order.
void multiply(const uint16_t* x, int64_t rows, int64_t k_in, const uint16_t* packed, const float* bias,
              uint16_t* y, int64_t n_out) {
  const int64_t blocks = k_in / 32, pairs = n_out / 32, tile_elems = 16 * 32;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float acc[4][16 * 16];
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint16_t* right0 = packed + 2 * pair * blocks * tile_elems;
      const uint16_t* right1 = right0 + blocks * tile_elems;
      for (int64_t m0 = 0; m0 < rows; m0 += 32) {
        const bool two = m0 + 16 < rows;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < blocks; ++kb) {
          _tile_loadd(4, x + m0 * k_in + kb * 32, k_in * 2);
          _tile_loadd(6, right0 + kb * tile_elems, 64);
          _tile_loadd(7, right1 + kb * tile_elems, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x + (m0 + 16) * k_in + kb * 32, k_in * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        const int64_t first = rows - m0 < 16 ? rows - m0 : 16;
        write_rows(acc, first, bias, 32 * pair, y + m0 * n_out, n_out);
        if (two) {
          _tile_stored(2, acc[2], 64);
          _tile_stored(3, acc[3], 64);
          const int64_t second = rows - m0 - 16 < 16 ? rows - m0 - 16 : 16;
          write_rows(acc + 2, second, bias, 32 * pair, y + (m0 + 16) * n_out, n_out);
        }
      }
    }
    _tile_release();
  });
}
#endif

bool ready() {
#if EXACT_AMX
  return amx_permitted();
#else
  return false;
#endif
}

void check_weight(const at::Tensor& weight, const char* name) {
  TORCH_CHECK(ready(), name, ": this CPU (or this build) has no AMX");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, name, ": weight [N, K] bfloat16");
  TORCH_CHECK(weight.size(0) % 32 == 0 && weight.size(1) % 32 == 0, name, ": N and K multiples of 32");
}

// amx_linear_ready() -> whether amx_pack and amx_linear run here.
bool amx_linear_ready() { return ready(); }

// amx_pack(weight [N, K] bfloat16) -> the packed weight amx_linear takes.
at::Tensor amx_pack(at::Tensor weight) {
  check_weight(weight, "amx_pack");
#if EXACT_AMX
  return pack(weight);
#else
  return weight;
#endif
}

// amx_linear(x [..., K], packed, bias [N] float32 or None) -> x W^T + bias, [..., N] bfloat16.
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(ready(), "amx_linear: this CPU (or this build) has no AMX");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32, "amx_linear: a packed weight");
  const int64_t n_out = packed.size(0) * 16, k_in = packed.size(1) * 32;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == k_in, "amx_linear: x [..., K] bfloat16");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n_out &&
                                    bias->is_contiguous()),
              "amx_linear: bias [N] float32");
  auto sizes = x.sizes().vec();
  auto flat = x.reshape({-1, k_in}).contiguous();
  const int64_t rows = flat.size(0);
  sizes.back() = n_out;
  auto y = at::empty({rows, n_out}, flat.options());
#if EXACT_AMX
  // tiles read 16 rows: a row count that is no multiple of 16 runs on a zero-padded copy
  auto padded = rows % 16 == 0 ? flat : at::zeros({rows + 16 - rows % 16, k_in}, flat.options());
  if (rows % 16 != 0) padded.narrow(0, 0, rows).copy_(flat);
  multiply(reinterpret_cast<const uint16_t*>(padded.data_ptr<at::BFloat16>()), rows, k_in,
           reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
           bias.has_value() ? bias->data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
           n_out);
#endif
  return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnstore, m) {
  m.def("amx_linear_ready() -> bool", &amx_linear_ready);
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnstore, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
