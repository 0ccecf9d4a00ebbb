// Every byte of a tensor read once, as fast as the machine reads: the
// benches' floor of a step that must read its weights (bench/common.py
// read_bandwidth) takes the better of this and torch's own sum, which on
// some CPUs reads 15-20% slower than the products do.
//
// Threads split the bytes into contiguous shares; each ORs its share into
// four vector accumulators, a cache line each, so nothing but the loads
// bounds it (one accumulator of eight words, as the compiler vectorized
// it, read 20% slower). The OR of all bytes is returned, so the
// reads cannot be left out. Each pass also asks for its lines 24 and 8 KB
// ahead into L2 with vec.h's prefetch_ahead, as the K-quant products do
// (kquant_gemv.cpp): with
// the hardware's prefetchers alone a thread's loads read 3-5% slower (1.2 GB
// from memory, Intel Xeon: 37.2 against 38.7 GB/s), and a floor must be
// the fastest read there is.
//
// Registered as torch.ops.specpage_cpu.read_through.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

constexpr int64_t kLine = 64;                // bytes
constexpr int64_t kPass = 4 * kLine;         // bytes a pass reads: four independent ORs
constexpr int64_t kGrain = 64 * 1024 / kPass;  // passes a share takes at least (64 KB)

uint64_t read_passes(const uint8_t* p, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (int64_t i = begin * kPass; i < end * kPass; i += kPass) {
    specpage_cpu::prefetch_ahead(p + i, kPass, true);  // (past the end: a hint, never a fault)
    a = _mm512_or_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_or_si512(b, _mm512_loadu_si512(p + i + kLine));
    c = _mm512_or_si512(c, _mm512_loadu_si512(p + i + 2 * kLine));
    d = _mm512_or_si512(d, _mm512_loadu_si512(p + i + 3 * kLine));
  }
  return static_cast<uint64_t>(_mm512_reduce_or_epi64(_mm512_or_si512(_mm512_or_si512(a, b), _mm512_or_si512(c, d))));
#else
  uint64_t acc[kPass / 8] = {};
  for (int64_t i = begin * kPass; i < end * kPass; i += kPass) {
    for (int64_t w = 0; w < kPass / 8; ++w) {
      uint64_t word;
      std::memcpy(&word, p + i + 8 * w, sizeof(word));
      acc[w] |= word;
    }
  }
  uint64_t all = 0;
  for (uint64_t word : acc) all |= word;
  return all;
#endif
}

int64_t read_through(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "read_through: the tensor must be contiguous");
  const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, n / kPass, kGrain, [&](int64_t begin, int64_t end) {
    total.fetch_or(read_passes(bytes, begin, end));
  });
  uint64_t all = total.load();
  uint8_t out = 0;
  for (int64_t b = 0; b < 8; ++b) out |= static_cast<uint8_t>(all >> (8 * b));
  for (int64_t b = n / kPass * kPass; b < n; ++b) out |= bytes[b];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) { m.def("read_through(Tensor t) -> int"); }

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) { m.impl("read_through", &read_through); }
