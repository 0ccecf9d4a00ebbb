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
constexpr int64_t kStreamAhead = 4096;  // bytes; 1 KB was slower from 4 rows, 8 KB alike

#if defined(__AVX512BF16__)
struct Operands {
  const uint16_t* x;  // bf16 [rows, in]: the group's first row
  const uint16_t* w;  // bf16 [out, in]
  c10::BFloat16* y;   // [rows, out]: the group's first row
  int64_t in, out;
};

// kStreams blocks of 16 outputs, `first` and every `stride` blocks after it,
// for kRows rows of x (compile-time counts, so every accumulator stays in a
// register): each weight row is read front to back, once for all of x's
// rows, the kStreams blocks' rows side by side. Reading from several places
// far apart at once is what lets a core keep enough of memory's reads in
// flight: on SmolLM2-135M's products (2 AVX-512 BF16 cores, 1 row) one
// stream read 0.98x as fast as torch's sum over the same bytes, four
// streams 1.22-1.26x, and the model's products took 14% less time. Each
// load also asks for the line kStreamAhead bytes on into L2: left to the
// hardware prefetcher, reading and multiplying take turns.
template <int64_t kRows, int64_t kStreams>
void run(const Operands& p, int64_t first, int64_t stride) {
  vfloat lanes[kStreams][kRows][kBlock];
  for (int64_t o = 0; o < kBlock; ++o) {
    const uint16_t* w[kStreams];
    __m512 acc[kStreams][kRows];
    for (int64_t s = 0; s < kStreams; ++s) {
      w[s] = p.w + ((first + s * stride) * kBlock + o) * p.in;
      for (int64_t r = 0; r < kRows; ++r) acc[s][r] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < p.in; i += kDepth) {
      __m512bh xv[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        xv[r] = (__m512bh)_mm512_loadu_si512(p.x + r * p.in + i);
      }
      for (int64_t s = 0; s < kStreams; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(w[s] + i) + kStreamAhead, _MM_HINT_T1);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[s] + i);
        for (int64_t r = 0; r < kRows; ++r) acc[s][r] = _mm512_dpbf16_ps(acc[s][r], wv, xv[r]);
      }
    }
    for (int64_t s = 0; s < kStreams; ++s) {
      for (int64_t r = 0; r < kRows; ++r) lanes[s][r][o] = (vfloat)acc[s][r];
    }
  }
  for (int64_t s = 0; s < kStreams; ++s) {
    for (int64_t r = 0; r < kRows; ++r) {
      store(p.y + r * p.out + (first + s * stride) * kBlock, sum_lanes16(lanes[s][r]));
    }
  }
}

// Output blocks [begin, end): kStreams runs of them, far apart in the
// weight, read side by side (4 for up to 4 rows of x, 2 for more, as the
// registers allow), then any blocks left one at a time.
template <int64_t kRows>
void blocks(const Operands& p, int64_t begin, int64_t end) {
  constexpr int64_t kStreams = kRows <= 4 ? 4 : 2;
  const int64_t per = (end - begin) / kStreams;
  for (int64_t j = 0; j < per; ++j) run<kRows, kStreams>(p, begin + j, per);
  for (int64_t b = begin + per * kStreams; b < end; ++b) run<kRows, 1>(p, b, 0);
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
