// Products of 9 to 64 bf16 rows (a decode step of many sequences) by a
// bf16 weight on a CPU with AVX-512 BF16: y [rows, out] = x [rows, in] @
// weight [out, in].T, compute-bound rather than bound by reading the weight.
//
// The weight is packed once into panels of 48 outputs (the last one 16 or
// 32), each panel [in / 2][width][2]: for a pair of inputs, the pair of
// weights of each of the panel's outputs side by side, so that vdpbf16ps
// multiplies 16 outputs' pairs by one pair of x broadcast to every lane and
// each lane sums one output (no lane sums at the end). A tile of 8 x rows
// by one panel keeps 24 accumulators in registers; each panel is read from
// memory once for all the tiles (it stays in L2), prefetched ahead.
// SmolLM2-135M's 30 layers of products, 2 AVX-512 BF16 cores: 32 rows 18.5 ms
// against oneDNN's 24.9, 16 rows 10.4 / 20.1, 64 rows 33.0 / 40.5 (the table
// in specpage/models/decoder.py).
//
// Registered as torch.ops.specpage_cpu.bf16_panels (pack) and
// bf16_panels_product; has_bf16_gemv (bf16_gemv.cpp) says whether this
// build has the instructions.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kPanel = 48;  // outputs per panel: 3 vectors of 16
constexpr int64_t kTileRows = 8;

int64_t panel_width(int64_t out, int64_t panel) {
  return std::min(kPanel, out - panel * kPanel);
}

at::Tensor bf16_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16,
              "weight must be contiguous bf16 [out, in]");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % kLanes == 0 && in % 2 == 0, "bf16_panels needs out a multiple of 16 and in "
              "a multiple of 2, got ", out, " and ", in);
  at::Tensor packed = at::empty({out * in}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  auto* p = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  for (int64_t panel = 0; panel * kPanel < out; ++panel) {
    const int64_t width = panel_width(out, panel);
    uint16_t* dst = p + panel * kPanel * in;
    for (int64_t pair = 0; pair < in / 2; ++pair) {
      for (int64_t o = 0; o < width; ++o) {
        const uint16_t* src = w + (panel * kPanel + o) * in + 2 * pair;
        dst[(pair * width + o) * 2] = src[0];
        dst[(pair * width + o) * 2 + 1] = src[1];
      }
    }
  }
  return packed;
}

#if defined(__AVX512BF16__)
// y[0..kRows) [o0, o0 + 16 kVectors) from one panel.
template <int64_t kRows, int64_t kVectors>
void tile(const uint16_t* x, int64_t in, const uint16_t* panel, c10::BFloat16* y, int64_t out,
          int64_t o0) {
  __m512 acc[kRows][kVectors];
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t pairs = in / 2;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const uint16_t* w = panel + pair * kVectors * 32;
    __m512bh wv[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * 32) + kPrefetchAhead, _MM_HINT_T1);
      wv[v] = (__m512bh)_mm512_loadu_si512(w + v * 32);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      uint32_t two;
      std::memcpy(&two, x + r * in + 2 * pair, sizeof(two));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(two));
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xv);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kVectors; ++v) {
      store(y + r * out + o0 + v * kLanes, (vfloat)acc[r][v]);
    }
  }
}

template <int64_t kVectors>
void panel_rows(const uint16_t* x, int64_t rows, int64_t in, const uint16_t* panel,
                c10::BFloat16* y, int64_t out, int64_t o0) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    tile<kTileRows, kVectors>(x + r * in, in, panel, y + r * out, out, o0);
  }
  if (r < rows) {
    with_rows(rows - r, [&](auto count) {
      tile<decltype(count)::value, kVectors>(x + r * in, in, panel, y + r * out, out, o0);
    });
  }
}
#endif

at::Tensor bf16_panels_product(const at::Tensor& x, const at::Tensor& packed, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous bf16 [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(0) == out * in && out % kLanes == 0,
              "packed must be bf16_panels of an [", out, ", ", in, "] weight");
  at::Tensor y = at::empty({rows, out}, x.options());
#if defined(__AVX512BF16__)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  const int64_t panels = (out + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = ws + p * kPanel * in;
      switch (panel_width(out, p) / kLanes) {
        case 3: panel_rows<3>(xs, rows, in, panel, ys, out, p * kPanel); break;
        case 2: panel_rows<2>(xs, rows, in, panel, ys, out, p * kPanel); break;
        default: panel_rows<1>(xs, rows, in, panel, ys, out, p * kPanel); break;
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_panels_product: built without AVX-512 BF16");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("bf16_panels(Tensor weight) -> Tensor");
  m.def("bf16_panels_product(Tensor x, Tensor packed, int out) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) {
  m.impl("bf16_panels", &bf16_panels);
  m.impl("bf16_panels_product", &bf16_panels_product);
}
