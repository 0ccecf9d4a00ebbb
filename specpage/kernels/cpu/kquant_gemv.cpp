// Products of x [rows, in] by GGML K-quant weights (Q4_K, Q5_K, Q6_K), read
// as a GGUF stores them: W [out, in / 256 super-blocks] of
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and
//        mins m[8] packed, 128 bytes of nibbles: byte i of chunk c (32
//        bytes) holds value 64c + i in its low nibble, 64c + 32 + i in its
//        high one; w = d sc[s] q - dmin m[s], s the sub-block of 32;
//   Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits before the
//        nibbles: bit s of byte i is value 32s + i's;
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
//        int8 scales (one per 16 values), fp16 d; w = d sc[g] (q - 32).
// As llama.cpp does on a CPU, x is first taken to int8 per row and
// super-block (a Q8_K block: here d = max |x| / 127 and q = round(x / d) to
// nearest even, the sums of q per 16 for the mins and offsets), then the weights' integer levels times
// q are summed exactly in int32 with vpdpbusd, the sub-block scales applied
// to those int32 sums, and per super-block
//   y += d_w d_x sum_s sc[s] dot_s - dmin_w d_x sum_s m[s] xsum_s.
// The weights are exact; x loses what 8 bits per 256 values lose.
//
// One output at a time (its weight row read once, front to back) for up to
// 8 rows of x, which share each super-block's unpacking; more rows take more
// passes while the weight row is in L1. Each row's sums run in one order
// whatever the other rows or their number, so a row's result is the same
// bit for bit alone or in any batch (layers/products.py row_invariant).
// Threads split the outputs.
//
// Without AVX-512 VNNI and BW a portable loop computes the same sums (the
// int32 sums are exact, so only the float steps' order differs).
//
// Registered as torch.ops.specpage_cpu.kquant_quantize_x (x to Q8_K) and
// kquant_gemv (Q8_K x by one tensor's blocks, into a slice of y's columns,
// so that a fused projection's parts of several types share one x and one
// y); kquant_dequantize gives the bf16 weights for the dense products of
// many rows. layers/kquant.py holds the reference and chooses.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQUANT_VNNI 1
#endif
#if defined(KQUANT_VNNI) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kSuper = 256;  // values per super-block (GGML's QK_K)
constexpr int64_t kQ4KBytes = 144, kQ5KBytes = 176, kQ6KBytes = 210;
// GGML's type numbers, as the GGUF names them (ggml_type)
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;

// x's Q8_K block, GGML's block_q8_K: 292 bytes.
struct Q8KBlock {
  float d;
  int8_t q[kSuper];
  int16_t sums[kSuper / 16];  // of q per 16
};
static_assert(sizeof(Q8KBlock) == 292, "block_q8_K is 292 bytes");

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // (c10::Half's conversion is a dozen integer ops)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K/Q5_K's 12 bytes to four words: bytes 0-7 sc[8], bytes 8-15 m[8], as
// llama.cpp unpacks them (6 bits each; the top 2 of sub-blocks 4-7 in the
// top bits of bytes 0-7). Words, not bytes in memory: a vector load of
// bytes just stored as words waits for the stores to retire.
inline void scale_words(const uint8_t* packed, uint32_t* u) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins_low = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins_low;
  u[0] &= kLow6;
}

inline void unpack_scales(const uint8_t* packed, uint8_t* scales_mins) {
  uint32_t u[4];
  scale_words(packed, u);
  std::memcpy(scales_mins, u, 16);
}

// A block of x whose largest value is below this is taken as zero (d = 0):
// its products with any weight (scales down to fp16's least, 2^-24) would
// be below the least normal float, and arithmetic on subnormal floats takes
// a microcode assist on x86, some hundred cycles an instruction. A random
// 1B model's MLP activations fell there: its 5-row down projections took
// 16 ms instead of 0.6 (docs/BENCHMARKS.md, "kquant_stack").
constexpr float kLeastBlockMax = 0x1p-90f;

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t in, Q8KBlock* out) {
  for (int64_t b = 0; b < in / kSuper; ++b) {
    const scalar_t* v = x + b * kSuper;
    Q8KBlock& block = out[b];
    float amax = 0.0f, total = 0.0f;
    for (int64_t i = 0; i < kSuper; ++i) {
      const float f = static_cast<float>(v[i]);
      amax = std::max(amax, std::fabs(f));
      total += f;
    }
    std::memset(block.q, 0, sizeof(block.q));
    std::memset(block.sums, 0, sizeof(block.sums));
    if (!std::isfinite(total) || !std::isfinite(amax)) {
      block.d = std::nanf("");  // its products come out NaN, as a dense product's would
      continue;
    }
    if (amax < kLeastBlockMax) {
      block.d = 0.0f;  // q and sums stay 0
      continue;
    }
    const float inverse = 127.0f / amax;
    for (int64_t i = 0; i < kSuper; ++i) {
      block.q[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(v[i]) * inverse));
    }
    for (int64_t g = 0; g < kSuper / 16; ++g) {
      int sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += block.q[16 * g + i];
      block.sums[g] = static_cast<int16_t>(sum);
    }
    block.d = amax / 127.0f;
  }
}

// ---- the products of one weight row by kRows rows of x ----
//
// `x` points at the first row's Q8_K blocks, rows `stride` blocks apart;
// dots[r] gets row r's product.

#if defined(KQUANT_VNNI)
// The 32 bytes at p in both halves of a vector.
inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A super-block's 256 levels, unsigned, as four vectors of 64: vector c
// holds values 64c..64c+63 in order (as x's q lie).
template <int64_t kType>
inline void unpack_levels(const uint8_t* block, __m512i* levels) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  if constexpr (kType == kQ4K || kType == kQ5K) {
    const uint8_t* nibbles = block + (kType == kQ4K ? 16 : 48);
    // shift counts per 16-bit word: the low half of a vector 0, the high half 4
    const __m512i shift_0_4 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    for (int c = 0; c < 4; ++c) {
      // chunk c's low nibbles are sub-block 2c, its high ones 2c + 1
      levels[c] = _mm512_and_si512(_mm512_srlv_epi16(both_halves(nibbles + 32 * c), shift_0_4), low4);
    }
    if constexpr (kType == kQ5K) {
      const __m512i high = both_halves(block + 16);  // bit s of byte i: value 32s + i's
      for (int c = 0; c < 4; ++c) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * c))),
                                               _mm256_set1_epi8(static_cast<char>(2 << (2 * c))), 1);
        const __mmask64 set = _mm512_test_epi8_mask(high, bit);
        levels[c] = _mm512_mask_add_epi8(levels[c], set, levels[c], _mm512_set1_epi8(16));
      }
    }
  } else {
    const uint8_t* low = block;         // 128 bytes
    const uint8_t* high = block + 128;  // 64 bytes
    const __m512i low2 = _mm512_set1_epi8(0x03);
    const __m512i shift_0_2 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_4_6 = _mm512_add_epi16(shift_0_2, _mm512_set1_epi16(4));
    for (int h = 0; h < 2; ++h) {
      const __m512i nibbles = _mm512_loadu_si512(low + 64 * h);
      const __m512i pairs = both_halves(high + 32 * h);
      // values 128h + 0..63: low nibbles, bits 0-1 (first 32) and 2-3 of the pairs;
      // 128h + 64..127: high nibbles, bits 4-5 and 6-7
      const __m512i top_a = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(pairs, shift_0_2), low2), 4);
      const __m512i top_b = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(pairs, shift_4_6), low2), 4);
      levels[2 * h] = _mm512_or_si512(_mm512_and_si512(nibbles, low4), top_a);
      levels[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4), top_b);
    }
  }
}

// The scales of a pair of vectors' dot products (vectors 2p and 2p + 1 of
// a super-block), as _mm512_packs_epi32 lays out those int32 sums in int16:
// in 128-bit lane k, four of vector 2p's lanes (4k..4k+3), then four of
// 2p + 1's. Entries index the super-block's scales as int16 lanes.
// Q4_K/Q5_K: a vector's lanes 0-7 are sub-block 2c, 8-15 sub-block 2c + 1.
alignas(64) constexpr int16_t kSubBlockPairs[2][32] = {
    {0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3},
    {4, 4, 4, 4, 6, 6, 6, 6, 4, 4, 4, 4, 6, 6, 6, 6, 5, 5, 5, 5, 7, 7, 7, 7, 5, 5, 5, 5, 7, 7, 7, 7}};
// Q6_K: a vector c's lanes 4k..4k+3 are its 16s 4c + k.
alignas(64) constexpr int16_t kSixteenPairs[2][32] = {
    {0, 0, 0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 5, 5, 5, 5, 2, 2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 7, 7, 7, 7},
    {8, 8, 8, 8, 12, 12, 12, 12, 9, 9, 9, 9, 13, 13, 13, 13,
     10, 10, 10, 10, 14, 14, 14, 14, 11, 11, 11, 11, 15, 15, 15, 15}};

// Each row's sum over a super-block: per vector of 64 levels, vpdpbusd's
// int32 sums of four products a lane (at most 4 x 63 x 127, so int16 holds
// them), two vectors' packed to int16 and multiplied by their scales with
// vpdpwssd into one int32 sum: exact, and 5 instructions per 128 values.
template <int64_t kRows, int64_t kType>
void row_product(const uint8_t* w, int64_t supers, const Q8KBlock* x, int64_t stride,
                 float* dots) {
  constexpr int64_t kBytes = kType == kQ4K ? kQ4KBytes : kType == kQ5K ? kQ5KBytes : kQ6KBytes;
  constexpr bool kMins = kType != kQ6K;
  const auto& pair_index = kMins ? kSubBlockPairs : kSixteenPairs;
  const __m512i index0 = _mm512_load_si512(pair_index[0]);
  const __m512i index1 = _mm512_load_si512(pair_index[1]);
  __m512 total[kRows];
  for (int64_t r = 0; r < kRows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = w + s * kBytes;
    // every line of the block kPrefetchAhead on (one a block would miss
    // some: blocks are 144 to 210 bytes)
    for (int64_t line = 0; line < kBytes; line += 64) {
      __builtin_prefetch(block + kPrefetchAhead + line, 0, 2);
    }
    __m512i levels[4];  // values 64c..64c+63, unsigned
    unpack_levels<kType>(block, levels);
    __m256i scales16;  // int16: Q4_K/Q5_K sc[8] then m[8]; Q6_K its 16 scales
    // Q4_K/Q5_K: m[s] against x's sums of sub-block s (its two 16s): m[s]
    // in both int16 of word s; Q6_K: each 16's scale against x's sum of it
    // (the offset -32)
    __m256i sum_weights;
    float d, dmin = 0.0f;
    if constexpr (kMins) {
      uint32_t u[4];
      scale_words(block + 4, u);
      const __m128i bytes = _mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]),
                                          static_cast<int>(u[1]), static_cast<int>(u[0]));
      scales16 = _mm256_cvtepu8_epi16(bytes);
      sum_weights = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes));
      d = half_at(block);
      dmin = half_at(block + 2);
    } else {
      scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
      sum_weights = scales16;
      d = half_at(block + 208);
    }
    const __m512i wide = _mm512_castsi256_si512(scales16);  // (the index reads lanes 0-15 only)
    const __m512i pair_scales[2] = {_mm512_permutexvar_epi16(index0, wide),
                                    _mm512_permutexvar_epi16(index1, wide)};
    for (int64_t r = 0; r < kRows; ++r) {
      const Q8KBlock& xb = x[r * stride + s];
      const __m256i xsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.sums));
      const __m256i offsets = _mm256_madd_epi16(xsums, sum_weights);  // 8 int32
      __m512i sum = kMins ? _mm512_setzero_si512()
                          : _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(),
                                                                    _mm256_slli_epi32(offsets, 5)));
      for (int p = 0; p < 2; ++p) {
        const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), levels[2 * p],
                                              _mm512_loadu_si512(xb.q + 128 * p));
        const __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), levels[2 * p + 1],
                                              _mm512_loadu_si512(xb.q + 128 * p + 64));
        sum = _mm512_dpwssd_epi32(sum, _mm512_packs_epi32(a, b), pair_scales[p]);
      }
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * xb.d), total[r]);
      if constexpr (kMins) {
        total[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(offsets)),
                                    _mm512_set1_ps(dmin * xb.d), total[r]);
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) dots[r] = _mm512_reduce_add_ps(total[r]);
}

// A super-block's weights in fp32 as GGML computes them ((d sc) q - dmin m,
// or (d sc) (q - 32)), rounded to bf16.
template <int64_t kType>
void dequantize_block(const uint8_t* block, c10::BFloat16* out) {
  alignas(64) uint8_t levels[kSuper];
  {
    __m512i vectors[4];
    unpack_levels<kType>(block, vectors);
    for (int c = 0; c < 4; ++c) _mm512_store_si512(levels + 64 * c, vectors[c]);
  }
  float scale[kSuper / 16], min[kSuper / 16] = {};  // per 16 values
  if constexpr (kType == kQ6K) {
    const float d = half_at(block + 208);
    for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(reinterpret_cast<const int8_t*>(block + 192)[g]);
  } else {
    uint8_t scales_mins[16];
    unpack_scales(block + 4, scales_mins);
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int g = 0; g < 16; ++g) {
      scale[g] = d * static_cast<float>(scales_mins[g / 2]);
      min[g] = dmin * static_cast<float>(scales_mins[8 + g / 2]);
    }
  }
  const __m512i offset = _mm512_set1_epi32(kType == kQ6K ? 32 : 0);
  for (int g = 0; g < 16; ++g) {
    const __m512i q = _mm512_sub_epi32(
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(levels + 16 * g))), offset);
    // one rounding, as GGML's: Q4_K/Q5_K's product is exact (d sc has 17
    // bits, q 5), Q6_K subtracts nothing
    const __m512 w = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[g]), _mm512_cvtepi32_ps(q)),
                                   _mm512_set1_ps(min[g]));
    store(out + 16 * g, (vfloat)w);
  }
}
#else
// The portable way: the same int32 sums, per sub-block, in plain loops.
template <int64_t kRows, int64_t kType>
void row_product(const uint8_t* w, int64_t supers, const Q8KBlock* x, int64_t stride,
                 float* dots) {
  constexpr int64_t kBytes = kType == kQ4K ? kQ4KBytes : kType == kQ5K ? kQ5KBytes : kQ6KBytes;
  float total[kRows] = {};
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = w + s * kBytes;
    uint8_t levels[kSuper];
    int32_t scales[kSuper / 16];  // per 16 values
    int32_t mins[8] = {};
    float d, dmin = 0.0f;
    if constexpr (kType == kQ4K || kType == kQ5K) {
      const uint8_t* nibbles = block + (kType == kQ4K ? 16 : 48);
      uint8_t scales_mins[16];
      unpack_scales(block + 4, scales_mins);
      for (int c = 0; c < 4; ++c) {
        for (int i = 0; i < 32; ++i) {
          levels[64 * c + i] = nibbles[32 * c + i] & 0x0f;
          levels[64 * c + 32 + i] = nibbles[32 * c + i] >> 4;
        }
      }
      if constexpr (kType == kQ5K) {
        for (int i = 0; i < kSuper; ++i) levels[i] |= ((block[16 + i % 32] >> (i / 32)) & 1) << 4;
      }
      for (int g = 0; g < 16; ++g) scales[g] = scales_mins[g / 2];
      for (int sub = 0; sub < 8; ++sub) mins[sub] = scales_mins[8 + sub];
      d = half_at(block);
      dmin = half_at(block + 2);
    } else {
      for (int i = 0; i < kSuper; ++i) {
        const int h = i / 128, j = i % 128;
        const uint8_t nibble = block[64 * h + j % 64] >> (4 * (j / 64)) & 0x0f;
        const uint8_t pair = block[128 + 32 * h + j % 32] >> (2 * (j / 32)) & 0x03;
        levels[i] = nibble | pair << 4;
      }
      for (int g = 0; g < 16; ++g) scales[g] = reinterpret_cast<const int8_t*>(block + 192)[g];
      d = half_at(block + 208);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const Q8KBlock& xb = x[r * stride + s];
      int32_t sum = 0, min_sum = 0;
      for (int g = 0; g < 16; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) dot += levels[16 * g + i] * xb.q[16 * g + i];
        if constexpr (kType == kQ6K) dot -= 32 * xb.sums[g];
        sum += scales[g] * dot;
        min_sum += mins[g / 2] * xb.sums[g];
      }
      total[r] += d * xb.d * static_cast<float>(sum);
      total[r] -= dmin * xb.d * static_cast<float>(min_sum);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) dots[r] = total[r];
}

template <int64_t kType>
void dequantize_block(const uint8_t* block, c10::BFloat16* out) {
  float values[kSuper];
  if constexpr (kType == kQ6K) {
    const float d = half_at(block + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int i = 0; i < kSuper; ++i) {
      const int h = i / 128, j = i % 128;
      const int nibble = block[64 * h + j % 64] >> (4 * (j / 64)) & 0x0f;
      const int pair = block[128 + 32 * h + j % 32] >> (2 * (j / 32)) & 0x03;
      values[i] = d * static_cast<float>(scales[i / 16]) * static_cast<float>((nibble | pair << 4) - 32);
    }
  } else {
    const uint8_t* nibbles = block + (kType == kQ4K ? 16 : 48);
    uint8_t scales_mins[16];
    unpack_scales(block + 4, scales_mins);
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int i = 0; i < kSuper; ++i) {
      const int sub = i / 32, c = i / 64;
      int q = nibbles[32 * c + i % 32] >> (4 * (sub % 2)) & 0x0f;
      if constexpr (kType == kQ5K) q |= ((block[16 + i % 32] >> sub) & 1) << 4;
      values[i] = d * static_cast<float>(scales_mins[sub]) * static_cast<float>(q) -
                  dmin * static_cast<float>(scales_mins[8 + sub]);
    }
  }
  for (int64_t i = 0; i < kSuper; i += kLanes) store(out + i, load(values + i));
}
#endif

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4K: return kQ4KBytes;
    case kQ5K: return kQ5KBytes;
    case kQ6K: return kQ6KBytes;
    default:
      TORCH_CHECK(false, "kquant: type ", type, " is not one of Q4_K (12), Q5_K (13), Q6_K (14)");
  }
}

template <int64_t kType>
void product(const at::Tensor& xq, const at::Tensor& blocks, float* y, int64_t y_stride) {
  const int64_t rows = xq.size(0), out = blocks.size(0);
  const int64_t supers = xq.size(1) / static_cast<int64_t>(sizeof(Q8KBlock));
  const auto* x = reinterpret_cast<const Q8KBlock*>(xq.data_ptr<uint8_t>());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  // ~16 KB of weights per claim, so that two threads split even a short product
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / row_bytes);
  at::parallel_for(0, out, grain, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o) {
      for (int64_t row0 = 0; row0 < rows; row0 += 8) {
        with_rows(std::min<int64_t>(8, rows - row0), [&](auto n) {
          constexpr int64_t kRows = decltype(n)::value;
          float dots[kRows];
          row_product<kRows, kType>(w + o * row_bytes, supers, x + row0 * supers, supers, dots);
          for (int64_t r = 0; r < kRows; ++r) y[(row0 + r) * y_stride + o] = dots[r];
        });
      }
    }
  });
}

at::Tensor kquant_quantize_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant_quantize_x: x must be contiguous fp32 or bf16 [rows, in]");
  TORCH_CHECK(x.size(1) % kSuper == 0, "kquant_quantize_x: in must be a multiple of ", kSuper,
              ", got ", x.size(1));
  const int64_t rows = x.size(0), in = x.size(1), supers = in / kSuper;
  at::Tensor xq = at::empty({rows, supers * static_cast<int64_t>(sizeof(Q8KBlock))},
                            x.options().dtype(at::kByte));
  auto* out = reinterpret_cast<Q8KBlock*>(xq.data_ptr<uint8_t>());
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      if (x.scalar_type() == at::kFloat) {
        quantize_row(x.data_ptr<float>() + r * in, in, out + r * supers);
      } else {
        quantize_row(x.data_ptr<c10::BFloat16>() + r * in, in, out + r * supers);
      }
    }
  });
  return xq;
}

// y[:, column : column + out] = x @ W.T, x as kquant_quantize_x gives it.
void kquant_gemv(const at::Tensor& xq, const at::Tensor& blocks, int64_t type, at::Tensor& y,
                 int64_t column) {
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.scalar_type() == at::kByte &&
                  xq.size(1) % static_cast<int64_t>(sizeof(Q8KBlock)) == 0,
              "kquant_gemv: xq must be kquant_quantize_x's uint8 [rows, in / 256 * 292]");
  const int64_t supers = xq.size(1) / static_cast<int64_t>(sizeof(Q8KBlock));
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte &&
                  blocks.size(1) == supers * bytes,
              "kquant_gemv: blocks must be contiguous uint8 [out, ", supers * bytes,
              "] (", supers, " super-blocks of ", bytes, " bytes a row), got ", blocks.sizes());
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.stride(1) == 1 &&
                  y.size(0) == xq.size(0) && column >= 0 &&
                  column + blocks.size(0) <= y.size(1),
              "kquant_gemv: y must be fp32 [rows, >= column + out] with unit column stride");
  float* out = y.data_ptr<float>() + column;
  switch (type) {
    case kQ4K: product<kQ4K>(xq, blocks, out, y.stride(0)); break;
    case kQ5K: product<kQ5K>(xq, blocks, out, y.stride(0)); break;
    default: product<kQ6K>(xq, blocks, out, y.stride(0)); break;
  }
}

// The weights as bf16 [out, in] (dequantize_block).
at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t type) {
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte &&
                  blocks.size(1) % bytes == 0,
              "kquant_dequantize: blocks must be contiguous uint8 [out, in / 256 * ", bytes, "]");
  const int64_t out = blocks.size(0), supers = blocks.size(1) / bytes, in = supers * kSuper;
  at::Tensor w = at::empty({out, in}, blocks.options().dtype(at::kBFloat16));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  c10::BFloat16* dense = w.data_ptr<c10::BFloat16>();
  at::parallel_for(0, out * supers, 64, [&](int64_t first, int64_t last) {
    for (int64_t at = first; at < last; ++at) {
      switch (type) {
        case kQ4K: dequantize_block<kQ4K>(data + at * bytes, dense + at * kSuper); break;
        case kQ5K: dequantize_block<kQ5K>(data + at * bytes, dense + at * kSuper); break;
        default: dequantize_block<kQ6K>(data + at * bytes, dense + at * kSuper); break;
      }
    }
  });
  return w;
}

bool has_kquant_vnni() {
#if defined(KQUANT_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("kquant_quantize_x(Tensor x) -> Tensor");
  m.def("kquant_gemv(Tensor xq, Tensor blocks, int type, Tensor(a!) y, int column) -> ()");
  m.def("kquant_dequantize(Tensor blocks, int type) -> Tensor");
  m.def("has_kquant_vnni() -> bool");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) {
  m.impl("kquant_quantize_x", &kquant_quantize_x);
  m.impl("kquant_gemv", &kquant_gemv);
  m.impl("kquant_dequantize", &kquant_dequantize);
}

TORCH_LIBRARY_IMPL(specpage_cpu, CompositeExplicitAutograd, m) {
  m.impl("has_kquant_vnni", &has_kquant_vnni);
}
