// What the native CPU kernels share: vectors of 16 floats as GCC vector
// types, which the compiler lowers to whatever the CPU has (the kernels are
// built with -march=native): one AVX-512 register, two AVX2 registers, or
// NEON quads; loads that widen bf16/fp16 to fp32, stores that round back as
// torch does, and the few vector functions the kernels need.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace specpage_cpu {

constexpr int64_t kLanes = 16;

// Bytes ahead in a weight stream that the int4 and panel product kernels
// ask for into L2 with each load: left to the hardware prefetcher, reading a
// weight and multiplying take turns instead of overlapping. 4-16 KB measured
// alike (SmolLM2-135M q4 decode steps on int8x products: 4 KB 0.99x and 16
// KB 1.01x the step at 8 KB; prefetcht2 instead of prefetcht1 1.01x;
// non-temporal, the product alone 2x slower). (bf16_gemv.cpp reads several
// streams at once, with its own distance.)
constexpr int64_t kPrefetchAhead = 8192;
// A stream read from memory is asked for twice, this far ahead and then
// kPrefetchAhead (the K-quant products' first pass, kquant_gemv.cpp, and the
// benches' floor, read_through.cpp, which must read as fast as they do).
constexpr int64_t kPrefetchFar = 3 * kPrefetchAhead;

// Asks for the cache lines of p's next `bytes` into L2 kPrefetchAhead bytes
// ahead and, on a first pass (read from memory), kPrefetchFar ahead too.
// Always inlined, as every helper of prefetches alone (int4_gemv.cpp's prefetch_tile).
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* p, int64_t bytes,
                                                          bool first_pass) {
  for (int64_t line = 0; line < bytes; line += 64) {
    if (first_pass) __builtin_prefetch(p + kPrefetchFar + line, 0, 2);
    __builtin_prefetch(p + kPrefetchAhead + line, 0, 2);
  }
}
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vhalfword __attribute__((vector_size(kLanes * 2)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vfloat load(const c10::BFloat16* p) {
  vhalfword h;
  std::memcpy(&h, p, sizeof(h));
  const vuint wide = __builtin_convertvector(h, vuint) << 16;  // bf16 is fp32's top half
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline vfloat load(const c10::Half* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
}

inline float sum_lanes(vfloat v) {
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

inline vfloat splat(float x) { return vfloat{} + x; }

// Lane j of the result: the sum of v[j]'s sixteen lanes. Each level adds the
// two halves of every source's partial sums, packing two sources per vector
// where there was one: 16 vectors of 16 partials, 8 of 2 x 8, 4 of 4 x 4,
// 2 of 8 x 2, 1 of 16 x 1.
inline vfloat sum_lanes16(const vfloat* v) {
  vfloat a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) {
    const vfloat x = v[2 * j], y = v[2 * j + 1];
    a[j] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int j = 0; j < 4; ++j) {
    const vfloat x = a[2 * j], y = a[2 * j + 1];
    b[j] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int j = 0; j < 2; ++j) {
    const vfloat x = b[2 * j], y = b[2 * j + 1];
    c[j] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
         + __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
       + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// fp32 to bf16, rounding to nearest even as c10::BFloat16 does (NaN stays NaN).
inline void store(c10::BFloat16* p, vfloat v) {
  vuint bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vuint rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  const vuint narrow = v != v ? vuint{} + 0x7fc0u : rounded;
  const vhalfword h = __builtin_convertvector(narrow, vhalfword);
  std::memcpy(p, &h, sizeof(h));
}

inline void store(c10::Half* p, vfloat v) {
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// v rounded to scalar_t and widened again: where torch's op for scalar_t
// rounds its result, the fused kernel rounds too.
template <typename scalar_t>
inline vfloat rounded(vfloat v) {
  scalar_t tmp[kLanes];
  store(tmp, v);
  return load(tmp);
}

template <>
inline vfloat rounded<float>(vfloat v) { return v; }

// exp(x) as Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two
// parts, so r keeps its precision for large |x|), exp(r) by a degree-5
// polynomial (about 1 ulp), times 2^n. x is clamped to fp32's normal range:
// below -87.3 gives about 2^-126, above 88.3 about 2^127, not 0 or infinity,
// which no caller tells apart.
inline vfloat vexp(vfloat x) {
  x = x < -87.3f ? splat(-87.3f) : x;
  x = x > 88.3f ? splat(88.3f) : x;
  const vfloat t = x * 1.44269504088896341f + 0.5f;
  const vint truncated = __builtin_convertvector(t, vint);  // toward zero
  vfloat n = __builtin_convertvector(truncated, vfloat);
  n = n > t ? n - 1.0f : n;  // floor(x log2 e + 1/2): the nearest n
  const vfloat r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vfloat y = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// f(std::integral_constant<int64_t, R>{}) with R = rows, 1 to 8 (more: 8):
// a row count the compiler knows, so that per-row accumulators stay in
// registers (indexed by a runtime count they live in memory).
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    case 4: f(std::integral_constant<int64_t, 4>{}); break;
    case 5: f(std::integral_constant<int64_t, 5>{}); break;
    case 6: f(std::integral_constant<int64_t, 6>{}); break;
    case 7: f(std::integral_constant<int64_t, 7>{}); break;
    default: f(std::integral_constant<int64_t, 8>{}); break;
  }
}

// f(std::integral_constant<int64_t, n>{}) for n = 1 .. kMax (n <= kMax).
template <int64_t kMax, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (kMax > 1) {
    if (n < kMax) return with_count<kMax - 1>(n, f);
  }
  f(std::integral_constant<int64_t, kMax>{});
}

}  // namespace specpage_cpu
