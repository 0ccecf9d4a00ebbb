// Products of a few bf16 rows by group-wise int4 weights on a CPU with
// AVX-512 BF16, for one stream's decode and verify steps: y [rows, out] =
// x [rows, in] @ W.T with W[o, i] = q[o, i] * scale[o, g] + offset[o, g]
// (q in 0..15, g = i / 32: a GGUF Q4_1 block, or Q4_0 with offset = -8 scale).
//
// The weights stay packed, two groups in 32 bytes: byte j holds q[j] of the
// first group in its low nibble and q[j] of the second in its high one, so
// one widening load gives both. A group unpacks into 32 bf16 values
// 128 + q (bf16 holds 128..255 exactly: the bits are 0x4300 | q), which
// vdpbf16ps multiplies by x's group exactly and sums in fp32; then
//   sum_i W[o, i] x[i] = sum_g scale[o, g] * dp_g + (offset[o, g] - 128 scale[o, g]) * xsum_g
// with xsum_g the sum of x's group, and the second term's coefficient kept
// as `bias` [out, groups]. Sixteen outputs' lane sums are taken together
// (vec.h's sum_lanes16), output blocks split over threads, and up to 8 x
// rows share one unpacking of a weight group.
//
// Registered as torch.ops.specpage_cpu.int4_gemv; has_bf16_gemv (in
// bf16_gemv.cpp) says whether this build has the instructions.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kGroup = 32;  // inputs per scale: one vdpbf16ps
constexpr int64_t kBlock = 16;  // outputs per block: one sum_lanes16
constexpr int64_t kMaxRows = 8;
// Rows of scale and bias asked for ahead, as the packed weights are
// (vec.h's kPrefetchAhead).
constexpr int64_t kScaleRowsAhead = 16;

#if defined(__AVX512BF16__)
struct Operands {
  const uint16_t* x;  // bf16 [rows, in]
  const uint8_t* q;   // [out, in / 2], two groups per 32 bytes
  const float* scale;  // [out, groups]
  const float* bias;   // [out, groups]: offset - 128 scale
  const float* xsum;   // [rows, groups]
  c10::BFloat16* y;    // [rows, out]
  int64_t in, groups, out;
};

// Output blocks [begin, end) for kRows rows of x, the rows a compile-time
// count so that every accumulator stays in a register. One run of blocks:
// it already reads three arrays at once (nibbles, scales, offsets), and
// four far-apart runs side by side, as bf16_gemv.cpp reads, measured level
// here (1.05x at 1 row, within the noise).
template <int64_t kRows>
void blocks(const Operands& p, int64_t begin, int64_t end) {
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  const __m512i low_nibble = _mm512_set1_epi16(0x000f);
  for (int64_t b = begin; b < end; ++b) {
    vfloat lanes[kRows][kBlock];
    for (int64_t o = 0; o < kBlock; ++o) {
      const int64_t row = b * kBlock + o;
      const uint8_t* q = p.q + row * (p.in / 2);
      const float* s = p.scale + row * p.groups;
      const float* c = p.bias + row * p.groups;
      for (const float* ahead : {s + kScaleRowsAhead * p.groups, c + kScaleRowsAhead * p.groups}) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + p.groups) - 1, _MM_HINT_T1);
      }
      __m512 even[kRows], odd[kRows];  // two chains of adds per row
      for (int64_t r = 0; r < kRows; ++r) even[r] = odd[r] = _mm512_setzero_ps();
      for (int64_t g = 0; g < p.groups; g += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(q + g * (kGroup / 2)) + kPrefetchAhead,
                     _MM_HINT_T1);
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * (kGroup / 2))));
        const __m512i first = _mm512_or_si512(_mm512_and_si512(bytes, low_nibble), bf16_128);
        const __m512i second = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), bf16_128);
        const __m512 s0 = _mm512_set1_ps(s[g]), s1 = _mm512_set1_ps(s[g + 1]);
        for (int64_t r = 0; r < kRows; ++r) {
          const uint16_t* xg = p.x + r * p.in + g * kGroup;
          even[r] = _mm512_fmadd_ps(
              _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)first,
                               (__m512bh)_mm512_loadu_si512(xg)), s0, even[r]);
          odd[r] = _mm512_fmadd_ps(
              _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)second,
                               (__m512bh)_mm512_loadu_si512(xg + kGroup)), s1, odd[r]);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {  // the bias terms, into the same lanes
        __m512 total = _mm512_add_ps(even[r], odd[r]);
        for (int64_t g = 0; g < p.groups; g += kLanes) {
          const __mmask16 mask = static_cast<__mmask16>(
              (1u << std::min<int64_t>(kLanes, p.groups - g)) - 1u);
          total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, c + g),
                                  _mm512_maskz_loadu_ps(mask, p.xsum + r * p.groups + g), total);
        }
        lanes[r][o] = (vfloat)total;
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      store(p.y + r * p.out + b * kBlock, sum_lanes16(lanes[r]));
    }
  }
}
#endif

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous bf16 [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup;
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "int4_gemv takes 1 to ", kMaxRows, " rows, got ",
              rows);
  TORCH_CHECK(in % (2 * kGroup) == 0, "int4_gemv needs in a multiple of ", 2 * kGroup, ", got ",
              in);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) == in / 2,
              "packed must be contiguous uint8 [out, in / 2]");
  const int64_t out = packed.size(0);
  TORCH_CHECK(out % kBlock == 0, "int4_gemv needs out a multiple of ", kBlock, ", got ", out);
  for (const at::Tensor* t : {&scale, &bias}) {
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->size(0) == out && t->size(1) == groups,
                "scale and bias must be contiguous float32 [out, in / 32]");
  }
  at::Tensor y = at::empty({rows, out}, x.options());
#if defined(__AVX512BF16__)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint8_t* qs = packed.data_ptr<uint8_t>();
  const float* ss = scale.data_ptr<float>();
  const float* bs = bias.data_ptr<float>();
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  std::vector<float> xsum(rows * groups);  // each x row's group sums
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;
      const c10::BFloat16* group = x.data_ptr<c10::BFloat16>() + r * in + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) total += static_cast<float>(group[i]);
      xsum[r * groups + g] = total;
    }
  }
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (kBlock * in / 2));
  const Operands ops{xs, qs, ss, bs, xsum.data(), ys, in, groups, out};
  at::parallel_for(0, out / kBlock, grain, [&](int64_t begin, int64_t end) {
    with_rows(rows, [&](auto count) { blocks<decltype(count)::value>(ops, begin, end); });
  });
#else
  TORCH_CHECK(false, "int4_gemv: built without AVX-512 BF16");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) { m.impl("int4_gemv", &int4_gemv); }
