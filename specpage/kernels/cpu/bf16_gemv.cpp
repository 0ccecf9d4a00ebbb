// Products of a few bf16 rows by a bf16 weight on a CPU with AVX-512 BF16:
// y [rows, out] = x [rows, in] @ weight [out, in].T, for the one-token and
// verify steps of one stream, where a product is bound by reading the weight
// once. Each output's dot product runs on vdpbf16ps (pairs of bf16 products,
// exact in fp32, accumulated in fp32) along the weight's own rows, sixteen
// outputs at a time, whose lane sums are taken together (vec.h's
// sum_lanes16). Output blocks are split over threads; each block reads its
// sixteen weight rows once from memory for all of x's rows (they stay in
// cache between rows).
//
// Registered as torch.ops.specpage_cpu.bf16_gemv, and
// torch.ops.specpage_cpu.has_bf16_gemv says whether this build has it
// (it needs the instructions at build time: -march=native).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kBlock = 16;  // outputs per block: one sum_lanes16
constexpr int64_t kDepth = 32;  // bf16 inputs per vdpbf16ps
constexpr int64_t kMaxRows = 16;
constexpr int64_t kRowGroup = 8;  // x rows sharing one read of a weight row (registers)
constexpr int64_t kOuts = 2;      // weight rows read side by side

#if defined(__AVX512BF16__)
struct Operands {
  const uint16_t* x;  // bf16 [rows, in]: the group's first row
  const uint16_t* w;  // bf16 [out, in]
  c10::BFloat16* y;   // [rows, out]: the group's first row
  int64_t in, out;
};

// Output blocks [begin, end) for kRows rows of x, the rows a compile-time
// count so that every accumulator stays in a register. The weight is read
// front to back (a block is one run of memory), kOuts rows side by side
// (independent chains), each once for all of x's rows. Each load also asks
// for the line vec.h's kPrefetchAhead bytes further on into L2: left to the
// hardware prefetcher, reading the weight and multiplying take turns instead of
// overlapping: SmolLM2-135M's products (269 MB) took 9.4 ms at 1 row, 14.9
// at 5 and 16.7 at 8; with it 8.5, 8.9 and 9.4 (2 AVX-512 BF16 cores).
template <int64_t kRows>
void blocks(const Operands& p, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const uint16_t* w = p.w + b * kBlock * p.in;
    vfloat lanes[kRows][kBlock];
    for (int64_t o0 = 0; o0 < kBlock; o0 += kOuts) {
      __m512 acc[kOuts][kRows];
      for (int64_t o = 0; o < kOuts; ++o) {
        for (int64_t r = 0; r < kRows; ++r) acc[o][r] = _mm512_setzero_ps();
      }
      for (int64_t i = 0; i < p.in; i += kDepth) {
        __m512bh xv[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          xv[r] = (__m512bh)_mm512_loadu_si512(p.x + r * p.in + i);
        }
        for (int64_t o = 0; o < kOuts; ++o) {
          const uint16_t* wo = w + (o0 + o) * p.in + i;
          _mm_prefetch(reinterpret_cast<const char*>(wo) + kPrefetchAhead, _MM_HINT_T1);
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(wo);
          for (int64_t r = 0; r < kRows; ++r) acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv, xv[r]);
        }
      }
      for (int64_t o = 0; o < kOuts; ++o) {
        for (int64_t r = 0; r < kRows; ++r) lanes[r][o0 + o] = (vfloat)acc[o][r];
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      store(p.y + r * p.out + b * kBlock, sum_lanes16(lanes[r]));
    }
  }
}
#endif

bool has_bf16_gemv() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(has_bf16_gemv(), "bf16_gemv: built without AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous bf16 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.size(1) == x.size(1),
              "weight must be contiguous bf16 [out, in] with x's in");
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "bf16_gemv takes 1 to ", kMaxRows, " rows, got ",
              rows);
  TORCH_CHECK(in % kDepth == 0 && out % kBlock == 0, "bf16_gemv needs in a multiple of ",
              kDepth, " and out a multiple of ", kBlock, ", got ", in, " and ", out);
  at::Tensor y = at::empty({rows, out}, x.options());
#if defined(__AVX512BF16__)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  // Blocks per task: enough that a task reads ~64 KB of weight.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kBlock * in * 2));
  at::parallel_for(0, out / kBlock, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      const Operands p{xs + r0 * in, ws, ys + r0 * out, in, out};
      with_rows(std::min(kRowGroup, rows - r0),
                [&](auto group) { blocks<decltype(group)::value>(p, begin, end); });
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("bf16_gemv(Tensor x, Tensor weight) -> Tensor");
  m.def("has_bf16_gemv() -> bool");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }

TORCH_LIBRARY_IMPL(specpage_cpu, CompositeExplicitAutograd, m) {
  m.impl("has_bf16_gemv", &has_bf16_gemv);
}
